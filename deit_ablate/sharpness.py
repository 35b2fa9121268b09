"""`python -m deit_ablate.sharpness`: measure a finished run's sharpness (analysis/sharpness.py),
kept at this path for the command line."""

import sys

from deit_ablate.run.commands import run_entry

if __name__ == "__main__":  # imported inside run_entry: a Ctrl-C during the imports ends with one line too
    sys.exit(run_entry("python -m deit_ablate.sharpness", "deit_ablate.analysis.sharpness:main"))
