"""The aggregated table's parts: a cell (one row at one stage, mean ± std over seeds), a row, a split of a row
into sub-rows, the whole table; and the summary key each --metric reads."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from .paper import HEADS, PaperTable
from .reader import RunInfo
from .stats import Interval

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


def metric_key(metric: str) -> str:
    """The summary key behind a --metric choice."""
    return METRICS.get(metric, metric)


def cell_metric(metric: str, paper_head: str | None) -> tuple[str, str | None]:
    """The summary key a cell reads and the head its figure is: the paper number's head under the default
    --metric (a ⚗ run's Table 2 cell reads its distillation head), the --metric's own head, else none named."""
    if metric == "top1" and paper_head:
        return METRICS[paper_head], paper_head
    return metric_key(metric), metric if metric in HEADS else None


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
    head: str | None = None  # the ⚗ head our figure is (paper.HEADS), where the paper's or --metric names one
    paper_head: str | None = None  # the head the paper's number is, where its numbers file names one
    fusion: str | None = None  # the rule of a ⚗ cell's fused figure (fusion.py: prob, logit)
    other_fusion: list[float] = field(default_factory=list)  # the counted runs' top-1 under the other rule
    sharpness: dict[str, list[float]] = field(default_factory=dict)  # figure -> the counted runs' values (sharp.py)
    paper_sharpness: dict[str, float] = field(default_factory=dict)  # figure -> the paper's value
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
    reference: Cell | None = None  # what its Δ is measured against where that is no row (a transfer's from scratch)

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
    sharpness_stages: list[str] = field(default_factory=list)  # stages with sharpness columns (sharp.py)
    reference: str = ""  # what each row's Δ is measured against where that is no row (scratch.SCRATCH)
    reference_runs: list[RunInfo] = field(default_factory=list)  # the runs behind the rows' reference cells

    @property
    def compared(self) -> bool:
        """Whether the rows have a Δ: to a baseline row, or to each row's reference."""
        return self.baseline is not None or bool(self.reference)

    @property
    def one_seed(self) -> bool:
        """Whether every cell with a number has exactly one seed (no spread anywhere: said once, not per cell)."""
        cells = [c for r in self.rows for c in (*r.cells.values(), r.reference) if c is not None and c.values]
        return bool(cells) and all(c.n == 1 for c in cells)

    @property
    def without_runs(self) -> list[Row]:
        """The rows no run landed in (the paper's rows nobody ran)."""
        return [r for r in self.rows if not r.has_runs]

    def row(self, key: str) -> Row | None:
        """The row for a config value."""
        return next((r for r in self.rows if r.key == key), None)


@dataclass
class Split:
    """Runs under one row key at one stage that differ in more than the seed: split into sub-rows."""

    row: str
    stage: str
    varied: list[str]
    rows: list[str]  # labels, the main setting's first
    runs: list[int]  # runs per label
    left_out: bool = False  # with match_baseline: only the main setting was kept
