"""Grouping runs into rows (a config key) and columns (stage), mean ± std over seeds, deltas and their intervals."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from deit_ablate.config.studies import studies, study_names

from . import fusion
from .cells import Cell, Row, Split, Table, cell_metric, metric_key
from .deltas import fill_deltas
from .paper import STAGES, PaperTable, default_table, paper_table
from .reader import RunInfo, metric_value
from .scratch import fill_scratch
from .select import CHOICE_ROWS, PLAIN_ROWS, ROW_ALIASES, format_value, get_key, row_keys
from .settings import (
    DEFAULT_CHOICES,
    choices_of,
    describe_difference,
    experiment_settings,
    pick_main,
    signature,
    varied_keys,
)
from .sharp import fill_sharpness


def default_baseline(rows_key: str) -> str | None:
    """The row Δ is measured against when no paper table says (e.g. with --paper none): the baseline of the paper
    table for these rows, else the recipe's default option of the group (`mix`: mixup_cutmix)."""
    table = default_table(rows_key)
    return paper_table(table).baseline if table else DEFAULT_CHOICES.get(rows_key)


def study_table(rows_key: str, metric: str = "top1") -> PaperTable | None:
    """A study's own paper table when the rows are a study's (`ablation`, `cait`): its rows' order, labels and
    columns hold even with --paper none."""
    study = next((s for s in studies() if s.name == rows_key), None)
    return paper_table(study.table, metric) if study else None


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
    if rows in study_names():
        return RowSpec(name=rows, keys=ROW_ALIASES.get(rows, (rows,)), group=rows)
    if rows not in PLAIN_ROWS and (rows in CHOICE_ROWS or rows in groups):
        return RowSpec(name=rows, keys=ROW_ALIASES.get(rows, (rows,)), group=rows)
    keys = row_keys(rows)
    return RowSpec(name=",".join(keys), keys=keys)


def _resolve_paper(paper: str | None, rows_key: str, metric: str) -> PaperTable | None:
    if paper in (None, "none"):
        return None
    name = default_table(rows_key) if paper == "auto" else paper
    return paper_table(name, metric) if name else None


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
    if ptable is None or rows_key in study_names() or not bases or any(r.key in bases for r in ptable.rows):
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

    def add(self, base: str, label: str, stage: str, runs: list[RunInfo], key: str, head: str | None) -> None:
        """Put one setting's runs into the cell of `label` at `stage` (the latest run of a repeated seed counts),
        each run's summary `key` (the figure of `head`, where one is named)."""
        labels = self.sub_rows.setdefault(base, [])
        if label not in labels:
            labels.append(label)
        cell = self.cells.setdefault(label, {s: Cell() for s in STAGES})[stage]
        cell.head = head
        for run in sorted(runs, key=_start, reverse=True):
            value = metric_value(run, key)
            counted = cell.add(run, value)
            (self.counted if counted else self.repeated).append((label, stage, run, value))
            if counted and value is not None and run.status == "finished":
                fusion.add_run(cell, run, key)


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


def _fill(buckets: Buckets, baseline: str | None, metric: str, order_by: PaperTable | None,
          match_baseline: bool) -> _Filled:
    """Split every bucket into settings and fill the cells; the baseline row first, so others can match it. A
    cell reads --metric's summary key, or the head the paper's number at that cell is (cells.cell_metric)."""
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
            prow = order_by.row(base) if order_by else None
            key, head = cell_metric(metric, prow.heads.get(stage) if prow else None)
            for label, part in parts:
                filled.add(base, label, stage, part, key, head)
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
    scratch: list[RunInfo] | None = None,
) -> Table:
    """Group runs (already filtered and de-duplicated) into a table with the paper's numbers beside.

    A cell holds only runs whose experiment settings are equal (they differ in the seed and in execution
    settings at most); runs under one row key that differ otherwise become sub-rows (`Table.splits`), or,
    with `match_baseline`, only the main setting of each row is kept. A table of transfers without a baseline
    row compares each with its from-scratch twin among `scratch` (scratch.py).
    """
    spec = row_spec(rows, {g for r in runs for g in choices_of(r.config)})
    rows_key = spec.name
    key = metric_key(metric)
    buckets, sizes, other_stage = _bucket(runs, spec)
    bases = {b for _, b in buckets}
    ptable, paper_note = _paper_fit(_resolve_paper(paper, rows_key, metric), rows_key, bases)
    study = study_table(rows_key, metric)
    order_by = ptable or study  # a study's order always
    order = [r.key for r in order_by.rows] if order_by else []
    order += sorted((k for k in bases if k not in order), key=_natural)
    per_row = baseline is None and ptable is not None and any(r.baseline for r in ptable.rows)
    if baseline is None:
        default = order_by.baseline if order_by else default_baseline(rows_key)
        baseline = default if default in order else None
    filled = _fill(buckets, baseline, metric, order_by, match_baseline)
    table_rows = _table_rows(order, filled, order_by, only_present)
    stages = _stages(filled, table_rows, (ptable, study), only_present)
    table = Table(
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
    if baseline is None and scratch is not None:
        fill_scratch(table, scratch)
    fill_deltas(table_rows, stages, baseline, ptable, per_row)
    fill_sharpness(table)
    return table


def _stages(filled: _Filled, rows: list[Row], tables: tuple[PaperTable | None, ...], only_present: bool) -> list[str]:
    """The columns: stages with runs or a paper column; with `only_present`, those with runs (at least one)."""
    stages = [s for s in STAGES if any(c[1] == s for c in filled.counted) or any(t and s in t.columns for t in tables)]
    if only_present:
        stages = [s for s in stages if any(_has_runs(r.cells[s]) for r in rows)] or stages[:1]
    return stages


def _has_runs(cell: Cell) -> bool:
    return bool(cell.n_runs or cell.same_seed)
