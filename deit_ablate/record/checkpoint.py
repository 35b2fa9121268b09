"""Checkpoints: written atomically (temp file + rename) with the previous copy kept, read with weights_only=True,
resumable mid-epoch; an unreadable one is reported by name (and a resume falls back to the copy before it)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from deit_ablate.core.atomic import atomic_write
from deit_ablate.core.errors import ConfigError
from deit_ablate.record import resume
from deit_ablate.record.resume import CheckpointUnreadable, ResumePoint, load, unreadable_reason
from deit_ablate.record.rundir import UNREADABLE, RunDir


def save_atomic(state: dict[str, Any], path: str | os.PathLike, keep_previous: str | os.PathLike | None = None) -> None:
    """Write `state` so that `path` is either the old file or the complete new one, never half of one; with
    `keep_previous`, the old file is renamed there first (one older good copy). A full disk is a RunError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda handle: torch.save(state, handle), keep_previous=keep_previous)


def copy_atomic(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make `path` a copy of the checkpoint file `source`, atomically and durably as save_atomic, without
    serializing the state again (about half of save_atomic's time). A copy, not a hard link: a later in-place write
    to one file (torch.save, cp) must not change the other."""
    import shutil

    with open(source, "rb") as src:
        atomic_write(path, lambda handle: shutil.copyfileobj(src, handle, 1 << 22))


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _read_file(path: Path, source: str = "checkpoint") -> Mapping[str, Any]:
    """Load a checkpoint file to CPU: safetensors, or a torch pickle with weights_only=True."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as error:  # safetensors raises its own SafetensorError for a damaged header
            raise CheckpointUnreadable(path, unreadable_reason(error), source) from None
    return load(path, source)


def extract_state_dict(obj: Mapping[str, Any], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Weights from ``{"model": sd}``, ``{"state_dict": sd}`` or a bare sd; strip DDP/compile prefixes."""
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{source} holds a {type(obj).__name__}, not a state dict or a dict holding one.")
    state = obj
    for key in ("model", "state_dict"):
        if isinstance(obj.get(key), Mapping):
            state = obj[key]
            break
    if not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(
            f"{source} is not a recognised checkpoint layout (top-level keys: {sorted(obj)[:8]}). Expected a "
            "state dict, {'model': state_dict} or {'state_dict': state_dict}; re-save the weights "
            "in one of these layouts."
        )
    out = {}
    for key, value in state.items():
        for prefix in _WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def read_weights(path: str | os.PathLike, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The model weights in a checkpoint file of any usual layout (safetensors too), DDP prefixes stripped."""
    return extract_state_dict(_read_file(Path(path), source), source=source)


def training_state(trainer, epoch: int, best_top1: float, batches_done: int = 0, **extra: Any) -> dict[str, Any]:
    """What a resume needs: the trainer's state and where the run stands (epoch, batch), plus `extra` (the
    run's train_seconds so far, training_complete, bad_images)."""
    return {**trainer.state_dict(), "epoch": epoch, "best_top1": best_top1, "batches_done": batches_done, **extra}


def restore(trainer, state: dict[str, Any]) -> tuple[int, float, int]:
    """Load a training state; returns (epoch to run, best top-1 so far, batches of it already done)."""
    trainer.load_state_dict(state)
    return int(state["epoch"]), float(state["best_top1"]), int(state.get("batches_done", 0))


def find_resume_point(run_dir: Path) -> ResumePoint | None:
    """The newest readable checkpoint of a run folder to resume from, read whole (record/resume.py) once its pickle
    was read within bounds (resume.peek_training_state: a crafted one is refused before torch reads it)."""

    def read(path: Path) -> dict[str, Any]:
        resume.peek_training_state(path)
        return resume.checked_training_state(path, load(path))

    return resume.find_resume_point(run_dir, read)


def set_aside(path: Path) -> Path:
    """Rename an unreadable checkpoint to `<name>.unreadable`, so that it is never kept as the older good copy."""
    aside = path.with_name(UNREADABLE.format(path.name))
    os.replace(path, aside)
    return aside


def remove_stale_temp_files(run_dir: Path) -> list[Path]:
    """Delete the temp files a killed writer left in a run folder (only while holding the run's lock)."""
    removed = RunDir(run_dir).stale_temp_files()
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


class MidEpochSaver:
    """Called after every step: rank 0 saves a resumable checkpoint every N steps or M minutes, so a
    preempted or timed-out job loses at most that much work and ends with the same step count. Rank 0 alone
    keeps the time, so a save M minutes on waits for a step where `ready()` says that what `extra` holds is
    whole (the loss summed over the ranks: the next logging step); every rank knows the steps of the N-step rule
    (`by_steps`)."""

    def __init__(self, trainer, path: Path, every_steps: int, every_minutes: float, enabled: bool,
                 keep_previous: Path | None = None, extra: Callable[[], dict[str, Any]] = dict,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.trainer, self.path, self.enabled = trainer, path, enabled
        self.keep_previous, self.extra, self.ready = keep_previous, extra, ready
        self.every_steps, self.every_seconds = every_steps, 60 * every_minutes
        self.last_save = time.monotonic()
        self.epoch, self.best_top1, self.skipped = 0, 0.0, 0

    def start_epoch(self, epoch: int, best_top1: float, skipped: int) -> None:
        self.epoch, self.best_top1, self.skipped = epoch, best_top1, skipped

    def by_steps(self) -> bool:
        """Whether the N-step rule saves at the trainer's step (the same answer on every rank)."""
        return bool(self.every_steps) and self.trainer.step % self.every_steps == 0

    def __call__(self, batches_in_loader: int) -> None:
        if not self.enabled:
            return
        by_time = self.every_seconds and time.monotonic() - self.last_save >= self.every_seconds and self.ready()
        if self.by_steps() or by_time:
            self.save(batches_in_loader)

    def save(self, batches_in_loader: int) -> None:
        """Write the resumable state after `batches_in_loader` batches of this epoch's loader (rank 0 only)."""
        if self.enabled:
            done = self.skipped + batches_in_loader
            state = training_state(self.trainer, self.epoch, self.best_top1, done, **self.extra())
            save_atomic(state, self.path, self.keep_previous)
            self.last_save = time.monotonic()
