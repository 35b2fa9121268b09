"""Grouping runs into rows (a config key) and columns (stage), mean ± std over seeds, deltas and their intervals."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from .paper import STAGES, PaperTable, default_table, paper_table
from .reader import RunInfo, metric_value
from .select import CHOICE_ROWS, PLAIN_ROWS, ROW_ALIASES, format_value, get_key, row_keys
from .settings import choices_of, describe_difference, experiment_settings, pick_main, signature, varied_keys
from .stats import NO_SPREAD, ZERO_SPREAD, Interval, pooled_std, seeds_needed, welch

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
DEFAULT_BASELINES = {
    "ablation": "baseline",
    "distill.type": "none",
    "resolution.train_size": "224",
    "mix": "mixup_cutmix",
    "augment": "randaugment",
    "optimizer": "adamw",
}


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
    same_seed: list[str] = field(default_factory=list)  # run ids of finished runs repeating a counted seed
    delta: float | None = None
    paper: float | None = None
    paper_std: float | None = None
    paper_delta: float | None = None
    paper_absent: str = ""  # what the paper column says where the paper's row has no number
    ci: Interval | None = None  # Welch's 95% interval of Δ over seeds (none: `ci.why`)
    ci_note: str = ""  # why there is no comparison at all (`no baseline`)
    pooled_std: float | None = None  # of the row and its baseline, for the seeds the paper's Δ needs
    seeds_needed: int | None = None  # per arm, to resolve the paper's Δ at the pooled std (80 % power, 5 %)
    seeds_note: str = ""  # why there is no seed count

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

    def add(self, run: RunInfo, value: float | None) -> bool:
        """Count one run; a finished run whose seed is already counted is only noted (False)."""
        status = run.status
        seed = run.config.get("seed")
        if status == "finished" and value is not None:
            if seed is not None and seed in self.seeds:
                self.same_seed.append(run.run_id)
                return False
            self.values.append(value)
            self.seeds.append(run.config.get("seed"))
            self.run_ids.append(run.run_id)
        elif status == "finished":
            self.n_no_metric += 1
        else:
            setattr(self, f"n_{status}", getattr(self, f"n_{status}") + 1)
        return True


@dataclass
class Row:
    """One row: a config value (with `· setting` on a sub-row), the paper's label and note, a cell per stage."""

    key: str
    cells: dict[str, Cell]
    label: str = ""
    note: str = ""
    in_paper: bool = False
    base: str = ""  # the row key's value; == key except on sub-rows
    delta_to: str = ""  # the row its Δ is measured against, where the paper table gives each row its own

    @property
    def has_runs(self) -> bool:
        """Whether any run landed in this row."""
        return any(c.n_runs or c.same_seed for c in self.cells.values())


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
    repeated: list[tuple[str, str, RunInfo, float | None]] = field(default_factory=list)  # same seed, not averaged
    other_stage: int = 0
    splits: list[Split] = field(default_factory=list)
    left_out: list[RunInfo] = field(default_factory=list)  # runs not matching the baseline (match_baseline)
    paper_note: str = ""  # why a paper table was left out
    per_row_baselines: bool = False  # Δ to each row's own baseline (Row.delta_to), as the paper table defines them
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


@dataclass(frozen=True)
class RowSpec:
    """What --rows groups by: a config group's chosen option (falling back to keys), or plain config keys."""

    name: str  # the rows column's header
    keys: tuple[str, ...]
    group: str | None = None

    def label(self, config: dict[str, Any]) -> str:
        """The row a run belongs to."""
        if self.group is not None:
            choice = choices_of(config).get(self.group)
            if choice is not None:
                return choice
        return row_label(config, self.keys)


def row_spec(rows: str, groups: set[str] | None = None) -> RowSpec:
    """--rows as a RowSpec: a config group (`mix`: its option names), else an alias or dotted key(s)."""
    groups = groups or set()
    if rows not in PLAIN_ROWS and (rows in CHOICE_ROWS or rows in groups):
        return RowSpec(name=rows, keys=ROW_ALIASES.get(rows, (rows,)), group=rows)
    keys = row_keys(rows)
    return RowSpec(name=",".join(keys), keys=keys)


