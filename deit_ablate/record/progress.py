"""progress.json: where a launch stands, for a reader outside the run (`deit-status`), with no wandb and no log parsing.

Rank 0 rewrites it atomically (core/atomic.py) at most every PROGRESS_EVERY_S seconds as steps go by, at each epoch's
end and at the launch's end, so a reader sees the previous record or the new one whole; a write that fails (a full
disk) is a warning, never the end of the training. It names the launch's state
(`running`, then `finished`, `diverged`, `stopped` by a signal or time limit, or `failed` with the error), the step
and epoch of the total, the training seconds of all launches, the step and training seconds this launch started (or
resumed) at and its images/s since then (launch_rate), when it started and last wrote, the last and best top-1, and
its holder (pid, host, world size, SLURM job). It is never part of a run's identity or its wandb config: nothing the
run computes reads it. `epoch` counts from 1, as the logs do: the epoch under way (after an epoch's evaluation, that
epoch).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from deit_ablate.core.atomic import write_json_atomic
from deit_ablate.core.errors import RunError
from deit_ablate.core.logs import log
from deit_ablate.record.rundir import RunDir
from deit_ablate.record.runfiles import DamagedRecord, read_json_mapping

PROGRESS_EVERY_S = 5.0  # the most often a launch rewrites progress.json as steps go by
STATES = ("running", "finished", "diverged", "stopped", "failed")
NUMBERS = ("epoch", "epochs", "step", "total_steps", "images_per_step", "img_per_s", "elapsed_s", "start_step",
           "start_elapsed_s", "last_top1", "best_top1")  # the record's numbers: each a finite number, or null


def now_iso() -> str:
    """This moment in UTC, as the record writes times."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def slurm_job_id() -> str | None:
    """This process's SLURM job as squeue names it: `<array job>_<task>` for a task of a job array (a sweep's
    runs), else SLURM_JOB_ID; None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def holder_facts(world_size: int) -> dict[str, Any]:
    """Who writes the record: pid, host, world size and the SLURM job (when under one)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "world_size": world_size,
            "slurm_job": slurm_job_id(), "slurm_restart": os.environ.get("SLURM_RESTART_COUNT")}


class ProgressFile:
    """The progress.json of one launch (written only when `enabled`: rank 0)."""

    def __init__(self, run_dir: RunDir, total_steps: int, epochs: int, images_per_step: int, world_size: int,
                 clock: Callable[[], float], enabled: bool = True, every_s: float = PROGRESS_EVERY_S) -> None:
        self.run_dir, self.clock, self.enabled, self.every_s = run_dir, clock, enabled, every_s
        self.record: dict[str, Any] = {
            "state": "running", "epoch": 0, "epochs": epochs, "step": 0, "total_steps": total_steps,
            "images_per_step": images_per_step, "img_per_s": None, "elapsed_s": 0.0, "start_step": 0,
            "start_elapsed_s": 0.0, "started": now_iso(), "updated": now_iso(), "last_top1": None, "best_top1": None,
            **holder_facts(world_size)}
        self._written_at = -float("inf")
        self._warned = False

    def start(self, epoch: int, step: int) -> None:
        """The launch begins training at `epoch` (0-based), `step` (a resume's, or 0): its images/s count from here."""
        self.update(epoch=epoch + 1, step=step, start_step=step, start_elapsed_s=round(self.clock(), 1))

    def step(self, epoch: int, step: int) -> None:
        """After an optimizer step: written when PROGRESS_EVERY_S have passed since the last write."""
        if time.monotonic() - self._written_at >= self.every_s:
            self.update(epoch=epoch + 1, step=step)

    def evaluated(self, epoch: int, step: int, top1: float, best_top1: float) -> None:
        """Epoch `epoch`'s evaluation: its top-1, the best so far; written at once."""
        self.update(epoch=epoch + 1, step=step, last_top1=top1, best_top1=best_top1)

    def end(self, state: str, step: int, error: str | None = None) -> None:
        """The launch ends as `state` (STATES) at `step`, with the error line of a failure."""
        self.update(state=state, step=step, **({"error": error} if error else {}))

    def update(self, **fields: Any) -> None:
        """Merge `fields` into the record and write it."""
        if not self.enabled:
            return
        self.record.update(fields, elapsed_s=round(self.clock(), 1), updated=now_iso())
        rate = launch_rate(self.record)
        self.record["img_per_s"] = None if rate is None else round(rate, 1)
        self._written_at = time.monotonic()
        try:
            write_json_atomic(self.run_dir.progress, self.record, temp=self.run_dir.temp_for(self.run_dir.progress))
        except (OSError, RunError) as error:  # a status record: never worth stopping the training for
            if not self._warned:
                log.warning(f"[run] cannot write {self.run_dir.progress} ({str(error)[:200]}); training goes on, "
                            "deit-status shows this run's last record")
            self._warned = True


def launch_rate(record: dict[str, Any]) -> float | None:
    """Images per second since the launch started or resumed: its steps since `start_step` times `images_per_step`
    over the training seconds since `start_elapsed_s` (evaluations and checkpoints included, as in the time left);
    a record written before those keys: its `img_per_s` as written (a 5 s window); None before a step."""
    if record.get("start_step") is None or record.get("start_elapsed_s") is None:
        return record.get("img_per_s")
    steps = (record.get("step") or 0) - record["start_step"]
    seconds = (record.get("elapsed_s") or 0.0) - record["start_elapsed_s"]
    if steps <= 0 or seconds <= 0 or not record.get("images_per_step"):
        return None
    return steps * record["images_per_step"] / seconds


def number_problem(record: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    """What is wrong with the first of `keys` in `record` that is neither null nor a finite number
    (`epoch is 'abc', not a number`), or None."""
    for key in keys:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} is {value!r}, not a number"
        if not math.isfinite(value):
            return f"{key} is {value}, not a finite number"
    return None


def read_progress(run_dir: RunDir) -> dict[str, Any] | None:
    """A run folder's progress.json, or None where there is none; a DamagedRecord naming what is wrong when it is
    not the record a launch writes (no regular file, not JSON, not a mapping, a number that is none)."""
    record = read_json_mapping(run_dir.progress, "a progress record")
    if record is None:
        return None
    problem = number_problem(record, NUMBERS)
    if problem is not None:
        raise DamagedRecord(run_dir.progress, problem)
    return record
