"""`python -m deit_ablate.disagreement`: the disagreement matrix of finished runs (analysis/disagreement.py),
kept at this path for the command line."""

import sys

from deit_ablate.analysis.disagreement import main

if __name__ == "__main__":
    sys.exit(main())
