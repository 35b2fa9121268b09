"""Table 2's teacher column: the top-1 of each row's teacher, the paper's and ours. Ours is the teacher run's own
top-1, which a student records with the teacher it distilled from (result.json and the wandb summary: `teacher`)."""

from __future__ import annotations

from typing import Any

from deit_ablate.config.studies import paper_tables

from .cells import Row, Table
from .reader import RunInfo

HEADERS = ("teacher ours", "teacher paper")


def paper_column(table: Table) -> dict[str, float | None] | None:
    """The paper's teacher top-1 by row (None when the paper table has no teacher column: not Table 2)."""
    if table.paper is None:
        return None
    raw = paper_tables().get(table.paper.name, {})
    column = raw.get("teacher_column")
    return {r["key"]: r.get(column) for r in raw.get("rows", [])} if column else None


def recorded_teacher(run: RunInfo) -> tuple[str, float] | None:
    """The teacher run a student recorded and that run's top-1, where it recorded both."""
    teacher = run.summary.get("teacher")
    if isinstance(teacher, dict):
        name, top1 = teacher.get("run"), teacher.get("top1")
    else:  # a summary read with flattened keys
        name, top1 = run.summary.get("teacher.run"), run.summary.get("teacher.top1")
    return (str(name), float(top1)) if name and isinstance(top1, (int, float)) else None


def ours(table: Table, row: Row) -> dict[str, float]:
    """The teacher runs the row's counted students distilled from, with their top-1 (one per teacher run)."""
    found: dict[str, float] = {}
    for key, _, run, _ in table.counted:
        recorded = recorded_teacher(run) if key == row.key else None
        if recorded is not None:
            found.setdefault(*recorded)
    return found


def _ours_text(values: dict[str, float], digits: int) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values.values()) if values else "—"


def headers(table: Table) -> list[str]:
    """The teacher columns' headers (none for tables without a teacher column)."""
    return list(HEADERS) if paper_column(table) is not None else []


def cells(table: Table, row: Row, digits: int = 2) -> list[str]:
    """A row's teacher cells, in the order of `headers`."""
    paper = paper_column(table)
    if paper is None:
        return []
    value = paper.get(row.base or row.key)
    absent = table.paper.absent if table.paper is not None else ""
    return [_ours_text(ours(table, row), digits), absent if value is None else f"{value:.1f}"]


def record(table: Table, row: Row) -> dict[str, Any]:
    """The row's teacher figures for JSON and CSV (empty for tables without a teacher column)."""
    paper = paper_column(table)
    if paper is None:
        return {}
    found = ours(table, row)
    return {"teacher_runs": list(found), "teacher_top1": list(found.values()),
            "teacher_paper": paper.get(row.base or row.key)}
