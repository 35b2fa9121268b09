"""The registry of studies and paper tables, read from the config folders: nothing here lists a study.

Where a study's facts live (adding one = its folder of row files + its numbers file, nothing else):
- `conf/<study>/<row>.yaml`: one row of the study each (`# @package _global_`), a Hydra option of the group
  `<study>`; `python train.py -m '<study>=glob(*)'` sweeps them.
- `conf/<study>/numbers.json`: `{<table name>: {title, citation, model, baseline, default, columns, rows}}`: the
  paper's table (rows in the table's order, each `{key, label, pretrain, finetune, <stage>_std, note, baseline,
  by_metric}`), its baseline row, the row a run has when none is named (`default`: null for none), the paper's
  columns. A table whose rows are the folder's options makes the folder a study.
- Paper tables of groups that are not studies (their rows are a config key, `rows_key`): Table 3 in
  `conf/distill/numbers.json` (`distill.type`), Table 10 in `conf/resolution/numbers.json`
  (`resolution.train_size`).
- The defaults node `studies` (`- <study>: <default>` for each study, registered by config.py from
  `defaults_list`) stands in conf/config.yaml's defaults; a new study needs no line there.
- The recipe's default group options (conf/config.yaml's defaults, a preset's model and data from
  conf/preset/<preset>.yaml) are read by `default_choices` and `preset_choices`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
NUMBERS = "numbers.json"  # a study's numbers file in its folder (Hydra lists only .yaml files as options)
# Groups a run's folder and table depend on in their own way, not default options: the stage is a table's column,
# the resolution's default is `<preset>_<stage>`.
NOT_DEFAULT_OPTIONS = ("stage", "resolution")


@dataclass(frozen=True)
class Study:
    """A config group whose options are the rows of a paper table."""

    name: str
    table: str  # the name of its paper table (`table8`, `cait`)
    baseline: str  # the row the others are compared with
    default: str | None  # the row a run has when none is named (None: no row)
    rows: tuple[str, ...]  # its options, in the paper table's order, then the others by name


def _numbers_files(conf_dir: Path) -> list[Path]:
    return sorted(p for p in conf_dir.glob(f"*/{NUMBERS}") if p.is_file())


def paper_tables(conf_dir: Path = CONF_DIR) -> dict[str, dict[str, Any]]:
    """Every paper table of every numbers file, by name, each with its `rows_key` (the folder's name unless set)
    and its `group` (the folder)."""
    tables: dict[str, dict[str, Any]] = {}
    for path in _numbers_files(conf_dir):
        try:
            numbers = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        for name, raw in numbers.items():
            if name in tables:
                raise ValueError(f"{path}: paper table {name!r} is already in {tables[name]['group']}/{NUMBERS}")
            tables[name] = {"rows_key": path.parent.name, **raw, "group": path.parent.name}
    return tables


def default_tables(conf_dir: Path = CONF_DIR) -> dict[str, str]:
    """The paper table for each row grouping (`ablation` -> table8): the first table of a numbers file with it."""
    out: dict[str, str] = {}
    for name, table in paper_tables(conf_dir).items():
        out.setdefault(table["rows_key"], name)
    return out


def studies(conf_dir: Path = CONF_DIR) -> list[Study]:
    """The studies: folders with a numbers file whose table's rows are the folder's options; those with a default
    row first (Table 8), then by name."""
    found = []
    for name, table in paper_tables(conf_dir).items():
        group = table["group"]
        if table["rows_key"] != group or any(s.name == group for s in found):
            continue
        options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        ordered = [r["key"] for r in table["rows"] if r["key"] in options]
        found.append(Study(name=group, table=name, baseline=str(table["baseline"]), default=table.get("default"),
                           rows=tuple(ordered + [o for o in options if o not in ordered])))
    return sorted(found, key=lambda s: (s.default is None, s.name))


def study_names(conf_dir: Path = CONF_DIR) -> tuple[str, ...]:
    """The names of the studies (their config groups), Table 8's `ablation` first."""
    return tuple(s.name for s in studies(conf_dir))


def defaults_list(conf_dir: Path = CONF_DIR) -> list[dict[str, str | None]]:
    """The Hydra defaults list of the `studies` node: each study's group with its default row (or none)."""
    return [{s.name: s.default} for s in studies(conf_dir)]


def _defaults(path: Path) -> list[Any]:
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("defaults", [])


def preset_choices(conf_dir: Path = CONF_DIR) -> dict[str, dict[str, str]]:
    """The group options each preset sets (`{"demo": {"model": "vit_demo", "data": "builtin"}}`)."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted((conf_dir / "preset").glob("*.yaml")):
        items = [item for item in _defaults(path) if isinstance(item, dict)]
        out[path.stem] = {k.split("/")[-1]: str(v) for item in items for k, v in item.items()
                          if k.startswith("override")}
    return out


def default_choices(conf_dir: Path = CONF_DIR) -> dict[str, str]:
    """The recipe's default group options: conf/config.yaml's defaults and the studies' default rows, but for the
    schema, Hydra's groups, interpolated options and the groups each preset sets (`preset_choices`)."""
    by_preset = {g for choices in preset_choices(conf_dir).values() for g in choices}
    out: dict[str, str] = {}
    for item in _defaults(conf_dir / "config.yaml") + defaults_list(conf_dir):
        if not isinstance(item, dict):
            continue
        for group, option in item.items():
            if group.startswith("override") or option is None or "${" in str(option):
                continue
            if group not in by_preset and group not in NOT_DEFAULT_OPTIONS:
                out[group] = str(option)
    return out
