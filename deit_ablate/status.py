"""`python -m deit_ablate.status`: where every run of a sweep stands (analysis/status/), kept at this path for the
command line as `deit-status`."""

import sys

from deit_ablate.run.commands import deit_status

if __name__ == "__main__":
    sys.exit(deit_status())
