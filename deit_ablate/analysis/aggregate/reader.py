"""Runs from local wandb folders (offline or synced) and from the W&B API, as plain `RunInfo` values.

A run's per-epoch rows come from its run folder's `metrics.csv` when the folder is found beside the wandb folder
(`<output_root>/runs/<run name>/` for a log in `<output_root>/wandb/`): the trainer writes each row there atomically
as it is logged, so a killed launch keeps every row it logged, while wandb writes its log every second and loses
what a kill cut (docs/reliability.md, "What each stop keeps"); a log cut before its run record is read from its run
folder, found by the run id in the log's name. Logs without their run folder (copied elsewhere, the W&B API) give
their own history.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from deit_ablate.record.rundir import RunDir, runs_root

from .find import MAX_LOG_BYTES, Warn, find_run_files, stderr_warn  # noqa: F401 (the reader's names)
from .wandb_log import read_log

STATUSES = ("finished", "diverged", "failed", "unfinished")
API_PREFIX = "wandb://"
NO_RUN_RECORD = "no run record (the log ends before wandb.init was written)"


@dataclass
class RunInfo:
    """What the aggregator knows about one run (one log file or one API run)."""

    run_id: str
    name: str = ""
    project: str = ""
    entity: str = ""
    group: str = ""
    tags: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    start_time: datetime | None = None
    source: str = ""
    history_rows: int = 0
    last_history: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    problem: str | None = None  # why the log was read only in part
    commit: str = ""  # the code's git commit, where wandb recorded it (runs started without disable_git)
    history: list[dict[str, Any]] | None = None  # per-epoch rows (`epoch`, `val/...`), when read with history
    handle: Any = field(default=None, repr=False, compare=False)  # the W&B API run, for its history

    @property
    def status(self) -> str:
        """`finished`, `diverged` or `failed` as the trainer wrote it into the summary, else `unfinished`."""
        value = self.summary.get("status")
        return value if value in STATUSES[:3] else "unfinished"


def _item_path(item: Any) -> tuple[str, ...]:
    return tuple(item.nested_key) if item.nested_key else (item.key,)


def _set_path(target: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        nxt = target.get(key)
        if not isinstance(nxt, dict):
            nxt = target[key] = {}
        target = nxt
    target[path[-1]] = value


def _del_path(target: dict[str, Any], path: tuple[str, ...]) -> None:
    for key in path[:-1]:
        target = target.get(key)
        if not isinstance(target, dict):
            return
    target.pop(path[-1], None)


def _loads(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _history_value(item: Any) -> Any:
    if item.value_json:
        return _loads(item.value_json)
    kind = item.WhichOneof("value")
    if kind is None or kind == "none":
        return None
    if kind == "json":
        return _loads(item.json)
    return getattr(item, kind)


def _apply_items(target: dict[str, Any], update: Iterable[Any], remove: Iterable[Any]) -> None:
    for item in update:
        _set_path(target, _item_path(item), _loads(item.value_json))
    for item in remove:
        _del_path(target, _item_path(item))


def _timestamp(ts: Any) -> datetime | None:
    if not ts.seconds and not ts.nanos:
        return None
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=timezone.utc)


def _epoch_row(record: Any) -> dict[str, Any] | None:
    """A history record's `epoch` and `val*` values, if it is an epoch's evaluation row."""
    row: dict[str, Any] = {}
    for item in record.history.item:
        key = item.key or "/".join(item.nested_key)
        if key == "epoch" or key.startswith("val"):
            row[key] = _history_value(item)
    return row if "epoch" in row and len(row) > 1 else None


@dataclass
class _Scan:
    """What one pass over a run log's records gathers."""

    run: Any = None  # the RunRecord
    config: dict[str, Any] = field(default_factory=dict)
    summary_items: dict[str | tuple[str, ...], str | None] = field(default_factory=dict)  # key or path -> JSON
    last_history: bytes | None = None
    history_rows: int = 0
    exit_code: int | None = None
    epochs: list[dict[str, Any]] | None = None


