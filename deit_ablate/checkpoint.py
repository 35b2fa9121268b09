"""Checkpoints written atomically (temp file + rename) and read with weights_only=True."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


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


def model_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint in any of the usual layouts ({"model": ...}, {"state_dict": ...}, bare)."""
    for key in ("model", "state_dict"):
        if isinstance(checkpoint.get(key), dict):
            checkpoint = checkpoint[key]
            break
    return {k.removeprefix("module."): v for k, v in checkpoint.items()}
