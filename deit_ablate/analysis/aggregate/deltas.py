"""Δ of every cell to its baseline row's, the paper's Δ beside it, Welch's interval over seeds and the seeds the
paper's Δ would need."""

from __future__ import annotations

import math

from .cells import Cell, Row
from .paper import PaperTable
from .stats import NO_SPREAD, ZERO_SPREAD, pooled_std, seeds_needed, welch


def _diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return a - b


def fill_deltas(
    rows: list[Row], stages: list[str], baseline: str | None, ptable: PaperTable | None, per_row: bool = False
) -> None:
    """Δ of every cell to the baseline row's (with `per_row`: to the row the paper table names for each row; to the
    row's reference where it has one: a transfer's from-scratch twin)."""
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
            if row.reference is not None:
                cell.delta = _diff(cell.mean, row.reference.mean)
                _compare(cell, row.reference, "no run from scratch")
            elif base is not None:
                cell.delta = _diff(cell.mean, base.cells[stage].mean)
            if prow is not None:
                cell.paper = prow.values.get(stage)
                cell.paper_std = prow.stds.get(stage)
                cell.paper_absent = ptable.absent if cell.paper is None else ""
                cell.paper_head = prow.heads.get(stage)
                if pbase is not None:
                    delta = _diff(cell.paper, pbase.values.get(stage))
                    cell.paper_delta = None if delta is None else round(delta, 6)
            if ref and base is not row:
                _compare(cell, base.cells[stage] if base is not None else None)


def _compare(cell: Cell, base: Cell | None, absent: str = "no baseline") -> None:
    """Welch's interval of a cell's Δ to its baseline's cell, and the seeds per arm the paper's Δ would need;
    `absent`: what the interval says where the baseline has no number."""
    if not cell.values:
        return
    if base is None or not base.values:
        cell.ci_note = absent
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
