"""`python -m deit_ablate.status`: where every run of a sweep stands (analysis/status/), kept at this path for the
command line as `deit-status`."""

import sys

from deit_ablate.core.ctrl_c import take_ctrl_c

if __name__ == "__main__":
    take_ctrl_c("deit-status")  # before the other imports: a Ctrl-C while they load is one line
    from deit_ablate.run.commands import deit_status

    sys.exit(deit_status())