def _resolve_paper(paper: str | None, rows_key: str, metric: str) -> PaperTable | None:
    if paper in (None, "none"):
        return None
    name = default_table(rows_key) if paper == "auto" else paper
    return paper_table(name, metric) if name else None


@dataclass
class Split:
    """Runs under one row key at one stage that differ in more than the seed: split into sub-rows."""

    row: str
    stage: str
    varied: list[str]
    rows: list[str]  # labels, the main setting's first
    runs: list[int]  # runs per label
    left_out: bool = False  # with match_baseline: only the main setting was kept


def _by_settings(runs: list[RunInfo]) -> list[tuple[dict[str, Any], dict[str, str], list[RunInfo]]]:
    """Runs grouped by equal experiment settings: (settings, group choices, runs), in first-seen order."""
    groups: dict[Any, tuple[dict[str, Any], dict[str, str], list[RunInfo]]] = {}
    for run in runs:
        settings = experiment_settings(run.config)
        entry = groups.setdefault(signature(settings), (settings, choices_of(run.config), []))
        entry[2].append(run)
        if not entry[1] and choices_of(run.config):
            entry[1].update(choices_of(run.config))
    return list(groups.values())


def _labels(base: str, groups: list, main: int) -> list[str]:
    """`base` for the main setting, `base · what differs` for the others (more detail where two would clash)."""
    ref, ref_choices, _ = groups[main]
    labels = []
    for full in (False, True):
        labels = [
            base if i == main else f"{base} · {describe_difference(s, c, ref, ref_choices, full)}"
            for i, (s, c, _) in enumerate(groups)
        ]
        if len(set(labels)) == len(labels):
            return labels
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def _split(
    base: str,
    stage: str,
    runs: list[RunInfo],
    population: list[dict[str, Any]],
    baseline: dict[str, Any] | None,
    match_baseline: bool,
) -> tuple[list[tuple[str, list[RunInfo]]], dict[str, Any], Split | None]:
    """Sub-rows of one row key at one stage, the main setting, and how they were split (None: no split)."""
    groups = _by_settings(runs)
    if len(groups) == 1:
        return [(base, runs)], groups[0][0], None
    main = pick_main([(g[0], g[1]) for g in groups], population, baseline)
    labels = _labels(base, groups, main)
    order = [main] + sorted((i for i in range(len(groups)) if i != main), key=lambda i: _natural(labels[i]))
    split = Split(
        row=base,
        stage=stage,
        varied=varied_keys(g[0] for g in groups),
        rows=[labels[i] for i in order],
        runs=[len(groups[i][2]) for i in order],
        left_out=match_baseline,
    )
    kept = order[:1] if match_baseline else order
    return [(labels[i], groups[i][2]) for i in kept], groups[main][0], split


def _paper_fit(ptable: PaperTable | None, rows_key: str, bases: set[str]) -> tuple[PaperTable | None, str]:
    """The paper table, or None and why it was left out (none of its rows is a row of ours)."""
    if ptable is None or rows_key == "ablation" or not bases or any(r.key in bases for r in ptable.rows):
        return ptable, ""
    theirs = ", ".join(r.key for r in ptable.rows)
    ours = ", ".join(sorted(bases, key=_natural))
    why = (
        f"paper {ptable.name} left out: its rows ({ptable.rows_key}: {theirs}) match none of these runs' "
        f"{rows_key} values ({ours})"
    )
    return None, why


def _start(run: RunInfo) -> float:
    return run.start_time.timestamp() if run.start_time else float("-inf")


