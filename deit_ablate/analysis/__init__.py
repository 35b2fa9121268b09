"""Reading finished runs: the tables, disagreement between models, sharpness of a run folder."""
