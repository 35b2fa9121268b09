"""`python -m deit_ablate.sharpness`: measure a finished run's sharpness (analysis/sharpness.py),
kept at this path for the command line."""

import sys

from deit_ablate.analysis.sharpness import main

if __name__ == "__main__":
    sys.exit(main())
