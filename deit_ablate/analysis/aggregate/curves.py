"""Validation top-1 against epoch for each row of a table: mean over seeds with a min–max band, a panel per stage.

Each row's legend entry gives its seed count (`n=1, no spread` where one run has no band; where every row has one
seed, the legend's title says it once); the title names the study and our runs, the foot what was run (as the Δ
plot's).

The per-epoch values come from the run folder's `metrics.csv` when it is found beside the wandb folder
(`<output_root>/runs/<run name>/metrics.csv` for a log in `<output_root>/wandb/`), else from the wandb
history: the log's history records offline, `Run.scan_history` through the W&B API.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deit_ablate.core.atomic import write_figure_atomic
from deit_ablate.record.rundir import METRICS

from .about import footer, headline
from .cells import Table
from .columns import ONE_SEED
from .paper import STAGE_NAMES
from .plot import framed_figure, literal
from .reader import RunInfo, csv_path, is_api_source, metrics_rows, read_histories, whole_epoch
from .stats import NO_SPREAD

METRICS_CSV = METRICS
# Which per-epoch key draws which --metric (the first one a run has); anything else draws `val/top1`.
CURVE_KEYS = {
    "top1": ("val_ema/top1", "val/top1"),  # the headline is EMA's when a run keeps an EMA
    "best": ("val_ema/top1", "val/top1"),
    "final": ("val/top1",),
    "fused": ("val/top1",),
    "ema": ("val_ema/top1",),
    "ema_best": ("val_ema/top1",),
    "cls": ("val/top1_cls",),
    "dist": ("val/top1_dist",),
    "fused_alt": ("val/top1_fused_alt",),
}


@dataclass
class Series:
    """One row's curve at one stage: per epoch, the values of its runs."""

    label: str
    epochs: list[int]
    values: list[list[float]]  # per epoch, one value per run that reached it

    @property
    def mean(self) -> list[float]:
        """Mean over the runs at each epoch."""
        return [statistics.fmean(v) for v in self.values]


def _api_history(run: RunInfo, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    scan = getattr(run.handle, "scan_history", None)
    if scan is None:
        return []
    for key in keys:  # the first key the run has, as epoch_values picks it
        rows = [dict(r) for r in scan(keys=["epoch", key]) if r.get("epoch") is not None]
        if rows:
            return rows
    return []


def load_histories(
    runs: list[RunInfo], keys: tuple[str, ...] = ("val/top1",), jobs: int | None = None
) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """Per run id: the per-epoch rows and where they came from (`csv`, `log`, `api`; empty if none)."""
    out: dict[str, tuple[list[dict[str, Any]], str]] = {}
    from_logs: list[RunInfo] = []
    for run in runs:
        path = csv_path(run)
        rows = metrics_rows(path, lambda message: None) if path is not None else None  # damage: said when read
        if rows is not None:
            out[run.run_id] = (rows, "csv")
        elif run.history is not None:
            out[run.run_id] = (run.history, "log")
        elif is_api_source(run.source):
            out[run.run_id] = (_api_history(run, keys), "api")
        else:
            from_logs.append(run)
    histories = read_histories([Path(r.source) for r in from_logs], jobs) if from_logs else []
    for run, rows in zip(from_logs, histories, strict=True):
        out[run.run_id] = (rows or [], "log")
    return out


def epoch_values(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[int, float]:
    """Value per epoch of the first of `keys` the rows have (an epoch logged twice, after a resume: the last)."""
    for key in keys:
        found = {
            whole_epoch(r["epoch"]): float(r[key])
            for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
            and whole_epoch(r.get("epoch")) is not None
        }
        if found:
            return found
    return {}


def curve_series(table: Table, histories: dict[str, tuple[list[dict[str, Any]], str]]) -> dict[str, list[Series]]:
    """Per stage, one Series for every row whose averaged runs have per-epoch values."""
    keys = CURVE_KEYS.get(table.metric, ("val/top1",))
    out: dict[str, list[Series]] = {}
    for stage in table.stages:
        series = []
        for row in table.rows:
            per_epoch: dict[int, list[float]] = {}
            for rid in row.cells[stage].run_ids:
                rows = histories.get(rid, ([], ""))[0]
                for epoch, value in epoch_values(rows, keys).items():
                    per_epoch.setdefault(epoch, []).append(value)
            if per_epoch:
                epochs = sorted(per_epoch)
                series.append(Series(row.key, epochs, [per_epoch[e] for e in epochs]))
        out[stage] = series
    return out


def draw_curves(table: Table, series: dict[str, list[Series]]) -> Any:
    """A matplotlib Figure: a panel per stage with data, a mean line and min–max band per row."""
    from matplotlib.ticker import MaxNLocator

    stages = [s for s in table.stages if series.get(s)] or table.stages[:1]
    head = f"{headline(table)}\nValidation top-1 by epoch: mean over seeds, band = min–max over seeds (n per row)"
    fig, rect = framed_figure(6.4 * len(stages), 4.6, head, footer(table))
    axes = fig.subplots(1, len(stages), squeeze=False)[0]
    colors = _colors([r.key for r in table.rows])
    one_seed = all(max(map(len, s.values)) == 1 for lines in series.values() for s in lines)  # said once: the legend
    for ax, stage in zip(axes, stages, strict=True):
        for s in series.get(stage, []):
            color = colors.get(s.label, "black")
            n = max(map(len, s.values))
            label = literal(s.label if one_seed else f"{s.label} (n={n})" if n > 1 else f"{s.label} ({NO_SPREAD})")
            ax.plot(s.epochs, s.mean, "-", color=color, marker="o", markersize=3, label=label)
            if n > 1:
                low, high = [min(v) for v in s.values], [max(v) for v in s.values]
                ax.fill_between(s.epochs, low, high, color=color, alpha=0.15, linewidth=0)
        sizes = table.stage_sizes.get(stage) or []
        at = f" @{'/'.join(map(str, sizes))}" if sizes else ""
        ax.set_title(f"{STAGE_NAMES.get(stage, stage)}{at}", fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"validation top-1 (%), for --metric {table.metric}")
        ax.grid(alpha=0.3)
        if series.get(stage):
            ax.legend(fontsize=7, title=ONE_SEED if one_seed else None, title_fontsize=7)
        else:
            ax.text(0.5, 0.5, "no per-epoch history", transform=ax.transAxes, ha="center")
    fig.tight_layout(rect=rect)
    return fig


def _colors(labels: list[str]) -> dict[str, Any]:
    """A colour per row: matplotlib's ten defaults, tab20 for more rows."""
    if len(labels) <= 10:
        return {label: f"C{i}" for i, label in enumerate(labels)}
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return {label: cmap(i % 20) for i, label in enumerate(labels)}


def plot_curves(table: Table, path: str | Path | None, jobs: int | None = None) -> Any:
    """Draw the curves of a table's rows; write a PNG when `path` is given; return the Figure."""
    averaged = {rid for row in table.rows for cell in row.cells.values() for rid in cell.run_ids}
    runs = [run for _, _, run, _ in table.counted if run.run_id in averaged]
    keys = CURVE_KEYS.get(table.metric, ("val/top1",))
    fig = draw_curves(table, curve_series(table, load_histories(runs, keys, jobs)))
    if path is not None:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_figure_atomic(out, fig)
    return fig
