"""A grouped horizontal bar chart of each row's difference to the baseline, ours beside the paper's, per stage.

Rows run down the page with their names level (no rotated text); rows without runs have no bar. Our bars carry
their 95% Welch interval over seeds as error bars and the seed counts (`n=3 vs 4`, or `n=1, no spread`), said once
in a corner where every row has one seed; a Δ whose interval contains 0 gets an open circle. The figure's title
names the study and our runs; its foot says what was run (data, model, epochs, resolution, preset, commit, filters).
"""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path
from typing import Any

from deit_ablate.core.atomic import write_figure_atomic

from .about import footer, headline
from .cells import Cell, Row, Table
from .columns import ONE_SEED, delta_reference
from .paper import STAGE_NAMES

# ours / paper, per stage: a dark and a light shade of one hue
COLORS = {"pretrain": ("#1f5f9f", "#9cc3e6"), "finetune": ("#b5541b", "#f2b48a")}
CI_LABEL = "95% CI of Δ (Welch, over seeds)"
ZERO_LABEL = "CI contains 0: cannot be told from zero"
HEAD_PT, FOOT_PT = 9.5, 6.5  # font sizes of the title and the foot


def _limit(values: list[float]) -> float:
    """A y half-range that shows the ordinary rows; the collapsed rows' bars are clipped and labelled."""
    finite = sorted(abs(v) for v in values if math.isfinite(v))
    if not finite:
        return 1.0
    return max(1.0, finite[-1]) * 1.15


def literal(text: str) -> str:
    """A user's string (a row, a filter, a run name) as matplotlib draws it as it is: `$` would start mathtext."""
    return text.replace("$", r"\$")


def figure_png(fig: Any) -> bytes:
    """A matplotlib Figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_deltas(table: Table, path: str | Path, title: str | None = None) -> Path:
    """Draw Δ to the baseline for every row but the baseline itself; write a PNG."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_figure_atomic(out, draw_deltas(table, title))
    return out


def _wrap(text: str, width_in: float, points: float) -> str:
    chars = max(40, int(width_in * 72 / (points * 0.6)))
    return "\n".join(textwrap.fill(part, chars) for part in text.split("\n"))


def framed_figure(width_in: float, height_in: float, head: str, foot: str) -> tuple[Any, tuple[float, ...]]:
    """A Figure with the head as its suptitle and the foot along its bottom; the rect left for the axes (the
    suptitle is tight_layout's own)."""
    from matplotlib.figure import Figure

    head, foot = literal(_wrap(head, width_in, HEAD_PT)), literal(_wrap(foot, width_in, FOOT_PT))
    top = (head.count("\n") + 1) * HEAD_PT * 1.35 / 72 + 0.15
    bottom = (foot.count("\n") + 1) * FOOT_PT * 1.3 / 72 + 0.12
    total = height_in + top + bottom
    fig = Figure(figsize=(width_in, total), dpi=120)
    fig.suptitle(head, fontsize=HEAD_PT, y=1 - 0.06 / total, va="top")
    fig.text(0.01, 0.04 / total, foot, fontsize=FOOT_PT, ha="left", va="bottom", color="#333333")
    return fig, (0.0, bottom / total, 1.0, 1.0)


def _rows(table: Table) -> list[Row]:
    """The rows with a bar: rows with runs, but the baseline (or, with each row's own baseline, the roots)."""
    if table.per_row_baselines:  # each row against the row it extends; the roots have none
        return [r for r in table.rows if r.delta_to and r.delta_to != r.key and r.has_runs]
    return [r for r in table.rows if r.key != table.baseline and r.has_runs]


def _series(table: Table, rows: list[Row]) -> list[tuple[str, str, list[float | None], list[Cell] | None]]:
    """(label, color, values, our cells or None for the paper's) per bar series."""
    series: list[tuple[str, str, list[float | None], list[Cell] | None]] = []
    for stage in table.stages:
        dark, light = COLORS.get(stage, ("#444444", "#bbbbbb"))
        cells = [r.cells[stage] for r in rows]
        series.append((f"ours, {STAGE_NAMES[stage]}", dark, [c.delta for c in cells], cells))
        if table.paper is not None and any(c.paper_delta is not None for c in cells):
            col = table.paper.columns.get(stage, stage)
            series.append((f"paper, {col}", light, [c.paper_delta for c in cells], None))
    return series


def _half_range(rows: list[Row], series: list) -> float:
    """The half-range: the ordinary rows' Δs, widened for their intervals up to three times that."""
    ordinary = [r.note != "did not train well" for r in rows]
    values = [v for *_, vals, _ in series for ok, v in zip(ordinary, vals, strict=True) if ok and v is not None]
    base = _limit(values)
    ends = [abs(e) * 1.05 for *_, cells in series if cells for ok, c in zip(ordinary, cells, strict=True)
            if ok and c.ci is not None and c.ci.low is not None for e in (c.ci.low, c.ci.high)]
    return min(max([base, *ends]), 3 * base)


