"""Runs from local wandb folders (offline or synced) and from the W&B API, as plain `RunInfo` values.

A run's per-epoch rows come from its run folder's `metrics.csv` when the folder is found beside the wandb folder
(`<output_root>/runs/<run name>/` for a log in `<output_root>/wandb/`): the trainer writes each row there atomically
as it is logged, so a killed launch keeps every row it logged, while wandb writes its log every second and loses
what a kill cut (docs/reliability.md, "What each stop keeps"); a log cut before its run record is read from its run
folder, found by the run id in the log's name. Logs without their run folder (copied elsewhere, the W&B API) give
their own history.
"""

from __future__ import annotations

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

from deit_ablate.record.rundir import RunDir

from .find import MAX_LOG_BYTES, Warn, find_run_files, stderr_warn  # noqa: F401 (the reader's names)
from .run_folder import damage, folders_by_run_id, metrics_rows, plain_name, whole_epoch
from .shape import shape_problem
from .values import DamagedLog, key_path, loads
from .wandb_log import MAX_RECORD_BYTES, LogRead, iter_log

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


MAX_KEPT_BYTES = 256 << 20  # config, summary and epoch values a log's run keeps: a DeiT run's are a few hundred kB
ENTRY_BYTES = 1024  # what each key or row kept counts at least (Python's objects around a short value)


def _item_path(item: Any) -> tuple[str, ...]:
    return key_path(tuple(item.nested_key)) if item.nested_key else (item.key,)


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


_loads = loads


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
    try:
        return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=timezone.utc)
    except (OverflowError, ValueError, OSError):  # a time no clock gives (year 10000 and beyond): damaged
        raise DamagedLog(f"its start time ({ts.seconds} s after 1970) is no date") from None


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
    records: int = 0
    kept: int = 0  # bytes of the config and epoch values kept (bounded: MAX_KEPT_BYTES)
    largest_summary: int = ENTRY_BYTES  # bytes of the largest summary record (no summary value kept is longer)

    def keep(self, size: int) -> None:
        """Count `size` more bytes kept; a DamagedLog past MAX_KEPT_BYTES."""
        self.kept += size
        if self.kept > MAX_KEPT_BYTES:
            raise DamagedLog(f"its config, summary and epoch rows would take more than {MAX_KEPT_BYTES >> 20} MB")


def _keep_epoch(out: _Scan, row: dict[str, Any] | None, size: int, where: str, warnings: list[str]) -> None:
    """Keep an epoch's evaluation row (of `size` bytes); one whose epoch is no whole number is said and skipped."""
    if row is None:
        return
    if whole_epoch(row["epoch"]) is None:
        warnings.append(f"{where}: its epoch {str(row['epoch'])[:40]!r} is no whole number; the row skipped")
        return
    out.epochs.append({**row, "epoch": whole_epoch(row["epoch"])})
    out.keep(max(size, ENTRY_BYTES))


