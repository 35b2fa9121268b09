"""A Hydra callback for tests: at each job's start, append the process's forks (its children running its own
program: loader workers; not wandb's service) to the file $CHILD_COUNT_FILE names, one JSON line per job."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


def forks() -> list[int]:
    """This process's children that run its own command line (a DataLoader worker is a fork), from /proc."""
    own = Path("/proc/self/cmdline").read_bytes()
    children = [int(pid) for task in Path(f"/proc/{os.getpid()}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    return [pid for pid in children if _cmdline(pid) == own]


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return None


class ChildCount(Callback):
    """Record this process's forks at the start of each job of a sweep."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        line = {"seed": int(config.seed), "forks": forks()}
        with open(os.environ["CHILD_COUNT_FILE"], "a") as file:
            file.write(json.dumps(line) + "\n")
