"""`python -m deit_ablate.status`: where every run of a sweep stands (analysis/status/), kept at this path for the
command line as `deit-status`."""

import sys

from deit_ablate.analysis.status.cli import main

if __name__ == "__main__":
    sys.exit(main())
