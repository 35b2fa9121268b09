"""The papers' numbers (DeiT Tables 3, 8 and 10; CaiT's ablations), shipped as package data in `paper_numbers.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

STAGES = ("pretrain", "finetune")
STAGE_NAMES = {"pretrain": "pre-train", "finetune": "fine-tune"}


@dataclass(frozen=True)
class PaperRow:
    """One row of a paper table: top-1 per stage (None where the paper has no number)."""

    key: str
    label: str
    values: dict[str, float | None]
    stds: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    baseline: str = ""  # the row this one differs from by its ingredient, where the table gives each row its own


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

    def row(self, key: str) -> PaperRow | None:
        """The row for a config value, if the paper has it."""
        return next((r for r in self.rows if r.key == key), None)


@lru_cache(maxsize=1)
def load_numbers() -> dict[str, Any]:
    """The raw JSON shipped with the package."""
    text = resources.files(__package__).joinpath("paper_numbers.json").read_text(encoding="utf-8")
    return json.loads(text)


def table_names() -> list[str]:
    """Names of the shipped tables (`table8`, `table3`, ...)."""
    return sorted(load_numbers()["tables"])


def default_table(rows_key: str) -> str | None:
    """The table that matches a row grouping (`ablation` -> table8), if any."""
    return load_numbers()["defaults"].get(rows_key)


def paper_table(name: str, metric: str = "top1") -> PaperTable:
    """One table; for rows with per-metric numbers (the distillation token's heads) `metric` picks them."""
    data = load_numbers()
    if name not in data["tables"]:
        raise KeyError(f"unknown paper table {name!r}; known: {', '.join(table_names())}")
    raw = data["tables"][name]
    rows = []
    for r in raw["rows"]:
        r = {**r, **r.get("by_metric", {}).get(metric, {})}
        rows.append(
            PaperRow(
                key=r["key"],
                label=r["label"],
                values={s: r.get(s) for s in STAGES},
                stds={s: r.get(f"{s}_std") for s in STAGES},
                note=r.get("note", ""),
                baseline=r.get("baseline", ""),
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
        citation=raw.get("citation", data["citation"]),
        absent=raw.get("absent", ""),
    )
