"""The sharpness columns (Chen, Hsieh & Gong 2022): ours from the runs' summaries (`sharpness/lambda_max`, ...,
written by `python -m deit_ablate.sharpness` or `sharpness.at_end=true`), the paper's from its numbers file's
`sharpness` field. Shown only when a counted run has a figure."""

from __future__ import annotations

import statistics
from typing import Any

from .cells import Cell, Row, Table
from .paper import STAGE_NAMES
from .reader import metric_value

# (summary figure, column header, digits)
FIGURES = (("lambda_max", "λ_max", 1), ("train_loss", "train loss", 3), ("noisy_loss", "noisy loss", 3))
PREFIX = "sharpness/"
PAPER_STAGE = "pretrain"  # Chen et al. measure models trained from scratch, never fine-tuned
NOTE = ("λ_max, train loss, noisy loss: the sharpness of each run's final weights (mean ± std over its seeds), "
        "measured by `python -m deit_ablate.sharpness` or sharpness.at_end=true on fixed training images without "
        "augmentation (settings in each run's result.json); the paper's are Chen, Hsieh & Gong 2022's for ViT-B/16 "
        "on ImageNet, whose scale a demo run does not share.")


def fill_sharpness(table: Table) -> None:
    """Each cell's figures from its counted runs, the paper's beside the pre-training cell, and the stages that
    show them (none when no counted run has a figure)."""
    for label, stage, run, value in table.counted:
        if run.status != "finished" or value is None:
            continue
        row = table.row(label)
        for name, _, _ in FIGURES:
            figure = metric_value(run, PREFIX + name)
            if row is not None and figure is not None:
                row.cells[stage].sharpness.setdefault(name, []).append(figure)
    table.sharpness_stages = [s for s in table.stages if any(r.cells[s].sharpness for r in table.rows)]
    if table.paper is None or PAPER_STAGE not in table.sharpness_stages:
        return
    for row in table.rows:
        prow = table.paper.row(row.key)
        if prow is not None:
            row.cells[PAPER_STAGE].paper_sharpness.update(prow.sharpness)


def has_paper_figures(table: Table) -> bool:
    """Whether the paper columns are shown: ours are, and the paper table gives a figure for some row."""
    return PAPER_STAGE in table.sharpness_stages and table.paper is not None and \
        any(r.sharpness for r in table.paper.rows)


def headers(table: Table) -> list[str]:
    """The sharpness columns' headers (with the stage when both stages have figures)."""
    heads = []
    for stage in table.sharpness_stages:
        at = f" ({STAGE_NAMES[stage]})" if len(table.sharpness_stages) > 1 else ""
        paper = stage == PAPER_STAGE and has_paper_figures(table)
        for _, head, _ in FIGURES:
            heads += [f"{head}{at}"] + ([f"paper {head}"] if paper else [])
    return heads


def _text(values: list[float], digits: int) -> str:
    if not values:
        return ""
    text = f"{statistics.fmean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def cells(table: Table, row: Row) -> list[str]:
    """A row's sharpness cells, in the order of `headers`."""
    out = []
    for stage in table.sharpness_stages:
        cell = row.cells[stage]
        paper = stage == PAPER_STAGE and has_paper_figures(table)
        for name, _, digits in FIGURES:
            out.append(_text(cell.sharpness.get(name, []), digits))
            if paper:
                value = cell.paper_sharpness.get(name)
                out.append("" if value is None else f"{value:g}")
    return out


def record(cell: Cell) -> dict[str, Any]:
    """A cell's figures as plain values (JSON): mean, std, n and the paper's, per figure."""
    out: dict[str, Any] = {}
    for name, _, _ in FIGURES:
        values = cell.sharpness.get(name, [])
        out[name] = {"mean": statistics.fmean(values) if values else None,
                     "std": statistics.stdev(values) if len(values) > 1 else None, "n": len(values),
                     "paper": cell.paper_sharpness.get(name)}
    return out


def csv_fields(table: Table) -> list[str]:
    """The CSV's sharpness columns: `<stage>_<figure>` and `<stage>_paper_<figure>`."""
    return [f"{stage}_{prefix}{name}" for stage in table.sharpness_stages for name, _, _ in FIGURES
            for prefix in ("", "paper_")]


def csv_values(table: Table, row: Row) -> dict[str, Any]:
    """A row's CSV sharpness values at full precision (empty where there is none)."""
    line: dict[str, Any] = {}
    for stage in table.sharpness_stages:
        for name, figure in record(row.cells[stage]).items():
            line[f"{stage}_{name}"] = "" if figure["mean"] is None else repr(figure["mean"])
            line[f"{stage}_paper_{name}"] = "" if figure["paper"] is None else repr(figure["paper"])
    return line
