"""`python -m deit_ablate.disagreement`: the disagreement matrix of finished runs (analysis/disagreement.py),
kept at this path for the command line."""

import sys

from deit_ablate.core.ctrl_c import take_ctrl_c

if __name__ == "__main__":
    take_ctrl_c("python -m deit_ablate.disagreement")  # before the other imports: a Ctrl-C while they load is one line
    from deit_ablate.run.commands import ANALYSIS_EXTRA, run_entry

    sys.exit(run_entry("python -m deit_ablate.disagreement", "deit_ablate.analysis.disagreement:main",
                       needs=ANALYSIS_EXTRA))
