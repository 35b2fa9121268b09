"""Names that say what trained: the start line and result.json give the architecture the run built, shortened
folder names keep the seed and the study row, and every sweep keeps its own record of what it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import yaml
from omegaconf import OmegaConf

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.config.schema import Config
from deit_ablate.config.studies import study_names
from deit_ablate.record.identity import _UNSAFE, _is_identity_override, _readable
from deit_ablate.record.rundir import RunDir, runs_root, wandb_root
from deit_ablate.train.models import architecture, build_model, describe_architecture
from tests.conftest import TINY, compose_config, identity_of, run_train

# TINY's overrides alone are longer than a folder name keeps.
LONG = TINY + ["train.max_steps=1"]


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_start_line_and_the_result_name_the_architecture_that_trained(tmp_path, data_cache):
    args = LONG + ["model.kwargs.patch_size=4"]
    proc = run_train(args, tmp_path, data_cache)
    cfg = compose_config(args)
    model = build_model(cfg.model, 10, 32)
    millions = f"{_params(model) / 1e6:.2f} M params"
    assert f"of deit_tiny_patch16_224 (patch 4, width 32, depth 1, heads 2, {millions})" in proc.stdout
    (run,) = (runs_root(tmp_path / "outputs")).iterdir()
    result = json.loads(RunDir(run).result.read_text())
    expected = {"name": "deit_tiny_patch16_224", "patch_size": 4, "width": 32, "depth": 1, "heads": 2,
                "params": _params(model)}
    assert result["architecture"] == expected
    (logged,) = read_offline(wandb_root(tmp_path / "outputs"))
    assert logged.summary["architecture"] == expected


@pytest.mark.parametrize(("overrides", "text"), [
    (["cait=ca_12_2"], "patch 8, width 128, depth 4 + 1 class-attention, heads 4"),
    (["cait=cait_s36"], "patch 8, width 128, depth 12 + 2 class-attention, heads 8"),
    (["cait=talking_heads"], "patch 8, width 128, depth 4, heads 4"),
    (["distill=hard_token"], "patch 8, width 128, depth 6, heads 4"),
])
def test_vits_and_cait_are_described_from_the_built_model(overrides, text):
    from deit_ablate.run.student import student_model_name

    cfg = compose_config(overrides)
    name = student_model_name(cfg.model, cfg.distill)
    model = build_model(cfg.model, 10, 32, name=name)
    arch = architecture(model, name)
    assert describe_architecture(arch) == f"{name} ({text}, {_params(model) / 1e6:.2f} M params)"
    assert arch["params"] == _params(model)


def test_a_cnn_is_described_by_its_parameters():
    model = timm.create_model("resnet10t", num_classes=10)
    arch = architecture(model, "resnet10t")
    assert arch == {"name": "resnet10t", "params": _params(model)}
    assert describe_architecture(arch) == f"resnet10t ({_params(model) / 1e6:.2f} M params)"


def _identity(overrides: list[str]):
    return identity_of(overrides)


def test_shortened_names_keep_the_seed_and_the_study_row():
    for row in ("ablation=no_mixup", "cait=ca_12_2"):
        name = _identity(LONG + ["seed=3", row]).name
        assert name.startswith(f"{row},seed=3,") and "~-" in name, name
        assert len(name) <= 100 + 12
    short = _identity(["seed=3", "ablation=no_mixup"]).name  # short names are unchanged
    assert short.startswith("ablation=no_mixup,seed=3-")


def _old_style_name(overrides: list[str], digest: str) -> str:
    """A folder name as the code before this change made it: sorted overrides cut at 100 characters."""
    text = _UNSAFE.sub("_", ",".join(sorted(_readable(o) for o in overrides if _is_identity_override(o))))
    return f"{text[:100]}~-{digest}"


@pytest.mark.slow
def test_an_old_style_long_folder_is_found_and_resumed(tmp_path, data_cache):
    args = LONG + ["seed=3"]
    run_train(args, tmp_path, data_cache)
    runs = runs_root(tmp_path / "outputs")
    (new,) = runs.iterdir()
    assert new.name.startswith("seed=3,")
    old = new.rename(runs / _old_style_name(args, new.name.rsplit("-", 1)[1]))
    assert "seed=3" not in old.name  # the old scheme had cut it off
    RunDir(old).result.unlink()  # stopped before it wrote its result
    proc = run_train(args, tmp_path, data_cache)
    assert "resuming" in proc.stdout and old.name in proc.stdout
    assert [p.name for p in runs.iterdir()] == [old.name]
    assert json.loads(RunDir(old).result.read_text())["status"] == "finished"


def _records(runs: Path) -> list[Path]:
    return sorted(runs.glob("multirun-*.yaml"))


@pytest.mark.slow
def test_two_sweeps_leave_two_multirun_records(tmp_path, data_cache):
    runs = runs_root(tmp_path / "outputs")
    for seed in (5, 6):
        run_train(["-m", f"seed={seed}"] + LONG, tmp_path, data_cache)
    records = _records(runs)
    assert len(records) == 2
    swept = [yaml.safe_load(path.read_text())["hydra"]["overrides"]["task"] for path in records]
    assert {next(o for o in task if o.startswith("seed=")) for task in swept} == {"seed=5", "seed=6"}
    assert yaml.safe_load((runs / "multirun.yaml").read_text())["hydra"]["overrides"]["task"] in swept  # Hydra's
    run_train(["-m", "seed=7", "runtime.dry_run=true"] + LONG, tmp_path, data_cache)
    assert _records(runs) == records  # a dry run ran nothing and records nothing
    folders = [p for p in runs.iterdir() if p.is_dir()]
    assert len(folders) == 2 and all(RunDir(p).result.exists() for p in folders)  # the run folders as before


def test_no_study_is_named_like_the_label_of_a_path_override():
    """A path override shows in a folder name by its last key (`teacher=` for distill.teacher.checkpoint), and a
    long name puts the study rows first: a study of that name would take the path's place there (and read alike)."""
    def leaves(node, prefix=""):
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            yield from leaves(value, dotted + ".") if OmegaConf.is_dict(value) else [dotted]

    labels = {_readable(f"{key}=/some/path").split("=", 1)[0] for key in leaves(OmegaConf.structured(Config))}
    assert "teacher" in labels  # distill.teacher.checkpoint
    assert not labels & set(study_names())
