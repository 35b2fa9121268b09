"""Writing a `Table` as markdown, CSV, LaTeX or JSON."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from . import sharp, teachers
from .about import fact_lines, facts, headline
from .cells import Cell, Row, Split, Table
from .paper import HEADS, STAGE_NAMES

FORMATS = ("markdown", "csv", "latex", "json")
ZERO_MARK = "○"  # after a Δ whose 95% interval contains 0
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
)
STATS_NOTES = (
    "Δ 95% CI: Welch's t interval over seeds, the row against its baseline: Δ ± t_{0.975,ν}·sqrt(s1²/n1 + s2²/n2), "
    "ν by Welch–Satterthwaite; \"n=1, no spread\" where an arm has one seed, \"s=0, no spread\" where no seed "
    "differs, \"no baseline\" where the baseline has no number.",
    f"{ZERO_MARK} the 95% interval contains 0: this Δ cannot be told from zero with these seeds.",
)
SEEDS_NOTE = (
    "seeds/arm: seeds per arm to resolve the paper's Δ at our measured spread (80% power, 5% two-sided), "
    "n ≈ 2·(z_0.975 + z_0.8)²·s²/Δ_paper² with s the pooled std of the row and its baseline (at least 2)."
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


def ours_text(cell: Cell, digits: int, head: bool = False) -> str:
    """`mean ± std (n=k)` with what else happened to the cell's runs, or the reason there is no number; with
    `head`, `· <head>` after a number that is one ⚗ head's."""
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
        text = f"{text} (n={cell.n}{'; ' + ', '.join(extra) if extra else ''})"
        return f"{text} · {HEADS[cell.head]}" if head and cell.head else text
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


def delta_text(cell: Cell, digits: int) -> str:
    """Δ with the marker where its 95% interval contains 0."""
    text = _num(cell.delta, digits, sign=True)
    return f"{text} {ZERO_MARK}" if text and cell.ci is not None and cell.ci.contains_zero else text


def interval_text(cell: Cell, digits: int) -> str:
    """`[low, high]`, or why there is no interval (`n=1, no spread`, `s=0, no spread`, `no baseline`)."""
    ci = cell.ci
    if ci is None:
        return cell.ci_note
    if ci.low is None or ci.high is None:
        return ci.why
    return f"[{_num(ci.low, digits, sign=True)}, {_num(ci.high, digits, sign=True)}]"


def seeds_text(cell: Cell) -> str:
    """Seeds per arm the paper's Δ would need, or why there is no count."""
    return str(cell.seeds_needed) if cell.seeds_needed is not None else cell.seeds_note


def paper_text(cell: Cell) -> str:
    """The paper's number for a cell, with its ± where it has one."""
    if cell.paper is None:
        return cell.paper_absent
    text = _num(cell.paper, 1) + (" ± " + _num(cell.paper_std, 1) if cell.paper_std is not None else "")
    return f"{text} · {HEADS[cell.paper_head]}" if cell.paper_head else text


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
        if table.baseline is not None:
            heads.append("Δ 95% CI")
            if table.paper is not None:
                heads.append("seeds/arm")
    return heads + teachers.headers(table) + sharp.headers(table)


def _row_label(row: Row) -> str:
    return f"{row.key} †" if row.note == "did not train well" else row.key


def _cells(table: Table, row: Row, digits: int) -> list[str]:
    out = [_row_label(row)] + ([row.delta_to if row.delta_to != row.key else ""] if table.per_row_baselines else [])
    for stage in table.stages:
        cell = row.cells[stage]
        out.append(ours_text(cell, digits, head=table.metric == "top1"))  # else the caption's --metric names it
        if table.baseline is not None:
            out.append(delta_text(cell, digits))
        if table.paper is not None:
            out.append(paper_text(cell))
            out.append(_num(cell.paper_delta, 1, sign=True))
        if table.baseline is not None:
            out.append(interval_text(cell, digits))
            if table.paper is not None:
                out.append(seeds_text(cell))
    return out + teachers.cells(table, row, digits) + sharp.cells(table, row)


def _caption(table: Table, markdown: bool = True) -> str:
    """What the columns hold (the study's title is the heading's, not repeated here); `markdown`: code in backticks."""

    def code(text: str) -> str:
        return f"`{text}`" if markdown else text

    text = f"Ours: summary {code(table.metric_key)} (--metric {table.metric}), mean ± std over seeds (n)"
    if table.per_row_baselines:
        text += f"; Δ = difference to the row's own baseline ({code('Δ to')}: the row it extends by its one ingredient)"
    elif table.baseline is not None:
        text += f"; Δ = difference to {code(table.baseline)}"
    if table.baseline is not None:
        text += f", with its 95% interval over seeds (Δ 95% CI; {ZERO_MARK}: the interval contains 0)"
    return text + "."


def heads_text(table: Table) -> str:
    """Which ⚗ head the paper's numbers are, where the numbers file names one ('' where none does)."""
    rows: dict[tuple[str, str], list[str]] = {}  # (stage, head) -> row keys
    for row in table.rows:
        for stage in table.stages:
            head = row.cells[stage].paper_head
            if head:
                rows.setdefault((stage, head), []).append(row.key)
    if not rows:
        return ""
    which = "; ".join(f"{STAGE_NAMES[stage]}, {HEADS[head]}: {', '.join(keys)}" for (stage, head), keys in rows.items())
    ours = "ours beside it is the same head's figure" if table.metric == "top1" else f"ours is --metric {table.metric}"
    note = f" {table.paper.heads_note}" if table.paper is not None and table.paper.heads_note else ""
    return f"Heads: where the paper's number is one head's of a ⚗ model, {ours} ({which}).{note}"


def _footnotes(table: Table) -> list[str]:
    notes = []
    flagged = [r.key for r in table.rows if r.note == "did not train well"]
    if flagged:
        notes.append(f'† The paper marks {", ".join(flagged)} as "did not train well".')
    other = [f"{r.key}: {r.note}" for r in table.rows if r.note and r.note != "did not train well"]
    if other:
        notes.append("Paper notes: " + "; ".join(other) + ".")
    heads = heads_text(table)
    if heads:
        notes.append(heads)
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
    if table.baseline is not None:
        notes += list(STATS_NOTES) + ([SEEDS_NOTE] if table.paper is not None else [])
    if table.sharpness_stages:
        notes.append(sharp.NOTE)
    if table.paper is not None:
        notes.append(f"Paper: {table.paper.model}, {table.paper.citation}")
    return notes


def to_markdown(table: Table, digits: int = 2) -> str:
    """A GitHub markdown table with a caption and footnotes."""
    heads = _headers(table)
    lines = [headline(table), "", _caption(table), "", "| " + " | ".join(heads) + " |"]
    lines.append("|" + "|".join([":--"] + ["--:"] * (len(heads) - 1)) + "|")
    for row in table.rows:
        lines.append("| " + " | ".join(_cells(table, row, digits)) + " |")
    notes = _footnotes(table)
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
    heads = _headers(table)
    lines = [
        "% " + headline(table),
        "% " + _caption(table, markdown=False),
        r"\begin{tabular}{l" + "r" * (len(heads) - 1) + "}",
        r"\toprule",
        " & ".join(_tex(h) for h in heads) + r" \\",
        r"\midrule",
    ]
    for row in table.rows:
        lines.append(" & ".join(_tex(c) for c in _cells(table, row, digits)) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += ["% " + n for n in _footnotes(table)]
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
