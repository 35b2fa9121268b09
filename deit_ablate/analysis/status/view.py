"""The status as a person reads it (a rich table, totals and the sweep's ETA below) and as a script reads it
(JSON with the same rows)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from deit_ablate.analysis.status.rows import STATES, RunRow

STYLE = {"finished": "green", "running": "cyan", "diverged": "yellow", "failed": "bold red", "stalled": "bold red",
         "damaged": "bold red", "preempted": "magenta", "queued": "blue", "requeued": "blue", "waiting": "dim",
         "planned": "dim", "blocked": "red"}
ACTIVE = ("running", "stalled")
ENDED = ("finished", "diverged", "failed", "blocked", "damaged")  # nothing left to run until a person acts
RUN_WIDTH = 36  # the run column's widest: its study row, cut with an ellipsis
TITLE_WIDTH = 100  # a sweep's overrides above the table, cut with an ellipsis
FILE_WIDTH = 160  # the table's width where the output is not a terminal (a file, a pipe)


def clock(seconds: float | None) -> str:
    """3725 -> '1:02:05'; '' for None."""
    if seconds is None:
        return ""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _number(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _of(done: int | None, total: int | None) -> str:
    return "" if done is None else f"{done}/{total}" if total else str(done)


def run_seconds(row: RunRow) -> float | None:
    """How long the run takes in all (elapsed + ETA), when known."""
    if row.elapsed_s is None:
        return None
    return row.elapsed_s + (row.eta_s or 0.0)


def sweep_eta(rows: Sequence[RunRow]) -> float | None:
    """A rough ETA for the sweep: the run-seconds left (runs in progress: their ETA; runs not started: the mean
    length of the runs that finished or are under way) over the runs training at once (at least one); None when
    nothing is known yet."""
    lengths = [s for r in rows if r.state in ("finished", *ACTIVE) for s in [run_seconds(r)] if s]
    typical = sum(lengths) / len(lengths) if lengths else None
    left = 0.0
    for row in rows:
        if row.state in ENDED:
            continue
        if row.eta_s is not None and row.state in ACTIVE:
            left += row.eta_s
        elif typical is None:
            return None
        else:
            left += max(typical - (row.elapsed_s or 0.0), 0.0)
    parallel = max(sum(r.state == "running" for r in rows), 1)
    return left / parallel


def totals(rows: Sequence[RunRow]) -> dict[str, Any]:
    """The count of runs in each state, and the sweep's ETA."""
    counts = Counter(r.state for r in rows)
    return {"runs": len(rows), "states": {s: counts[s] for s in STATES if counts[s]}, "eta_s": sweep_eta(rows)}


def totals_line(rows: Sequence[RunRow]) -> str:
    """`12 runs: 5 finished, 2 running, 5 planned | sweep ETA 1:02:05`."""
    t = totals(rows)
    states = ", ".join(f"{n} {s}" for s, n in t["states"].items())
    left = sum(n for s, n in t["states"].items() if s not in ENDED)
    eta = (" | nothing left to run" if not left else f" | sweep ETA {clock(t['eta_s'])}" if t["eta_s"] is not None
           else " | sweep ETA unknown until a run has progressed")
    return f"{t['runs']} run{'s' if t['runs'] != 1 else ''}: {states}{eta}"


def table(rows: Sequence[RunRow], title: str) -> Table:
    """The rich table: one row per run, the totals as its caption."""
    title = title if len(title) <= TITLE_WIDTH else title[:TITLE_WIDTH - 1] + "…"
    grid = Table(title=title, caption=totals_line(rows), caption_justify="left", expand=False)
    for name, justify in (("run", "left"), ("stage", "left"), ("seed", "right"), ("state", "left"),
                          ("epoch", "right"), ("step", "right"), ("img/s", "right"), ("elapsed", "right"),
                          ("ETA", "right"), ("top-1", "right"), ("best", "right"), ("detail", "left")):
        grid.add_column(name, justify=justify, overflow="fold" if name == "detail" else "ellipsis",
                        no_wrap=name != "detail", max_width=RUN_WIDTH if name == "run" else None)
    for r in rows:
        detail = "; ".join([*([f"also: {', '.join(r.also)}"] if r.also else []), *([r.detail] if r.detail else [])])
        detail += f" [log: {r.log}]" if r.state == "failed" and r.log else ""
        grid.add_row(r.row, r.stage, "" if r.seed is None else str(r.seed), Text(r.state, style=STYLE.get(r.state)),
                     _of(r.epoch, r.epochs), _of(r.step, r.total_steps), _number(r.img_per_s, ".0f"),
                     clock(r.elapsed_s), clock(r.eta_s), _number(r.last_top1, ".2f"), _number(r.best_top1, ".2f"),
                     detail)
    return grid


def as_json(rows: Sequence[RunRow], where: str) -> dict[str, Any]:
    """What `--json` prints: where the runs are, the rows, and the totals."""
    return {"where": where, "runs": [r.as_json() for r in rows], "totals": totals(rows)}
