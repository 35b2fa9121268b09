"""The table's columns, cell texts, caption and notes, shared by every text format and the HTML page."""

from __future__ import annotations

from . import fusion, sharp, teachers
from .cells import Cell, Row, Split, Table
from .paper import HEADS, STAGE_NAMES
from .scratch import NOTE as SCRATCH_NOTE
from .scratch import STAGE as SCRATCH_STAGE

ZERO_MARK = "○"  # after a Δ whose 95% interval contains 0

STATS_NOTES = (
    "Δ 95% CI: Welch's t interval over seeds, the row against its baseline: Δ ± t_{0.975,ν}·sqrt(s1²/n1 + s2²/n2), "
    "ν by Welch–Satterthwaite; \"n=1, no spread\" where an arm has one seed, \"s=0, no spread\" where no seed "
    "differs, \"no baseline\" where the baseline has no number.",
    f"{ZERO_MARK} the 95% interval contains 0: this Δ cannot be told from zero with these seeds.",
)
ONE_SEED = "one seed per row: no spread, so no ± and no interval"
SEEDS_NOTE = (
    "seeds/arm: seeds per arm to resolve the paper's Δ at our measured spread (80% power, 5% two-sided), "
    "n ≈ 2·(z_0.975 + z_0.8)²·s²/Δ_paper² with s the pooled std of the row and its baseline (at least 2)."
)


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


def ours_text(cell: Cell, digits: int, head: bool = False, count: bool = True) -> str:
    """`mean ± std (n=k)` with what else happened to the cell's runs, or the reason there is no number; with
    `head`, `· <head>` after a number that is one ⚗ head's; without `count`, no `n=k` (one seed, said once)."""
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
        inner = f"n={cell.n}" if count else ""
        if extra:
            inner += ("; " if inner else "") + ", ".join(extra)
        text = f"{text} ({inner})" if inner else text
        return (f"{text} · {HEADS[cell.head]}" if head and cell.head else text) + fusion.rule_text(cell)
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


def paper_deltas(table: Table) -> bool:
    """Whether the paper's table has a Δ to show: a baseline row, or a baseline for each row (not Table 7)."""
    paper = table.paper
    return paper is not None and bool(paper.baseline or any(r.baseline for r in paper.rows))


def intervals(table: Table) -> bool:
    """Whether the Δ 95% CI column is shown: there is a Δ, and some cell has more than one seed."""
    return table.compared and not table.one_seed


def _has_reference(table: Table, stage: str) -> bool:
    return bool(table.reference) and stage == SCRATCH_STAGE


def headers(table: Table) -> list[str]:
    """The column headers, in the order of `row_cells`."""
    heads = [table.rows_key] + (["Δ to"] if table.per_row_baselines else [])
    fused = fusion.stages(table)
    for stage in table.stages:
        sizes = table.stage_sizes.get(stage) or []
        at = f" @{'/'.join(map(str, sizes))}" if sizes else ""
        heads.append(f"ours {STAGE_NAMES[stage]}{at}")
        heads += [fusion.HEADER] if stage in fused else []
        heads += [f"ours {table.reference}"] if _has_reference(table, stage) else []
        heads += ["Δ"] if table.compared else []
        if table.paper is not None:
            col = table.paper.columns.get(stage, "")
            heads.append(f"paper {'@' + col if col.isdigit() else col}".rstrip())
            heads += ["paper Δ"] if paper_deltas(table) else []
        if intervals(table):
            heads.append("Δ 95% CI")
            heads += ["seeds/arm"] if paper_deltas(table) else []
    return heads + teachers.headers(table) + sharp.headers(table)


def _row_label(row: Row) -> str:
    return f"{row.key} †" if row.note == "did not train well" else row.key


def row_cells(table: Table, row: Row, digits: int) -> list[str]:
    """One row's cell texts, in the order of `headers`."""
    out = [_row_label(row)] + ([row.delta_to if row.delta_to != row.key else ""] if table.per_row_baselines else [])
    count = not table.one_seed  # one seed in every cell: the caption says it once
    fused = fusion.stages(table)
    for stage in table.stages:
        cell = row.cells[stage]
        out.append(ours_text(cell, digits, head=table.metric == "top1", count=count))  # else the caption's --metric
        out += [fusion.other_text(cell, digits)] if stage in fused else []
        if _has_reference(table, stage):
            out.append(ours_text(row.reference or Cell(), digits, count=count))
        out += [delta_text(cell, digits)] if table.compared else []
        if table.paper is not None:
            out.append(paper_text(cell))
            out += [_num(cell.paper_delta, 1, sign=True)] if paper_deltas(table) else []
        if intervals(table):
            out.append(interval_text(cell, digits))
            out += [seeds_text(cell)] if paper_deltas(table) else []
    return out + teachers.cells(table, row, digits) + sharp.cells(table, row)


def delta_reference(table: Table) -> str:
    """What Δ is measured against, in words: `baseline`, `each row's own baseline`, `the same network from scratch`."""
    if table.per_row_baselines:
        return "each row's own baseline"
    if table.reference:
        return "the same network trained from scratch"
    return table.baseline or ""


def caption(table: Table, markdown: bool = True) -> str:
    """What the columns hold (the study's title is the heading's, not repeated here); `markdown`: code in backticks."""

    def code(text: str) -> str:
        return f"`{text}`" if markdown else text

    seeds = ONE_SEED if table.one_seed else "mean ± std over seeds (n)"
    text = f"Ours: summary {code(table.metric_key)} (--metric {table.metric}), {seeds}"
    if table.per_row_baselines:
        text += f"; Δ = difference to the row's own baseline ({code('Δ to')}: the row it extends by its one ingredient)"
    elif table.reference:
        text += (f"; Δ = difference to {code('ours ' + table.reference)}, the same network trained from scratch on "
                 "the row's data")
    elif table.baseline is not None:
        text += f"; Δ = difference to {code(table.baseline)}"
    if intervals(table):
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


def rows_note(table: Table) -> str:
    """`19 of 22 rows have no runs (missing): --only-present hides them.`; '' when every row has runs."""
    empty = len(table.without_runs)
    if not empty:
        return ""
    return (f"{empty} of {len(table.rows)} rows have no runs (missing): --only-present hides them "
            "(and a stage nobody ran).")


def footnotes(table: Table) -> list[str]:
    """The notes under the table: the other studies' runs and the rows without runs first, then what the marks,
    splits and columns mean."""
    notes = [note for note in (table.meta.get("also", ""), rows_note(table)) if note]
    flagged = [r.key for r in table.rows if r.note == "did not train well"]
    if flagged:
        notes.append(f'† The paper marks {", ".join(flagged)} as "did not train well".')
    other = [f"{r.key}: {r.note}" for r in table.rows if r.note and r.note != "did not train well"]
    if other:
        notes.append("Paper notes: " + "; ".join(other) + ".")
    heads = heads_text(table)
    if heads:
        notes.append(heads)
    notes += [fusion.NOTE] if fusion.stages(table) else []
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
    notes += [SCRATCH_NOTE] if table.reference else []
    if intervals(table):
        notes += list(STATS_NOTES) + ([SEEDS_NOTE] if paper_deltas(table) else [])
    if table.sharpness_stages:
        notes.append(sharp.NOTE)
    if table.paper is not None:
        notes.append(f"Paper: {table.paper.model}, {table.paper.citation}")
    return notes


