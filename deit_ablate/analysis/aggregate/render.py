"""Writing a `Table` as markdown, CSV, LaTeX or JSON."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from . import fusion, sharp, teachers
from .about import fact_lines, facts, headline
from .cells import Cell, Split, Table
from .columns import ZERO_MARK, caption, footnotes, headers, row_cells

FORMATS = ("markdown", "csv", "latex", "json")
CELL_FIELDS = (
    "state",
    "mean",
    "std",
    "n",
    "diverged",
    "failed",
    "unfinished",
    "no_metric",
    "delta",
    "paper",
    "paper_std",
    "paper_delta",
    "head",
    "paper_head",
    "ci_low",
    "ci_high",
    "ci_df",
    "ci_contains_zero",
    "ci_note",
    "pooled_std",
    "seeds_needed",
    "seeds_note",
    "fusion",
    "other_fusion",
    "other_fusion_mean",
    "other_fusion_std",
)
def cell_record(cell: Cell) -> dict[str, Any]:
    """A cell as plain values (full precision; None where there is no number)."""
    ci = cell.ci
    return {
        "state": cell.state,
        "mean": cell.mean,
        "std": cell.std,
        "n": cell.n,
        "diverged": cell.n_diverged,
        "failed": cell.n_failed,
        "unfinished": cell.n_unfinished,
        "no_metric": cell.n_no_metric,
        "delta": cell.delta,
        "paper": cell.paper,
        "paper_std": cell.paper_std,
        "paper_delta": cell.paper_delta,
        "head": cell.head,
        "paper_head": cell.paper_head,
        "ci_low": ci.low if ci else None,
        "ci_high": ci.high if ci else None,
        "ci_df": ci.df if ci else None,
        "ci_contains_zero": ci.contains_zero if ci else None,
        "ci_note": ci.why if ci else cell.ci_note,
        "pooled_std": cell.pooled_std,
        "seeds_needed": cell.seeds_needed,
        "seeds_note": cell.seeds_note,
        **fusion.record(cell),
        **({"sharpness": sharp.record(cell)} if cell.sharpness else {}),
        "seeds": cell.seeds,
        "run_ids": cell.run_ids,
        "same_seed": cell.same_seed,
    }


def to_json_dict(table: Table) -> dict[str, Any]:
    """The whole table as a JSON-ready dict."""
    paper = None
    if table.paper is not None:
        p = table.paper
        paper = {"table": p.name, "title": p.title, "model": p.model, "columns": p.columns, "citation": p.citation}
    return {
        "rows_key": table.rows_key,
        "metric": table.metric,
        "metric_key": table.metric_key,
        "baseline": table.baseline,
        "reference": table.reference or None,
        "stages": table.stages,
        "stage_sizes": {s: table.stage_sizes.get(s, []) for s in table.stages},
        "paper": paper,
        "rows": [
            {
                "key": row.key,
                "base": row.base or row.key,
                "label": row.label,
                "note": row.note,
                "in_paper": row.in_paper,
                "delta_to": row.delta_to or None,
                "cells": {s: cell_record(row.cells[s]) for s in table.stages},
                **({"reference": cell_record(row.reference)} if row.reference is not None else {}),
                **teachers.record(table, row),
            }
            for row in table.rows
        ],
        "splits": [split_record(s) for s in table.splits],
        "paper_note": table.paper_note,
        "headline": headline(table),
        "about": dict(facts(table)),
        "meta": table.meta,
    }


def split_record(split: Split) -> dict[str, Any]:
    """How the runs under one row key were split into sub-rows (or, with --match-baseline, left out)."""
    return {
        "row": split.row,
        "stage": split.stage,
        "varied": split.varied,
        "rows": split.rows,
        "runs": split.runs,
        "left_out": split.left_out,
    }


def to_markdown(table: Table, digits: int = 2) -> str:
    """A GitHub markdown table with a caption and footnotes."""
    heads = headers(table)
    lines = [headline(table), "", caption(table), "", "| " + " | ".join(heads) + " |"]
    lines.append("|" + "|".join([":--"] + ["--:"] * (len(heads) - 1)) + "|")
    for row in table.rows:
        lines.append("| " + " | ".join(row_cells(table, row, digits)) + " |")
    notes = footnotes(table)
    if notes:
        lines += [""] + notes
    lines += ["", "What was run:"] + [f"- {line}" for line in fact_lines(table)]
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    """One line per row; numbers at full precision, empty where there is none."""
    fields = ["row", "base", "delta_to", "label", "note"] + [f"{s}_{f}" for s in table.stages for f in CELL_FIELDS]
    fields += sharp.csv_fields(table)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in table.rows:
        line: dict[str, Any] = {"row": row.key, "base": row.base or row.key, "delta_to": row.delta_to,
                                "label": row.label, "note": row.note}
        for stage in table.stages:
            rec = cell_record(row.cells[stage])
            for f in CELL_FIELDS:
                value = rec[f]
                line[f"{stage}_{f}"] = "" if value is None else (repr(value) if isinstance(value, float) else value)
        writer.writerow({**line, **sharp.csv_values(table, row)})
    return buf.getvalue()


def _tex(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#")):
        text = text.replace(a, b)
    marks = (("Δ", r"$\Delta$"), ("↑", r"$\uparrow$"), ("†", r"$^\dagger$"), ("±", r"$\pm$"), ("·", r"$\cdot$"),
             (ZERO_MARK, r"$\circ$"))
    for a, b in marks:
        text = text.replace(a, b)
    return text


def to_latex(table: Table, digits: int = 2) -> str:
    """A booktabs `tabular` (needs \\usepackage{booktabs})."""
    heads = headers(table)
    lines = [
        "% " + headline(table),
        "% " + caption(table, markdown=False),
        r"\begin{tabular}{l" + "r" * (len(heads) - 1) + "}",
        r"\toprule",
        " & ".join(_tex(h) for h in heads) + r" \\",
        r"\midrule",
    ]
    for row in table.rows:
        lines.append(" & ".join(_tex(c) for c in row_cells(table, row, digits)) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += ["% " + n for n in footnotes(table)]
    lines += ["% What was run: " + line for line in fact_lines(table)]
    return "\n".join(lines) + "\n"


def render(table: Table, fmt: str = "markdown", digits: int = 2) -> str:
    """The table in one of FORMATS."""
    if fmt == "markdown":
        return to_markdown(table, digits)
    if fmt == "csv":
        return to_csv(table)
    if fmt == "latex":
        return to_latex(table, digits)
    if fmt == "json":
        return json.dumps(to_json_dict(table), indent=2, ensure_ascii=False) + "\n"
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
