"""A row added to an existing study breaks nothing but its own expectations: in a copy of conf/ with one more row in a
study (its row file and its line in numbers.json, as a contributor adds one), the suite's study checks hold, and every
row the study had keeps its run's identity. Every study is checked on a sample of its rows; the slow test takes them
all."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from deit_ablate.config.studies import NUMBERS, paper_tables, studies
from tests.conftest import CONF, identity_of, study_rows
from tests.test_ablation import _flat
from tests.test_unread_settings import computes_the_same

NEW = "zz_added_row"
INGREDIENT = {"mix.label_smoothing": 0.05}  # read by every stage of every recipe
STUDIES = [s.name for s in studies()]


def _base(study: str) -> str:
    """The row the new row extends: the study's baseline, or its first row where it has none (Table 7)."""
    found = next(s for s in studies() if s.name == study)
    return found.baseline if found.baseline in found.rows else found.rows[0]


@cache
def _conf_with_a_row(study: str, root: Path) -> Path:
    """A copy of conf/ under `root` in which `study` has one more row: its file and its line in numbers.json."""
    conf = root / study / "conf"
    shutil.copytree(CONF, conf)
    base = _base(study)
    (conf / study / f"{NEW}.yaml").write_text(f"# @package _global_\ndefaults:\n  - {base}\n  - _self_\nmix:\n"
                                              f"  label_smoothing: {INGREDIENT['mix.label_smoothing']}\n")
    numbers_file = conf / study / NUMBERS
    numbers = json.loads(numbers_file.read_text())
    table = next(t for t in numbers.values() if any(r["key"] == base for r in t["rows"]))
    table["rows"].append({"key": NEW, "label": "label smoothing 0.05", "pretrain": None, "baseline": base,
                          "note": "a row added by a test"})
    numbers_file.write_text(json.dumps(numbers, indent=1))
    return conf


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("studies")


def _rows_kept(study: str, conf: Path, rows: tuple[str, ...]) -> dict[str, tuple]:
    """`{row: (identity in the copy, identity in conf/)}` for each of `rows` whose run moved (at both presets)."""
    moved = {}
    for row in rows:
        for preset in ("demo", "paper"):
            overrides = [f"preset={preset}", f"{study}={row}"]
            ours, theirs = identity_of(overrides, conf), identity_of(overrides, CONF)
            if (ours.name, ours.run_id, ours.group) != (theirs.name, theirs.run_id, theirs.group):
                moved[f"{row} at {preset}"] = (ours.name, theirs.name)
    return moved


@pytest.mark.parametrize("study", STUDIES)
def test_a_row_added_to_a_study_is_found_and_computes_its_own_run(study, copies):
    conf = _conf_with_a_row(study, copies)
    original = study_rows(study)
    assert study_rows(study, conf) == (*original, NEW)  # the registry: the table's order, the new row last
    added = next(s for s in studies(conf) if s.name == study)
    assert (added.default, added.baseline) == next((s.default, s.baseline) for s in studies() if s.name == study)
    assert paper_tables(conf)[added.table]["rows"][-1]["key"] == NEW
    # the new row differs from the row it extends in its ingredient alone, at both scales
    for preset in ("demo", "paper"):
        row, base = ([f"preset={preset}", f"{study}={name}"] for name in (NEW, _base(study)))
        ours, theirs = _flat(_compose(conf, row)), _flat(_compose(conf, base))
        assert {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)} == set(INGREDIENT)
        assert computes_the_same(row, base, conf) is None  # the study check: it computes something else
    new = identity_of([f"{study}={NEW}"], conf)
    assert new.name.startswith(f"{study}={NEW}") and new.run_id != identity_of([f"{study}={_base(study)}"], conf).run_id
    # the rows it had keep their runs: its baseline and its last row here, every row in the slow test
    assert _rows_kept(study, conf, tuple(dict.fromkeys((_base(study), original[-1])))) == {}


@pytest.mark.slow  # every row of every study composed at both presets, in the copy and in conf/: about a minute
@pytest.mark.parametrize("study", STUDIES)
def test_every_row_a_study_had_keeps_its_run_when_a_row_is_added(study, copies):
    conf = _conf_with_a_row(study, copies)
    assert _rows_kept(study, conf, study_rows(study)) == {}


def _compose(conf: Path, overrides: list[str]):
    """The config `python train.py <overrides>` runs with the config folder `conf`."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("config", overrides=overrides)
