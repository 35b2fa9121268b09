"""`python -m deit_ablate.disagreement`: the disagreement matrix of finished runs (analysis/disagreement.py),
kept at this path for the command line."""

import sys

from deit_ablate.run.commands import ANALYSIS_EXTRA, run_entry

if __name__ == "__main__":  # imported inside run_entry: a Ctrl-C during the imports ends with one line too
    sys.exit(run_entry("python -m deit_ablate.disagreement", "deit_ablate.analysis.disagreement:main",
                       needs=ANALYSIS_EXTRA))
