"""`python -m deit_ablate.sharpness`: measure a finished run's sharpness (analysis/sharpness.py),
kept at this path for the command line."""

import sys

from deit_ablate.core.ctrl_c import take_ctrl_c

if __name__ == "__main__":
    take_ctrl_c("python -m deit_ablate.sharpness")  # before the other imports: a Ctrl-C while they load is one line
    from deit_ablate.run.commands import run_entry

    sys.exit(run_entry("python -m deit_ablate.sharpness", "deit_ablate.analysis.sharpness:main"))
