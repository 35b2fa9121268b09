"""The papers' numbers (DeiT Tables 3, 8 and 10; CaiT's ablations), read from the numbers files of the config
folders (`conf/<group>/numbers.json`, see deit_ablate/config/studies.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deit_ablate.config.studies import default_tables, paper_tables

STAGES = ("pretrain", "finetune", "transfer")
STAGE_NAMES = {"pretrain": "pre-train", "finetune": "fine-tune", "transfer": "transfer"}
# A ⚗ model's heads (losses.py's evaluation scores), as a numbers file names the one a paper number is
HEADS = {"cls": "class head", "dist": "distillation head", "fused": "fused heads"}


@dataclass(frozen=True)
class PaperRow:
    """One row of a paper table: top-1 per stage (None where the paper has no number)."""

    key: str
    label: str
    values: dict[str, float | None]
    stds: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    baseline: str = ""  # the row this one differs from by its ingredient, where the table gives each row its own
    sharpness: dict[str, float] = field(default_factory=dict)  # lambda_max, train_loss, noisy_loss, where given
    heads: dict[str, str] = field(default_factory=dict)  # stage -> the head its number is (HEADS); none: not named


@dataclass(frozen=True)
class PaperTable:
    """A table of the paper, keyed by the config value of each row."""

    name: str
    title: str
    model: str
    rows_key: str
    baseline: str
    columns: dict[str, str]
    rows: tuple[PaperRow, ...]
    citation: str
    absent: str = ""  # what the paper column says where the source has no number ("not in the text")
    heads_note: str = ""  # where the heads its numbers are come from (an inference, where the text does not say)

    def row(self, key: str) -> PaperRow | None:
        """The row for a config value, if the paper has it."""
        return next((r for r in self.rows if r.key == key), None)


def table_names() -> list[str]:
    """Names of the paper tables (`table8`, `table3`, ...)."""
    return sorted(paper_tables())


def default_table(rows_key: str) -> str | None:
    """The table that matches a row grouping (`ablation` -> table8), if any."""
    return default_tables().get(rows_key)


def paper_table(name: str, metric: str = "top1") -> PaperTable:
    """One table; for rows with per-metric numbers (the distillation token's heads) `metric` picks them."""
    tables = paper_tables()
    if name not in tables:
        raise KeyError(f"unknown paper table {name!r}; known: {', '.join(sorted(tables))}")
    raw = tables[name]
    rows = []
    for r in raw["rows"]:
        heads = _heads(raw, name, r)
        if metric in HEADS and metric in r.get("by_metric", {}):  # the row's number for that head alone
            heads = {stage: metric for stage in STAGES}
        r = {**r, **r.get("by_metric", {}).get(metric, {})}
        rows.append(
            PaperRow(
                key=r["key"],
                label=r["label"],
                values={s: r.get(s) for s in STAGES},
                stds={s: r.get(f"{s}_std") for s in STAGES},
                note=r.get("note", ""),
                baseline=r.get("baseline", ""),
                sharpness={k: float(v) for k, v in (r.get("sharpness") or {}).items() if v is not None},
                heads={stage: head for stage, head in heads.items() if r.get(stage) is not None},
            )
        )
    return PaperTable(
        name=name,
        title=raw["title"],
        model=raw["model"],
        rows_key=raw["rows_key"],
        baseline=raw["baseline"],
        columns=dict(raw["columns"]),
        rows=tuple(rows),
        citation=raw["citation"],
        absent=raw.get("absent", ""),
        heads_note=raw.get("heads_note", ""),
    )


def _heads(raw: dict, name: str, row: dict) -> dict[str, str]:
    """The head each stage's number of a row is (the row's `heads`, else its table's); a ValueError naming the
    numbers file where it is not a map of stage to head."""
    heads = row.get("heads", raw.get("heads", {}))
    if not isinstance(heads, dict) or any(s not in STAGES or h not in HEADS for s, h in heads.items()):
        raise ValueError(f"conf/{raw['group']}/numbers.json: table {name}, row {row.get('key')}: `heads` {heads!r} "
                         f"is not a map of stage ({', '.join(STAGES)}) to head ({', '.join(HEADS)}). Name each "
                         "stage's head, e.g. {\"pretrain\": \"dist\"}, or leave `heads` out.")
    return dict(heads)
