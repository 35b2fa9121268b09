"""A grouped bar chart of each row's difference to the baseline, ours beside the paper's, per stage."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from .render import STAGE_NAMES
from .table import Table

# ours / paper, per stage: a dark and a light shade of one hue
COLORS = {"pretrain": ("#1f5f9f", "#9cc3e6"), "finetune": ("#b5541b", "#f2b48a")}


def _limit(values: list[float]) -> float:
    """A y half-range that shows the ordinary rows; the collapsed rows' bars are clipped and labelled."""
    finite = sorted(abs(v) for v in values if math.isfinite(v))
    if not finite:
        return 1.0
    return max(1.0, finite[-1]) * 1.15


def figure_png(fig: Any) -> bytes:
    """A matplotlib Figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_deltas(table: Table, path: str | Path, title: str | None = None) -> Path:
    """Draw Δ to the baseline for every row but the baseline itself; write a PNG."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    draw_deltas(table, title).savefig(out, format="png")
    return out


def draw_deltas(table: Table, title: str | None = None) -> Any:
    """The Δ-to-baseline bar chart as a matplotlib Figure (no pyplot state)."""
    from matplotlib.figure import Figure

    if table.per_row_baselines:  # each row against the row it extends; the roots have none
        rows = [r for r in table.rows if r.delta_to and r.delta_to != r.key]
    else:
        rows = [r for r in table.rows if r.key != table.baseline]
    series = []  # (label, color, values, why a value is missing)
    for stage in table.stages:
        dark, light = COLORS.get(stage, ("#444444", "#bbbbbb"))
        states = [r.cells[stage].state for r in rows]
        series.append((f"ours, {STAGE_NAMES[stage]}", dark, [r.cells[stage].delta for r in rows], states))
        if table.paper is not None:
            col = table.paper.columns.get(stage, stage)
            series.append((f"paper, {col}", light, [r.cells[stage].paper_delta for r in rows], None))
    ordinary = [
        v
        for *_, vals, _ in series
        for r, v in zip(rows, vals, strict=True)
        if v is not None and r.note != "did not train well"
    ]
    lim = _limit(ordinary)
    width = 0.8 / max(1, len(series))
    clipped = False
    fig = Figure(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5), dpi=120)
    ax = fig.subplots()
    for i, (label, color, vals, states) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        heights = [0.0 if v is None else max(-lim, min(lim, v)) for v in vals]
        bars = ax.bar(xs, heights, width, label=label, color=color)
        for bar, v in zip(bars, vals, strict=True):
            if v is not None and abs(v) > lim:
                bar.set_hatch("//")
                y = bar.get_height()
                clipped = True
                ax.annotate(
                    f"{v:+.1f}",
                    (bar.get_x() + bar.get_width() / 2, y),
                    xytext=(0, 3 if y < 0 else -3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom" if y < 0 else "top",
                    fontsize=7,
                    rotation=90,
                )
        for x, v, state in zip(xs, vals, states or [None] * len(vals), strict=True):
            if v is None and state is not None:
                why = state if state != "ok" else "no baseline"
                ax.annotate(why, (x, 0), ha="center", va="bottom", fontsize=6, rotation=90, color=color)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylim(-lim * 1.05, lim * 1.05)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(
        [f"{r.key}†" if r.note == "did not train well" else r.key for r in rows], rotation=35, ha="right"
    )
    reference = "the row's own baseline" if table.per_row_baselines else table.baseline or "baseline"
    ax.set_ylabel(f"Δ top-1 to {reference} (points)")
    ax.set_title(title or (table.paper.title if table.paper else f"Δ by {table.rows_key}"), fontsize=10)
    ax.legend(fontsize=8, ncols=2)
    ax.grid(axis="y", alpha=0.3)
    if clipped:
        ax.text(0.01, 0.02, "hatched: clipped, value printed", transform=ax.transAxes, fontsize=7)
    if not rows:
        ax.text(0.5, 0.5, "no rows", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    return fig
