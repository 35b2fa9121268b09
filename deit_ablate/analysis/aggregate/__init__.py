"""The aggregator: read wandb runs (offline logs or the W&B API) and rebuild the ablation table.

`reader` turns logs into `RunInfo` (`api`: runs of the W&B API), `select` filters and de-duplicates, `settings`
says which runs are the same experiment (one cell), `table` groups rows and stages into `cells`, `deltas` and
`stats` give each Δ its interval over seeds, `paper` reads the paper's numbers (the studies' numbers
files), `about` says what was run, `render`, `html`, `plot` and `curves` write the result, `cli` ties them
together.
"""

from .api import read_api
from .cells import Table
from .paper import PaperTable, paper_table
from .reader import RunInfo, read_offline, read_run_file
from .select import RunFilter, dedup
from .table import build_table

__all__ = [
    "PaperTable",
    "RunFilter",
    "RunInfo",
    "Table",
    "build_table",
    "dedup",
    "paper_table",
    "read_api",
    "read_offline",
    "read_run_file",
]