def _scan(records: Iterable[bytes], path: Path, history: bool, warnings: list[str]) -> _Scan:
    """One pass over the records: config, summary, the last history row (and the per-epoch ones with `history`)."""
    from wandb.proto.wandb_internal_pb2 import Record, RunRecord

    out = _Scan(epochs=[] if history else None)
    record = Record()
    summary_items = out.summary_items
    for payload in records:
        out.records += 1
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
                _keep_epoch(out, _epoch_row(record), len(payload), f"{path}: history record {out.records}", warnings)
        elif kind == "summary":  # the hot loop: most records are summary updates
            for item in record.summary.update:
                summary_items[item.key or tuple(item.nested_key)] = item.value_json
            for item in record.summary.remove:
                summary_items[item.key or tuple(item.nested_key)] = None
            if len(payload) > out.largest_summary:
                out.largest_summary = len(payload)
            if len(summary_items) * out.largest_summary > MAX_KEPT_BYTES:  # a bound on what the summary keeps
                out.keep(MAX_KEPT_BYTES + 1)
        elif kind == "config":
            out.keep(len(payload) + ENTRY_BYTES * len(record.config.update))
            _apply_items(out.config, record.config.update, record.config.remove)
        elif kind == "run":
            out.keep(len(payload) + ENTRY_BYTES * len(record.run.config.update))
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
            _set_path(summary, (key,) if isinstance(key, str) else key_path(key), _loads(text))
    last: dict[str, Any] = {}
    if scan.last_history is not None:
        record = Record()
        record.ParseFromString(scan.last_history)
        for item in record.history.item:
            _set_path(last, _item_path(item), _history_value(item))
    scan.config.pop("_wandb", None)
    problem = shape_problem(scan.config)
    if problem:
        raise DamagedLog(problem)
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
    """Parse one `run-*.wandb` file with wandb's protobuf `Record`; return the run and any warnings (a log that is
    not a run's: None, and the one line saying why).

    With `history`, the per-epoch evaluation rows are kept too (`RunInfo.history`, for curves).
    """
    path = Path(path)
    warnings: list[str] = []
    log = LogRead([])
    try:
        scan = _scan(iter_log(path, log), path, history, warnings)
        info = _run_info(scan, path, log) if scan.run is not None else None
    except OSError as exc:  # removed or unreadable between listing and reading
        return None, [f"{path}: cannot read ({exc.strerror or exc}); run skipped"]
    except ValueError as exc:  # no log file, or a DamagedLog: what its records hold is no run's
        return None, [*warnings, f"{path}: {exc}; run skipped"]
    if log.problem:
        warnings.insert(0, f"{path}: {log.problem}; read up to the last complete record "
                           f"({scan.records} records, {log.stopped_at} of {log.size} bytes)")
    if log.skipped:
        warnings.insert(0, f"{path}: {len(log.skipped)} record(s) larger than {MAX_RECORD_BYTES >> 20} MB skipped "
                           f"(the first at byte {log.skipped[0]})")
    if info is None:
        warnings.append(f"{path}: {NO_RUN_RECORD}; run skipped")
    return info, warnings


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
    name = plain_name(run.config.get("run_name"))
    if is_api_source(run.source) or not name or not run.source:
        return None
    parents = Path(run.source).parents
    return RunDir.under(parents[2], name).metrics if len(parents) > 2 else None


def _history_from_run_folder(run: RunInfo, warn: Warn) -> None:
    """Take the run's per-epoch rows from its run folder's metrics.csv, when it is there (the source of truth); a
    damaged one is said through `warn` and the log's own rows stay."""
    path = csv_path(run)
    rows = metrics_rows(path, warn) if path is not None else None
    if rows is not None:
        run.history = rows


def _run_from_its_folder(path: Path, history: bool, folders: dict[str, RunDir], warn: Warn) -> RunInfo | None:
    """The run of a log cut before its run record (a launch killed within a second of starting wandb), as its run
    folder records it (result.json; metrics.csv with `history`), found in `folders` by the run id in the log's name;
    a damaged result.json is said through `warn`."""
    run_id = path.stem.removeprefix("run-")
    run = folders.get(run_id)
    if run is None:
        return None
    try:
        summary = run.read_summary()
    except (OSError, ValueError) as error:
        warn(f"{run.result}: {damage(error)}; the run of {path} skipped")
        return None
    return RunInfo(run_id=run_id, name=run.name, config={"run_name": run.name}, summary=summary, source=str(path),
                   problem=NO_RUN_RECORD, history=[] if history else None)


def read_offline(
    path: str | Path, jobs: int | None = None, warn: Warn = stderr_warn, history: bool = False
) -> list[RunInfo]:
    """Read every run log found under `path` (with `history`: the per-epoch rows too, from the run folder's
    metrics.csv where it is found); damaged logs are read in part and reported through `warn`."""
    files = find_run_files(path, warn)
    if jobs is None:
        jobs = min(4, os.cpu_count() or 1)
    runs: list[RunInfo] = []
    folders: dict[Path, dict[str, RunDir]] = {}  # by output root, read when a log needs it
    for file, (info, warnings) in zip(files, _read_many(files, jobs, history), strict=True):
        if info is None and any(NO_RUN_RECORD in message for message in warnings) and len(file.parents) > 2:
            root = file.parents[2]
            if root not in folders:
                folders[root] = folders_by_run_id(root, warn)
            info = _run_from_its_folder(file, history, folders[root], warn)
            if info is not None:
                warnings = [f"{file}: {NO_RUN_RECORD}; the run read from its run folder" if NO_RUN_RECORD in m
                            else m for m in warnings]
        for message in warnings:
            warn(message)
        if info is not None:
            if history:
                _history_from_run_folder(info, warn)
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
    try:
        value = float(value)
    except OverflowError:  # an integer too long for a float (a result.json's 10**400)
        return None
    return value if math.isfinite(value) else None
