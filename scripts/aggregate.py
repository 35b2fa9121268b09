#!/usr/bin/env python
"""Rebuild Table 8 (or another grouping) from wandb runs; see `python scripts/aggregate.py --help`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deit_ablate.core.ctrl_c import take_ctrl_c  # noqa: E402

if __name__ == "__main__":
    take_ctrl_c("deit-aggregate")  # before the other imports: a Ctrl-C while they load ends with one line too
    from deit_ablate.run.commands import deit_aggregate

    raise SystemExit(deit_aggregate())
