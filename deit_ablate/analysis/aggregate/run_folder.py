"""What the aggregator reads from a run folder beside a wandb log: its metrics.csv (the per-epoch rows) and, for a
log cut before its run record, its identity.json and result.json. Each is read within the bounds of
record/runfiles.py (a regular file, at most MAX_RECORD_BYTES, text); a damaged one is one warning line naming it."""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

from deit_ablate.record.rundir import RunDir, runs_root
from deit_ablate.record.runfiles import DamagedRecord, read_text

from .find import Warn


def damage(error: Exception) -> str:
    """What an error reading a run folder's file says is wrong with it, in a few words."""
    if isinstance(error, DamagedRecord):
        return error.problem
    if isinstance(error, OSError):
        return f"cannot be read ({error.strerror or error})"
    return f"{type(error).__name__}: {str(error)[:80]}"


def plain_name(name: Any) -> str | None:
    """`name` when it can name a folder of the runs root (a text, no path separator, not `.` or `..`), else None."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        return None
    return name


def _number(text: str) -> Any:
    try:
        return float(text) if text != "" else None
    except ValueError:
        return text


def whole_epoch(value: Any) -> int | None:
    """An epoch as an int, or None where `value` is no finite whole number from 0 up (NaN, inf, -1, 1.5, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        return None
    return int(value) if value >= 0 else None


def read_metrics_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.csv, numbers as floats (`epoch` as int); a DamagedRecord naming what is wrong when it is
    no regular text file of at most MAX_RECORD_BYTES, not CSV, or a row has other fields than the header or an epoch
    that is no whole number (FileNotFoundError, OSError: as raised)."""
    text = read_text(path)
    try:
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as error:
        raise DamagedRecord(path, f"not CSV ({error})") from None
    out = []
    for number, row in enumerate(rows, 2):  # its line, the header being line 1
        if None in row or None in row.values():
            raise DamagedRecord(path, f"line {number} has other fields than the header (cut or damaged)")
        values = {key: _number(value) for key, value in row.items()}
        if "epoch" in values and (epoch := whole_epoch(values["epoch"])) is None:
            raise DamagedRecord(path, f"line {number}'s epoch {row['epoch'][:40]!r} is no whole number from 0 up")
        if "epoch" in values:
            out.append({**values, "epoch": epoch})
    return out


def metrics_rows(path: Path, warn: Warn) -> list[dict[str, Any]] | None:
    """The rows of the metrics.csv at `path`, or None where there is none or it is damaged (said through `warn`,
    naming the file; the rows of the run's wandb log are used instead)."""
    if not os.path.lexists(path):
        return None
    try:
        return read_metrics_csv(path)
    except (OSError, ValueError) as error:  # DamagedRecord is a ValueError
        warn(f"{path}: {damage(error)}; its epochs are taken from the run's wandb log instead")
        return None


def folders_by_run_id(output_root: Path, warn: Warn) -> dict[str, RunDir]:
    """The run folders under `output_root` by the run id their identity.json records (each damaged identity.json
    said through `warn`), to find the run of a log cut before its run record."""
    root = runs_root(output_root)
    if not root.is_dir():
        return {}
    found: dict[str, RunDir] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        run = RunDir(folder)
        try:
            identity = run.read_identity() or {}
        except (OSError, ValueError) as error:
            warn(f"{run.identity}: {damage(error)}; not searched for the run of a log without its run record")
            continue
        if isinstance(identity.get("run_id"), str):
            found.setdefault(identity["run_id"], run)
    return found
