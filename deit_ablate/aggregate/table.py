"""Grouping runs into rows (a config key) and columns (stage), mean ± std over seeds, and deltas."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from .paper import STAGES, PaperTable, default_table, paper_table
from .reader import RunInfo, metric_value
from .select import format_value, get_key, row_keys

# --metric choices and the summary key each reads (any other value is taken as a summary key itself).
METRICS = {
    "top1": "top1",
    "final": "top1_final",
    "best": "top1_best",
    "ema": "top1_ema_final",
    "ema_best": "top1_ema_best",
    "fused": "top1_fused",
    "fused_alt": "top1_fused_alt",
    "cls": "top1_cls",
    "dist": "top1_dist",
}


# Δ is measured against this row when the paper table does not say (e.g. with --paper none).
DEFAULT_BASELINES = {"ablation": "baseline", "distill.type": "none", "resolution.train_size": "224"}


def metric_key(metric: str) -> str:
    """The summary key behind a --metric choice."""
    return METRICS.get(metric, metric)


@dataclass
class Cell:
    """The runs of one row at one stage: finished values, and counts of the runs that gave none."""

    values: list[float] = field(default_factory=list)
    seeds: list[Any] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)
    n_diverged: int = 0
    n_failed: int = 0
    n_unfinished: int = 0
    n_no_metric: int = 0  # finished, but without the chosen summary key
    delta: float | None = None
    paper: float | None = None
    paper_std: float | None = None
    paper_delta: float | None = None

    @property
    def n(self) -> int:
        """Number of finished runs with a value (the seeds averaged)."""
        return len(self.values)

    @property
    def mean(self) -> float | None:
        """Mean over seeds, or None without values."""
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        """Sample standard deviation over seeds (n - 1), or None for fewer than two."""
        return statistics.stdev(self.values) if len(self.values) >= 2 else None

    @property
    def n_runs(self) -> int:
        """All runs that landed in this cell."""
        return self.n + self.n_diverged + self.n_failed + self.n_unfinished + self.n_no_metric

    @property
    def state(self) -> str:
        """`ok` when there is a number, else why not: diverged, unfinished, failed, n/a or missing."""
        if self.values:
            return "ok"
        if self.n_diverged and self.n_diverged == self.n_runs:
            return "diverged"
        if self.n_unfinished:
            return "unfinished"
        if self.n_failed:
            return "failed"
        if self.n_diverged:
            return "diverged"
        if self.n_no_metric:
            return "n/a"
        return "missing"

    def add(self, run: RunInfo, value: float | None) -> None:
        """Count one run."""
        status = run.status
        if status == "finished" and value is not None:
            self.values.append(value)
            self.seeds.append(run.config.get("seed"))
            self.run_ids.append(run.run_id)
        elif status == "finished":
            self.n_no_metric += 1
        else:
            setattr(self, f"n_{status}", getattr(self, f"n_{status}") + 1)


@dataclass
class Row:
    """One row: a config value, the paper's label and note for it, and a cell per stage."""

    key: str
    cells: dict[str, Cell]
    label: str = ""
    note: str = ""
    in_paper: bool = False


@dataclass
class Table:
    """A whole aggregated table and how it was made."""

    rows_key: str
    metric: str
    metric_key: str
    stages: list[str]
    rows: list[Row]
    baseline: str | None
    paper: PaperTable | None
    stage_sizes: dict[str, list[int]]
    counted: list[tuple[str, str, RunInfo, float | None]] = field(default_factory=list)
    other_stage: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # run counts and warnings, filled in by the caller

    def row(self, key: str) -> Row | None:
        """The row for a config value."""
        return next((r for r in self.rows if r.key == key), None)


def _natural(key: str) -> tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key))


def row_label(config: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The row a run belongs to: its value of the key, or `leaf=value` pairs for several keys."""
    if len(keys) == 1:
        return format_value(get_key(config, keys[0]))
    return ",".join(f"{k.split('.')[-1]}={format_value(get_key(config, k))}" for k in keys)


def _resolve_paper(paper: str | None, rows_key: str, metric: str) -> PaperTable | None:
    if paper in (None, "none"):
        return None
    name = default_table(rows_key) if paper == "auto" else paper
    return paper_table(name, metric) if name else None


def build_table(
    runs: list[RunInfo],
    rows: str = "ablation",
    metric: str = "top1",
    baseline: str | None = None,
    paper: str | None = "auto",
) -> Table:
    """Group runs (already filtered and de-duplicated) into a table with the paper's numbers beside."""
    keys = row_keys(rows)
    rows_key = ",".join(keys)
    key = metric_key(metric)
    ptable = _resolve_paper(paper, rows_key, metric)
    cells: dict[str, dict[str, Cell]] = {}
    sizes: dict[str, set[int]] = {s: set() for s in STAGES}
    counted: list[tuple[str, str, RunInfo, float | None]] = []
    other_stage = 0
    for run in runs:
        stage = run.config.get("stage", "pretrain")
        if stage not in STAGES:
            other_stage += 1
            continue
        label = row_label(run.config, keys)
        value = metric_value(run, key)
        cells.setdefault(label, {s: Cell() for s in STAGES})[stage].add(run, value)
        counted.append((label, stage, run, value))
        size = get_key(run.config, "resolution.train_size")
        if isinstance(size, int):
            sizes[stage].add(size)

    if ptable and rows_key != "ablation" and cells and not any(r.key in cells for r in ptable.rows):
        ptable = None  # e.g. a demo-scale resolution sweep: the paper's sizes are not these runs' sizes
    order_by = ptable or (paper_table("table8") if rows_key == "ablation" else None)  # Table 8 order always
    order = [r.key for r in order_by.rows] if order_by else []
    order += sorted((k for k in cells if k not in order), key=_natural)
    if baseline is None:
        default = order_by.baseline if order_by else DEFAULT_BASELINES.get(rows_key)
        baseline = default if default in order else None

    table_rows = []
    for name in order:
        prow = order_by.row(name) if order_by else None  # labels and flags even with --paper none
        row = Row(
            key=name,
            cells=cells.get(name) or {s: Cell() for s in STAGES},
            label=prow.label if prow else "",
            note=prow.note if prow else "",
            in_paper=prow is not None,
        )
        table_rows.append(row)

    stages = [
        s
        for s in STAGES
        if rows_key == "ablation" or any(c[1] == s for c in counted) or (ptable and s in ptable.columns)
    ]
    _fill_deltas(table_rows, stages, baseline, ptable)
    return Table(
        rows_key=rows_key,
        metric=metric,
        metric_key=key,
        stages=stages,
        rows=table_rows,
        baseline=baseline,
        paper=ptable,
        stage_sizes={s: sorted(v) for s, v in sizes.items()},
        counted=counted,
        other_stage=other_stage,
    )


def _diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return a - b


def _fill_deltas(rows: list[Row], stages: list[str], baseline: str | None, ptable: PaperTable | None) -> None:
    base = next((r for r in rows if r.key == baseline), None)
    pbase = ptable.row(baseline) if ptable and baseline else None
    for row in rows:
        prow = ptable.row(row.key) if ptable else None
        for stage in stages:
            cell = row.cells[stage]
            if base is not None:
                cell.delta = _diff(cell.mean, base.cells[stage].mean)
            if prow is not None:
                cell.paper = prow.values.get(stage)
                cell.paper_std = prow.stds.get(stage)
                if pbase is not None:
                    delta = _diff(cell.paper, pbase.values.get(stage))
                    cell.paper_delta = None if delta is None else round(delta, 6)
