"""Finding run logs: the `run-*.wandb` files under a folder, each safe to open (regular, inside it, of sane size)."""

from __future__ import annotations

import fnmatch
import os
import stat
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from deit_ablate.record.rundir import wandb_root

Warn = Callable[[str], None]


def stderr_warn(message: str) -> None:
    """Print a warning line on stderr."""
    print(f"warning: {message}", file=sys.stderr)


MAX_LOG_BYTES = 4 * 1024**3  # a run log above this is skipped (a 300-epoch DeiT run writes a few MB)


def _skip_reason(path: Path, root: Path | None) -> str | None:
    """Why a found path is not read: not a regular file, a symlink out of the folder, too large; None to read."""
    try:
        target = path.resolve(strict=True)
        size, mode = target.stat().st_size, target.stat().st_mode
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop
        return f"cannot be resolved ({error})"
    if root is not None and not target.is_relative_to(root):
        return f"a symlink to {target}, outside {root}"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if size > MAX_LOG_BYTES:
        return f"{size} bytes, above the {MAX_LOG_BYTES}-byte cap for a run log"
    return None


def _readable(files: Iterable[Path], root: Path | None, warn: Warn) -> list[Path]:
    """The files that are safe to open; every other one reported through `warn`."""
    kept = []
    for file in files:
        reason = _skip_reason(file, root)
        if reason is None:
            kept.append(file)
        else:
            warn(f"{file}: skipped, {reason}")
    return kept


def _search(root: Path, warn: Warn) -> list[Path]:
    """Every run-*.wandb below `root` (no symlinked folder followed, as rglob); each folder this user may not read
    is named through `warn` instead of being passed over in silence."""
    found = []

    def unreadable(error: OSError) -> None:
        warn(f"{error.filename}: skipped, cannot be read ({error.strerror}); ask its owner for read access "
             "(chmod -R g+rX for a group)")

    for folder, _, files in os.walk(root, onerror=unreadable):
        found += [Path(folder) / name for name in files if fnmatch.fnmatchcase(name, "run-*.wandb")]
    return found


def find_run_files(path: str | Path, warn: Warn = stderr_warn) -> list[Path]:
    """The `run-*.wandb` files under a wandb folder, its parent, one run folder, or a single file: regular files
    only, no symlink followed out of the folder, none above MAX_LOG_BYTES (each skipped one reported)."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such file or folder: {root}")
    if not root.is_dir():
        return _readable([root], None, warn)
    found = list(root.glob("run-*.wandb"))
    if not found:
        found = list(root.glob("*/run-*.wandb"))
    if not found and wandb_root(root).is_dir():
        found = list(wandb_root(root).glob("*/run-*.wandb"))
    if not found:
        found = _search(root, warn)
    unique: dict[Path, Path] = {}
    for file in sorted(found):  # `latest-run` is a symlink to a run folder already listed
        if any(part == "latest-run" for part in file.parts):
            continue
        try:
            unique.setdefault(file.resolve(), file)
        except (OSError, RuntimeError):  # a symlink loop: _readable says so
            unique.setdefault(file, file)
    return _readable(sorted(unique.values()), root.resolve(), warn)