def _scan(records: list[bytes], path: Path, history: bool, warnings: list[str]) -> _Scan:
    """One pass over the records: config, summary, the last history row (and the per-epoch ones with `history`)."""
    from wandb.proto.wandb_internal_pb2 import Record, RunRecord

    out = _Scan(epochs=[] if history else None)
    record = Record()
    summary_items = out.summary_items
    for payload in records:
        try:
            record.ParseFromString(payload)
        except Exception as exc:  # a damaged record inside an intact frame: keep what came before
            warnings.append(f"{path}: undecodable record skipped ({exc})")
            continue
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out.history_rows += 1
            out.last_history = payload
            if out.epochs is not None and b"val" in payload:  # cheap test first: most rows are training steps
                row = _epoch_row(record)
                if row is not None:
                    out.epochs.append(row)
        elif kind == "summary":  # the hot loop: most records are summary updates
            for item in record.summary.update:
                key = item.key
                summary_items[key or tuple(item.nested_key)] = item.value_json
            for item in record.summary.remove:
                summary_items[item.key or tuple(item.nested_key)] = None
        elif kind == "config":
            _apply_items(out.config, record.config.update, record.config.remove)
        elif kind == "run":
            out.run = RunRecord()
            out.run.CopyFrom(record.run)
            _apply_items(out.config, out.run.config.update, out.run.config.remove)
            for item in out.run.summary.update:
                summary_items.setdefault(item.key or tuple(item.nested_key), item.value_json)
        elif kind == "exit":
            out.exit_code = record.exit.exit_code
    return out


def _run_info(scan: _Scan, path: Path, log: Any) -> RunInfo:
    """The run a scan of its log found (`scan.run` set)."""
    from wandb.proto.wandb_internal_pb2 import Record

    summary: dict[str, Any] = {}
    for key, text in scan.summary_items.items():
        if text is not None:
            _set_path(summary, (key,) if isinstance(key, str) else key, _loads(text))
    last: dict[str, Any] = {}
    if scan.last_history is not None:
        record = Record()
        record.ParseFromString(scan.last_history)
        for item in record.history.item:
            _set_path(last, _item_path(item), _history_value(item))
    scan.config.pop("_wandb", None)
    run = scan.run
    return RunInfo(
        run_id=run.run_id or path.stem.removeprefix("run-"),
        name=run.display_name,
        project=run.project,
        entity=run.entity,
        group=run.run_group,
        tags=tuple(run.tags),
        config=scan.config,
        summary=summary,
        start_time=_timestamp(run.start_time),
        source=str(path),
        history_rows=scan.history_rows,
        last_history=last,
        exit_code=scan.exit_code,
        problem=log.problem,
        history=scan.epochs,
        commit=run.git.commit,
    )


def read_run_file(path: str | Path, history: bool = False) -> tuple[RunInfo | None, list[str]]:
    """Parse one `run-*.wandb` file with wandb's protobuf `Record`; return the run and any warnings.

    With `history`, the per-epoch evaluation rows are kept too (`RunInfo.history`, for curves).
    """
    path = Path(path)
    warnings: list[str] = []
    try:
        log = read_log(path)
    except OSError as exc:  # removed or unreadable between listing and reading
        return None, [f"{path}: cannot read ({exc.strerror or exc}); run skipped"]
    if log.problem:
        warnings.append(
            f"{path}: {log.problem}; read up to the last complete record "
            f"({len(log.records)} records, {log.stopped_at} of {log.size} bytes)"
        )
    scan = _scan(log.records, path, history, warnings)
    if scan.run is None:
        warnings.append(f"{path}: {NO_RUN_RECORD}; run skipped")
        return None, warnings
    return _run_info(scan, path, log), warnings


def _read_many(files: list[Path], jobs: int, history: bool = False) -> list[tuple[RunInfo | None, list[str]]]:
    read = partial(read_run_file, history=history)
    if jobs <= 1 or len(files) < 64:
        return [read(f) for f in files]
    chunk = max(8, len(files) // (jobs * 4))
    try:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(read, files, chunksize=chunk))
    except (OSError, BrokenProcessPool):  # no process pool here (sandbox, no /dev/shm): read in this process
        return [read(f) for f in files]


