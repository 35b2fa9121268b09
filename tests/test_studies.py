"""Studies are data: the registry reads them from the config folders, and a study added the way a user adds one
(a folder of row files and a numbers file, nothing else edited) is swept, tagged and tabled."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from deit_ablate.analysis.aggregate import cli
from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.analysis.aggregate.settings import DEFAULT_CHOICES, PRESET_CHOICES
from deit_ablate.config import studies
from deit_ablate.config.compose import register_configs
from deit_ablate.record.rundir import runs_root, wandb_root
from deit_ablate.record.tracking import run_tags
from tests.conftest import CONF, TINY, compose_config, identity_of, run_train

STUDY = "zz_throwaway_study"  # a name no real study has; its folder lives only while a test uses it
NUMBERS = {
    "throwaway": {
        "title": "A throwaway study: label smoothing off and doubled",
        "citation": "nobody (2026), a test",
        "model": "the demo ViT",
        "baseline": "smooth0",
        "default": None,
        "columns": {"pretrain": "32"},
        "rows": [
            {"key": "smooth0", "label": "no label smoothing", "pretrain": 70.0},
            {"key": "smooth2", "label": "label smoothing 0.2", "pretrain": 71.5, "note": "made up"},
        ],
    }
}
ROWS = {"smooth0": "0.0", "smooth2": "0.2"}


@pytest.fixture
def throwaway_study() -> Iterator[Path]:
    """The study's folder in conf/, as a user adds it: two row files and a numbers file; removed afterwards."""
    folder = CONF / STUDY
    shutil.rmtree(folder, ignore_errors=True)  # a leftover of an interrupted test
    folder.mkdir()
    try:
        for row, smoothing in ROWS.items():
            (folder / f"{row}.yaml").write_text(f"# @package _global_\nmix:\n  label_smoothing: {smoothing}\n")
        (folder / "numbers.json").write_text(json.dumps(NUMBERS, indent=2))
        register_configs()  # what train.py does at its start: the `studies` defaults node now has the new group
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        register_configs()


def test_the_registry_finds_the_studies_in_the_config_folders():
    assert studies.study_names() == ("ablation", "cait", "deit3", "headline", "sam", "teachers", "transfer")
    table8, cait, deit3, headline, sam, teacher, transfer = studies.studies()
    for study in studies.studies():  # its rows are its options, however many
        assert sorted(study.rows) == sorted(p.stem for p in (CONF / study.name).glob("*.yaml"))
    assert (table8.table, table8.baseline, table8.default) == ("table8", "baseline", "baseline")
    assert table8.rows[:2] == ("baseline", "sgd")  # the paper table's order
    assert (cait.table, cait.baseline, cait.default) == ("cait", "depth12", None)
    assert (sam.table, sam.baseline, sam.default) == ("sam", "baseline", None)
    assert (deit3.table, deit3.baseline, deit3.default) == ("deit3", "baseline", None)
    assert (transfer.table, transfer.default, transfer.rows[:2]) == ("table7", None, ("cifar10", "cifar100"))
    assert (headline.table, headline.baseline, headline.default) == ("table5", "deit_b", None)
    assert (teacher.table, teacher.baseline, teacher.default) == ("table2", "regnety_16gf", None)
    assert studies.defaults_list() == [{"ablation": "baseline"}, {"cait": None}, {"deit3": None},
                                       {"headline": None}, {"sam": None}, {"teachers": None}, {"transfer": None}]
    assert studies.default_tables() == {"ablation": "table8", "cait": "cait", "deit3": "deit3", "headline": "table5",
                                        "sam": "sam", "teachers": "table2", "transfer": "table7",
                                        "distill.type": "table3", "resolution.train_size": "table10"}
    # Tables 3 and 10 are paper tables of groups that are not studies (their rows are a config key)
    assert set(studies.paper_tables()) == {"table8", "cait", "deit3", "sam", "table2", "table3", "table3_tiny",
                                           "table10", "table7", "table5"}


def test_the_preset_defaults_come_from_the_config_files():
    assert DEFAULT_CHOICES == {"preset": "demo", "ablation": "baseline", "distill": "none", "mix": "mixup_cutmix",
                               "augment": "randaugment", "optimizer": "adamw", "recipe": "deit",
                               "transfer_recipe": "deit", "layout": "paper"}
    assert PRESET_CHOICES == {"demo": {"model": "vit_demo", "data": "builtin"},
                              "paper": {"model": "deit_base", "data": "imagenet"}}


def test_tags_name_table_8_bare_and_other_studies_by_group():
    assert run_tags({"ablation": "no_mixup"}, "pretrain", "demo") == ["no_mixup", "pretrain", "demo"]
    assert run_tags({"ablation": "baseline", "cait": "depth24"}, "pretrain", "paper") == [
        "baseline", "pretrain", "paper", "cait=depth24"]


def test_a_new_study_is_a_group_with_no_row_by_default(throwaway_study):
    assert studies.study_names() == ("ablation", "cait", "deit3", "headline", "sam", "teachers", "transfer", STUDY)
    assert compose_config([f"{STUDY}=smooth2"]).mix.label_smoothing == 0.2
    assert compose_config([]).mix.label_smoothing == 0.1  # no row unless one is named
    long = TINY + ["train.max_steps=1", "seed=1", f"{STUDY}=smooth0"]  # too long for a folder name: cut
    assert identity_of(long).name.startswith(f"{STUDY}=smooth0,seed=1,")  # the row kept in front
    assert identity_of([]).run_id == identity_of(["ablation=baseline"]).run_id  # Table 8's runs keep their ids


def _table(wandb_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert cli.main([str(wandb_dir), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_new_study_is_swept_tagged_and_tabled(throwaway_study, tmp_path, data_cache, capsys):
    run_train(["-m", f"{STUDY}=glob(*)"] + TINY + ["train.max_steps=1"], tmp_path, data_cache)
    folders = sorted(p.name for p in (runs_root(tmp_path / "outputs")).iterdir() if p.is_dir())
    assert [name.split(",")[0] for name in folders] == [f"{STUDY}={row}" for row in ROWS]  # one run per row
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert len(runs) == 2
    for run in runs:
        row = run.config["choices"][STUDY]
        assert f"{STUDY}={row}" in run.tags and "baseline" in run.tags  # Table 8's row, as every run has it
        assert run.config["ablation"] == "baseline" and run.config["mix"]["label_smoothing"] == float(ROWS[row])
    data = _table(wandb_root(tmp_path / "outputs"), capsys)
    assert data["rows_key"] == STUDY and [r["key"] for r in data["rows"]] == list(ROWS)
    cells = {r["key"]: r["cells"]["pretrain"] for r in data["rows"]}
    assert (cells["smooth0"]["paper"], cells["smooth2"]["paper"]) == (70.0, 71.5)
    assert all(cell["n"] == 1 for cell in cells.values())