@dataclass
class _Filled:
    """Cells filled from the buckets, with what happened to each run."""

    cells: dict[str, dict[str, Cell]] = field(default_factory=dict)  # label -> stage -> cell
    sub_rows: dict[str, list[str]] = field(default_factory=dict)  # row key -> labels
    counted: list[tuple[str, str, RunInfo, float | None]] = field(default_factory=list)
    repeated: list[tuple[str, str, RunInfo, float | None]] = field(default_factory=list)
    splits: list[Split] = field(default_factory=list)
    left_out: list[RunInfo] = field(default_factory=list)

    def add(self, base: str, label: str, stage: str, runs: list[RunInfo], key: str) -> None:
        """Put one setting's runs into the cell of `label` at `stage` (the latest run of a repeated seed counts)."""
        labels = self.sub_rows.setdefault(base, [])
        if label not in labels:
            labels.append(label)
        cell = self.cells.setdefault(label, {s: Cell() for s in STAGES})[stage]
        for run in sorted(runs, key=_start, reverse=True):
            value = metric_value(run, key)
            (self.counted if cell.add(run, value) else self.repeated).append((label, stage, run, value))


Buckets = dict[tuple[str, str], list[RunInfo]]  # (stage, row key) -> runs


def _bucket(runs: list[RunInfo], spec: RowSpec) -> tuple[Buckets, dict[str, set[int]], int]:
    """Runs by (stage, row key), the train sizes per stage, and how many runs had another stage."""
    buckets: Buckets = {}
    sizes: dict[str, set[int]] = {s: set() for s in STAGES}
    other_stage = 0
    for run in runs:
        stage = run.config.get("stage", "pretrain")
        if stage not in STAGES:
            other_stage += 1
            continue
        buckets.setdefault((stage, spec.label(run.config)), []).append(run)
        size = get_key(run.config, "resolution.train_size")
        if isinstance(size, int):
            sizes[stage].add(size)
    return buckets, sizes, other_stage


def _fill(buckets: Buckets, baseline: str | None, key: str, match_baseline: bool) -> _Filled:
    """Split every bucket into settings and fill the cells; the baseline row first, so others can match it."""
    filled = _Filled()
    for stage in STAGES:
        bases = sorted((b for s, b in buckets if s == stage), key=lambda b: (b != baseline, b))
        population = [experiment_settings(r.config) for b in bases for r in buckets[(stage, b)]]
        base_settings: dict[str, Any] | None = None
        for base in bases:
            bucket = buckets[(stage, base)]
            parts, main_settings, split = _split(base, stage, bucket, population, base_settings, match_baseline)
            if base == baseline:
                base_settings = main_settings
            if split is not None:
                filled.splits.append(split)
                kept = {id(r) for _, part in parts for r in part}
                filled.left_out += [r for r in bucket if id(r) not in kept]
            for label, part in parts:
                filled.add(base, label, stage, part, key)
    return filled


def _table_rows(order: list[str], filled: _Filled, order_by: PaperTable | None, only_present: bool) -> list[Row]:
    """Rows in order, each row key's main row first, then its sub-rows; rows without runs unless hidden."""
    out = []
    for name in order:
        labels = [name] + sorted((x for x in filled.sub_rows.get(name, []) if x != name), key=_natural)
        for label in labels:
            if label not in filled.cells and (only_present or label != name):
                continue
            prow = order_by.row(label) if order_by else None  # labels and flags even with --paper none
            out.append(
                Row(
                    key=label,
                    cells=filled.cells.get(label) or {s: Cell() for s in STAGES},
                    label=prow.label if prow else "",
                    note=prow.note if prow else "",
                    in_paper=prow is not None,
                    base=name,
                )
            )
    return out


