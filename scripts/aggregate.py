#!/usr/bin/env python
"""Rebuild Table 8 (or another grouping) from wandb runs; see `python scripts/aggregate.py --help`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deit_ablate.run.commands import deit_aggregate  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(deit_aggregate())
