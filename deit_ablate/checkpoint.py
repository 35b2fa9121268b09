"""Checkpoints: written atomically (temp file + rename), read with weights_only=True, resumable mid-epoch."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deit_ablate.errors import ConfigError


def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write `state` so that `path` is either the old file or the complete new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint on the CPU without unpickling arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _read_file(path: Path) -> Mapping[str, Any]:
    """Load a checkpoint file to CPU: safetensors, or a torch pickle with weights_only=True."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    return load(path)


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
    return extract_state_dict(_read_file(Path(path)), source=source)


def training_state(trainer, epoch: int, best_top1: float, batches_done: int = 0) -> dict[str, Any]:
    """What a resume needs: weights, optimizer, schedule, EMA and where the run stands (epoch, batch)."""
    return {**trainer.state_dict(), "epoch": epoch, "best_top1": best_top1, "batches_done": batches_done}


def restore(trainer, state: dict[str, Any]) -> tuple[int, float, int]:
    """Load a training state; returns (epoch to run, best top-1 so far, batches of it already done)."""
    trainer.load_state_dict(state)
    return int(state["epoch"]), float(state["best_top1"]), int(state.get("batches_done", 0))


class MidEpochSaver:
    """Called after every step: rank 0 saves a resumable checkpoint every N steps or M minutes, so a
    preempted or timed-out job loses at most that much work and ends with the same step count."""

    def __init__(self, trainer, path: Path, every_steps: int, every_minutes: float, enabled: bool) -> None:
        self.trainer, self.path, self.enabled = trainer, path, enabled
        self.every_steps, self.every_seconds = every_steps, 60 * every_minutes
        self.last_save = time.monotonic()
        self.epoch, self.best_top1, self.skipped = 0, 0.0, 0

    def start_epoch(self, epoch: int, best_top1: float, skipped: int) -> None:
        self.epoch, self.best_top1, self.skipped = epoch, best_top1, skipped

    def __call__(self, batches_in_loader: int) -> None:
        if not self.enabled:
            return
        by_steps = self.every_steps and self.trainer.step % self.every_steps == 0
        by_time = self.every_seconds and time.monotonic() - self.last_save >= self.every_seconds
        if by_steps or by_time:
            done = self.skipped + batches_in_loader
            save_atomic(training_state(self.trainer, self.epoch, self.best_top1, done), self.path)
            self.last_save = time.monotonic()