def build_table(
    runs: list[RunInfo],
    rows: str = "ablation",
    metric: str = "top1",
    baseline: str | None = None,
    paper: str | None = "auto",
    match_baseline: bool = False,
    only_present: bool = False,
) -> Table:
    """Group runs (already filtered and de-duplicated) into a table with the paper's numbers beside.

    A cell holds only runs whose experiment settings are equal (they differ in the seed and in execution
    settings at most); runs under one row key that differ otherwise become sub-rows (`Table.splits`), or,
    with `match_baseline`, only the main setting of each row is kept.
    """
    spec = row_spec(rows, {g for r in runs for g in choices_of(r.config)})
    rows_key = spec.name
    key = metric_key(metric)
    buckets, sizes, other_stage = _bucket(runs, spec)
    bases = {b for _, b in buckets}
    ptable, paper_note = _paper_fit(_resolve_paper(paper, rows_key, metric), rows_key, bases)
    order_by = ptable or (paper_table("table8") if rows_key == "ablation" else None)  # Table 8 order always
    order = [r.key for r in order_by.rows] if order_by else []
    order += sorted((k for k in bases if k not in order), key=_natural)
    per_row = baseline is None and ptable is not None and any(r.baseline for r in ptable.rows)
    if baseline is None:
        default = order_by.baseline if order_by else DEFAULT_BASELINES.get(rows_key)
        baseline = default if default in order else None
    filled = _fill(buckets, baseline, key, match_baseline)
    table_rows = _table_rows(order, filled, order_by, only_present)
    stages = [
        s
        for s in STAGES
        if rows_key == "ablation" or any(c[1] == s for c in filled.counted) or (ptable and s in ptable.columns)
    ]
    if only_present:
        stages = [s for s in stages if any(_has_runs(r.cells[s]) for r in table_rows)] or stages[:1]
    _fill_deltas(table_rows, stages, baseline, ptable, per_row)
    return Table(
        rows_key=rows_key,
        metric=metric,
        metric_key=key,
        stages=stages,
        rows=table_rows,
        baseline=baseline,
        paper=ptable,
        stage_sizes={s: sorted(v) for s, v in sizes.items()},
        counted=filled.counted,
        repeated=filled.repeated,
        other_stage=other_stage,
        splits=filled.splits,
        left_out=filled.left_out,
        paper_note=paper_note,
        per_row_baselines=per_row,
    )


def _has_runs(cell: Cell) -> bool:
    return bool(cell.n_runs or cell.same_seed)


def _diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return a - b


def _fill_deltas(
    rows: list[Row], stages: list[str], baseline: str | None, ptable: PaperTable | None, per_row: bool = False
) -> None:
    """Δ of every cell to the baseline row's (with `per_row`: to the row the paper table names for each row)."""
    by_key = {r.key: r for r in rows}
    for row in rows:
        prow = ptable.row(row.key) if ptable else None
        own = ptable.row(row.base or row.key) if per_row and ptable else None
        ref = own.baseline if own is not None and own.baseline else baseline
        base = by_key.get(ref) if ref else None
        pbase = ptable.row(ref) if ptable and ref else None
        if per_row:
            row.delta_to = ref or ""
        for stage in stages:
            cell = row.cells[stage]
            if base is not None:
                cell.delta = _diff(cell.mean, base.cells[stage].mean)
            if prow is not None:
                cell.paper = prow.values.get(stage)
                cell.paper_std = prow.stds.get(stage)
                cell.paper_absent = ptable.absent if cell.paper is None else ""
                if pbase is not None:
                    delta = _diff(cell.paper, pbase.values.get(stage))
                    cell.paper_delta = None if delta is None else round(delta, 6)
            if ref and base is not row:
                _compare(cell, base.cells[stage] if base is not None else None)


def _compare(cell: Cell, base: Cell | None) -> None:
    """Welch's interval of a cell's Δ to its baseline's cell, and the seeds per arm the paper's Δ would need."""
    if not cell.values:
        return
    if base is None or not base.values:
        cell.ci_note = "no baseline"
        return
    cell.ci = welch(cell.values, base.values)
    cell.pooled_std = pooled_std(cell.values, base.values)
    cell.seeds_needed, cell.seeds_note = _seeds(cell.pooled_std, cell.paper_delta)


def _seeds(std: float | None, paper_delta: float | None) -> tuple[int | None, str]:
    """Seeds per arm (at least 2) for the paper's Δ at the pooled std, or why there is no count."""
    if paper_delta is None:
        return None, ""
    if std is None:
        return None, NO_SPREAD
    if std == 0:
        return None, ZERO_SPREAD
    n = seeds_needed(std, paper_delta)
    if n is None:
        return None, "paper Δ 0"
    return max(2, math.ceil(n - 1e-9)), ""