def read_histories(files: list[Path], jobs: int | None = None) -> list[list[dict[str, Any]] | None]:
    """The per-epoch rows of each log file (None where it cannot be read), in order."""
    jobs = min(4, os.cpu_count() or 1) if jobs is None else jobs
    return [info.history if info is not None else None for info, _ in _read_many(files, jobs, history=True)]


def csv_path(run: RunInfo) -> Path | None:
    """Where the run folder's metrics.csv sits for an offline log in `<output_root>/wandb/<folder>/`."""
    name = run.config.get("run_name")
    if is_api_source(run.source) or not name or not run.source:
        return None
    parents = Path(run.source).parents
    return RunDir.under(parents[2], str(name)).metrics if len(parents) > 2 else None


def _csv_number(text: str) -> Any:
    try:
        return float(text) if text != "" else None
    except ValueError:
        return text


def read_metrics_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.csv, numbers as floats (`epoch` as int)."""
    with path.open(newline="") as f:
        rows = [{k: _csv_number(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return [{**r, "epoch": int(r["epoch"])} for r in rows if isinstance(r.get("epoch"), float)]


def _history_from_run_folder(run: RunInfo) -> None:
    """Take the run's per-epoch rows from its run folder's metrics.csv, when it is there (the source of truth)."""
    path = csv_path(run)
    if path is None or not path.is_file():
        return
    try:
        run.history = read_metrics_csv(path)
    except (OSError, ValueError, csv.Error):  # unreadable: the log's own rows stay
        pass


def _run_from_its_folder(path: Path, history: bool) -> RunInfo | None:
    """The run of a log cut before its run record (a launch killed within a second of starting wandb), as its run
    folder records it (identity.json, result.json, metrics.csv), found under the log's output root by its run id."""
    run_id, parents = path.stem.removeprefix("run-"), path.parents
    root = runs_root(parents[2]) if len(parents) > 2 else None
    if root is None or not root.is_dir():
        return None
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        run = RunDir(folder)
        try:
            identity = run.read_identity() or {}
            if identity.get("run_id") != run_id:
                continue
            summary = run.read_summary()
        except (OSError, ValueError):  # unreadable or damaged: not this run's record
            continue
        info = RunInfo(run_id=run_id, name=str(identity.get("name", "")), config={"run_name": identity.get("name")},
                       summary=summary, source=str(path), problem=NO_RUN_RECORD)
        if history:
            info.history = read_metrics_csv(run.metrics) if run.metrics.is_file() else []
        return info
    return None


def read_offline(
    path: str | Path, jobs: int | None = None, warn: Warn = stderr_warn, history: bool = False
) -> list[RunInfo]:
    """Read every run log found under `path` (with `history`: the per-epoch rows too, from the run folder's
    metrics.csv where it is found); damaged logs are read in part and reported through `warn`."""
    files = find_run_files(path, warn)
    if jobs is None:
        jobs = min(4, os.cpu_count() or 1)
    runs: list[RunInfo] = []
    for file, (info, warnings) in zip(files, _read_many(files, jobs, history), strict=True):
        if info is None and any(NO_RUN_RECORD in message for message in warnings):
            info = _run_from_its_folder(file, history)
            if info is not None:
                warnings = [f"{file}: {NO_RUN_RECORD}; the run read from its run folder" if NO_RUN_RECORD in m
                            else m for m in warnings]
        for message in warnings:
            warn(message)
        if info is not None:
            if history:
                _history_from_run_folder(info)
            runs.append(info)
    return runs


def is_api_source(source: str) -> bool:
    """Whether a source names a W&B project (`wandb://ENTITY/PROJECT`) rather than a local path."""
    return source.startswith(API_PREFIX)


def metric_value(run: RunInfo, key: str) -> float | None:
    """A finite float summary value, or None when the run has no such (finite, numeric) value."""
    value: Any = run.summary.get(key)
    if value is None and "." in key:  # a nested summary value, e.g. `top1.cls`
        value = run.summary
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
