"""Writing a `Table` as markdown, CSV, LaTeX or JSON."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from .table import Cell, Row, Split, Table

FORMATS = ("markdown", "csv", "latex", "json")
STAGE_NAMES = {"pretrain": "pre-train", "finetune": "fine-tune"}
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
)


def cell_record(cell: Cell) -> dict[str, Any]:
    """A cell as plain values (full precision; None where there is no number)."""
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
            }
            for row in table.rows
        ],
        "splits": [split_record(s) for s in table.splits],
        "paper_note": table.paper_note,
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


def split_text(split: Split, limit: int = 8) -> str:
    """One line: which keys varied under a row key, and what became of the runs."""
    more = len(split.varied) - limit
    keys = ", ".join(split.varied[:limit]) + (f" +{more} more" if more > 0 else "")
    stage = STAGE_NAMES[split.stage]
    if split.left_out:
        dropped = sum(split.runs[1:])
        return (
            f"{split.row} ({stage}): runs differ in {keys}; kept {split.rows[0]!r} ({split.runs[0]} run(s)), "
            f"left out {dropped} run(s) of {len(split.rows) - 1} other setting(s) (--match-baseline)"
        )
    parts = ", ".join(f"{label!r} ({n})" for label, n in zip(split.rows, split.runs, strict=True))
    return f"{split.row} ({stage}): runs differ in {keys}; split into {parts}"


def _num(value: float | None, digits: int, sign: bool = False) -> str:
    if value is None:
        return ""
    if sign:
        text = f"{value:+.{digits}f}"
        return "+0." + "0" * digits if text in ("-0." + "0" * digits, "+0." + "0" * digits) else text
    return f"{value:.{digits}f}"


def ours_text(cell: Cell, digits: int) -> str:
    """`mean ± std (n=k)` with what else happened to the cell's runs, or the reason there is no number."""
    extra = [
        f"+{count} {what}"
        for count, what in (
            (cell.n_diverged, "diverged"),
            (cell.n_failed, "failed"),
            (cell.n_unfinished, "unfinished"),
            (cell.n_no_metric, "without metric"),
            (len(cell.same_seed), "same seed, not averaged"),
        )
        if count
    ]
    state = cell.state
    if state == "ok":
        text = _num(cell.mean, digits)
        if cell.std is not None:
            text += " ± " + _num(cell.std, digits)
        return f"{text} (n={cell.n}{'; ' + ', '.join(extra) if extra else ''})"
    if state == "missing":
        return "missing"
    counts = {
        "diverged": cell.n_diverged,
        "unfinished": cell.n_unfinished,
        "failed": cell.n_failed,
        "n/a": cell.n_no_metric,
    }
    others = [e for e in extra if not e.endswith(" " + state) and not (state == "n/a" and e.endswith("metric"))]
    return f"{state} ({counts[state]}{'; ' + ', '.join(others) if others else ''})"


def paper_text(cell: Cell) -> str:
    """The paper's number for a cell, with its ± where it has one."""
    if cell.paper is None:
        return cell.paper_absent
    return _num(cell.paper, 1) + (" ± " + _num(cell.paper_std, 1) if cell.paper_std is not None else "")


def _headers(table: Table) -> list[str]:
    heads = [table.rows_key] + (["Δ to"] if table.per_row_baselines else [])
    for stage in table.stages:
        sizes = table.stage_sizes.get(stage) or []
        at = f" @{'/'.join(map(str, sizes))}" if sizes else ""
        heads.append(f"ours {STAGE_NAMES[stage]}{at}")
        if table.baseline is not None:
            heads.append("Δ")
        if table.paper is not None:
            col = table.paper.columns.get(stage, "")
            heads.append(f"paper {'@' + col if col.isdigit() else col}".rstrip())
            heads.append("paper Δ")
    return heads


def _row_label(row: Row) -> str:
    return f"{row.key} †" if row.note == "did not train well" else row.key


def _cells(table: Table, row: Row, digits: int) -> list[str]:
    out = [_row_label(row)] + ([row.delta_to if row.delta_to != row.key else ""] if table.per_row_baselines else [])
    for stage in table.stages:
        cell = row.cells[stage]
        out.append(ours_text(cell, digits))
        if table.baseline is not None:
            out.append(_num(cell.delta, digits, sign=True))
        if table.paper is not None:
            out.append(paper_text(cell))
            out.append(_num(cell.paper_delta, 1, sign=True))
    return out


def _caption(table: Table) -> str:
    title = table.paper.title if table.paper else f"Runs grouped by {table.rows_key}"
    text = f"{title}. Ours: summary `{table.metric_key}` (--metric {table.metric}), mean ± std over seeds (n)"
    if table.per_row_baselines:
        text += "; Δ = difference to the row's own baseline (`Δ to`: the row it extends by its one ingredient)"
    elif table.baseline is not None:
        text += f"; Δ = difference to `{table.baseline}`"
    return text + "."


def _footnotes(table: Table) -> list[str]:
    notes = []
    flagged = [r.key for r in table.rows if r.note == "did not train well"]
    if flagged:
        notes.append(f'† The paper marks {", ".join(flagged)} as "did not train well".')
    other = [f"{r.key}: {r.note}" for r in table.rows if r.note and r.note != "did not train well"]
    if other:
        notes.append("Paper notes: " + "; ".join(other) + ".")
    if table.splits:
        splits = "; ".join(split_text(s) for s in table.splits)
        notes.append(f"A cell holds runs that differ only in the seed. {splits}.")
    if table.paper_note:
        notes.append(table.paper_note[0].upper() + table.paper_note[1:] + ".")
    meta = table.meta
    if meta:
        notes.append(
            f"Runs: {meta.get('read', 0)} read, {meta.get('duplicates', 0)} duplicate(s) dropped, "
            f"{meta.get('filtered_out', 0)} filtered out, {meta.get('counted', 0)} counted."
        )
    if table.paper is not None:
        notes.append(f"Paper: {table.paper.model}, {table.paper.citation}")
    return notes


def to_markdown(table: Table, digits: int = 2) -> str:
    """A GitHub markdown table with a caption and footnotes."""
    heads = _headers(table)
    lines = [_caption(table), "", "| " + " | ".join(heads) + " |"]
    lines.append("|" + "|".join([":--"] + ["--:"] * (len(heads) - 1)) + "|")
    for row in table.rows:
        lines.append("| " + " | ".join(_cells(table, row, digits)) + " |")
    notes = _footnotes(table)
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    """One line per row; numbers at full precision, empty where there is none."""
    fields = ["row", "base", "delta_to", "label", "note"] + [f"{s}_{f}" for s in table.stages for f in CELL_FIELDS]
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
        writer.writerow(line)
    return buf.getvalue()


def _tex(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("#", r"\#")):
        text = text.replace(a, b)
    for a, b in (("Δ", r"$\Delta$"), ("↑", r"$\uparrow$"), ("†", r"$^\dagger$"), ("±", r"$\pm$"), ("·", r"$\cdot$")):
        text = text.replace(a, b)
    return text


def to_latex(table: Table, digits: int = 2) -> str:
    """A booktabs `tabular` (needs \\usepackage{booktabs})."""
    heads = _headers(table)
    lines = [
        "% " + _caption(table),
        r"\begin{tabular}{l" + "r" * (len(heads) - 1) + "}",
        r"\toprule",
        " & ".join(_tex(h) for h in heads) + r" \\",
        r"\midrule",
    ]
    for row in table.rows:
        lines.append(" & ".join(_tex(c) for c in _cells(table, row, digits)) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += ["% " + n for n in _footnotes(table)]
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