def _clip_labels(ax: Any, bars: Any, vals: list[float | None], lim: float) -> bool:
    """Hatch and label the bars clipped at the axis; whether any was."""
    clipped = False
    for bar, v in zip(bars, vals, strict=True):
        if v is not None and abs(v) > lim:
            bar.set_hatch("//")
            x = bar.get_width()
            clipped = True
            ax.annotate(f"{v:+.1f}", (x, bar.get_y() + bar.get_height() / 2), xytext=(3 if x < 0 else -3, 0),
                        textcoords="offset points", ha="left" if x < 0 else "right", va="center", fontsize=7)
    return clipped


def _spread_text(cell: Cell) -> str:
    ci = cell.ci
    if ci is None:
        return ""
    return ci.why or f"n={ci.n[0]} vs {ci.n[1]}"


def _spread(ax: Any, ys: list[float], widths: list[float], cells: list[Cell], lim: float, color: str,
            labelled: set[str], counts: bool) -> bool:
    """Error bars (95% interval), the open circle where it contains 0, and (with `counts`) the seed counts beside
    each bar; whether a bar was cut."""
    with_ci = [(y, w, c.ci) for y, w, c in zip(ys, widths, cells, strict=True)
               if c.ci is not None and c.ci.low is not None and c.delta is not None and abs(c.delta) <= lim]
    if with_ci:
        low = [w - ci.low for _, w, ci in with_ci]
        high = [ci.high - w for _, w, ci in with_ci]
        label = CI_LABEL if CI_LABEL not in labelled else "_nolegend_"
        labelled.add(CI_LABEL)
        ax.errorbar([w for _, w, _ in with_ci], [y for y, _, _ in with_ci], xerr=[low, high], fmt="none",
                    ecolor="black", elinewidth=0.9, capsize=2.5, label=label)
    zero = [(y, w) for y, w, ci in with_ci if ci.contains_zero]
    if zero:
        label = ZERO_LABEL if ZERO_LABEL not in labelled else "_nolegend_"
        labelled.add(ZERO_LABEL)
        ax.plot([w for _, w in zero], [y for y, _ in zero], linestyle="none", marker="o", markersize=6,
                markerfacecolor="white", markeredgecolor="black", label=label, zorder=5)
    for y, w, cell in zip(ys, widths, cells, strict=True):
        text = _spread_text(cell) if cell.delta is not None and counts else ""
        if text:
            ax.annotate(text, (0, y), xytext=(-4 if w >= 0 else 4, 0), textcoords="offset points",
                        ha="right" if w >= 0 else "left", va="center", fontsize=6, color=color)
    return any(ci.low < -lim or ci.high > lim for _, _, ci in with_ci)


def _bars(ax: Any, table: Table, rows: list[Row], lim: float) -> tuple[bool, bool]:
    """Every series' bars, one group per row from the top; whether a bar was clipped, whether an error bar was cut."""
    series = _series(table, rows)
    height = 0.8 / max(1, len(series))
    clipped = cut = False
    labelled: set[str] = set()
    for i, (label, color, vals, cells) in enumerate(series):
        ys = [j + (i - (len(series) - 1) / 2) * height for j in range(len(rows))]
        widths = [0.0 if v is None else max(-lim, min(lim, v)) for v in vals]
        bars = ax.barh(ys, widths, height, label=literal(label), color=color)
        clipped |= _clip_labels(ax, bars, vals, lim)
        if cells is not None:
            cut |= _spread(ax, ys, widths, cells, lim, color, labelled, counts=not table.one_seed)
            for y, v, cell in zip(ys, vals, cells, strict=True):
                if v is None:
                    why = cell.state if cell.state != "ok" else cell.ci_note or "no baseline"
                    ax.annotate(why, (0, y), xytext=(3, 0), textcoords="offset points", ha="left", va="center",
                                fontsize=6, color=color)
    return clipped, cut


def draw_deltas(table: Table, title: str | None = None) -> Any:
    """The Δ chart as a matplotlib Figure (no pyplot state): a horizontal bar per row and series, every label level."""
    rows = _rows(table)
    lim = _half_range(rows, _series(table, rows))
    fig, rect = framed_figure(8.0, max(2.4, 0.32 * len(rows) * max(1, len(table.stages)) + 1.4),
                              title or headline(table), footer(table))
    ax = fig.subplots()
    clipped, cut = _bars(ax, table, rows, lim)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlim(-lim * 1.05, lim * 1.05)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([literal(f"{r.key}†" if r.note == "did not train well" else r.key) for r in rows])
    ax.invert_yaxis()  # the table's first row on top
    ax.set_xlabel(literal(f"Δ top-1 to {delta_reference(table) or 'baseline'} (points)"))
    legend = ax.legend(fontsize=7, ncols=2, loc="best", title=ONE_SEED if table.one_seed else None, title_fontsize=7)
    legend.set_zorder(6)  # above the bars it may lie on
    ax.grid(axis="x", alpha=0.3)
    notes = ["hatched: clipped, value printed"] if clipped else []
    notes += ["error bars cut at the axis"] if cut else []
    if notes:
        ax.text(0.01, 0.01, "; ".join(notes), transform=ax.transAxes, fontsize=7, va="bottom")
    if not rows:
        ax.text(0.5, 0.5, "no rows with runs", transform=ax.transAxes, ha="center")
    fig.tight_layout(rect=rect)
    return fig
