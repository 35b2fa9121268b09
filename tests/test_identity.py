"""A run is its experiment: runtime settings never change it, experiment settings (typed or in a YAML file) and
the data's content always do; a dry run tells what a sweep would do; bad keys and values fail at composition."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deit_ablate.record.rundir import IDENTITY, LAST, RESULT, RunDir, runs_root, wandb_root
from tests.conftest import CONF, REPO, TINY, compose_config, identity_of, run_train

RUNTIME_CHANGES = ["runtime.cpu_threads=1", "runtime.num_workers=2", "runtime.worker_nice=5", "runtime.compile=true",
                   "runtime.log_interval=3", "runtime.checkpoint_every_steps=7", "runtime.checkpoint_every_minutes=1",
                   "runtime.max_batch_per_device=8", "runtime.eval_batch=7", "runtime.device=cpu",
                   "runtime.tracking.mode=disabled", "runtime.tracking.project=other", "runtime.output_root=elsewhere",
                   "runtime.dry_run=true"]
EXPERIMENT_CHANGES = ["model=deit_small", "data=imagefolder", "data.num_classes=7", "augment=autoaugment", "mix=none",
                      "distill=soft", "optimizer=sgd", "optimizer.weight_decay=0.1", "resolution=24px",
                      "ablation=no_mixup", "preset=paper", "seed=1", "stage=finetune", "train.epochs=3",
                      "data.builtin.seed=1", "train.micro_batch=16"]


def _identity(overrides: list[str], conf: Path = CONF):
    return identity_of(overrides, conf)


@pytest.mark.parametrize("change", RUNTIME_CHANGES)
def test_a_runtime_setting_never_changes_the_identity(change):
    base = _identity(["ablation=no_mixup"])
    other = _identity(["ablation=no_mixup", change])
    assert (other.name, other.run_id, other.digest, other.group) == (base.name, base.run_id, base.digest, base.group)


@pytest.mark.parametrize("change", EXPERIMENT_CHANGES)
def test_each_experiment_setting_makes_another_run(change):
    base, other = _identity([]), _identity([change])
    assert other.digest != base.digest and other.run_id != base.run_id and other.name != base.name


def test_restating_a_default_is_the_same_experiment_and_the_same_wandb_run():
    assert _identity(["ablation=baseline"]).run_id == _identity([]).run_id


def test_an_edited_yaml_value_makes_another_run(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    adamw = conf / "optimizer" / "adamw.yaml"
    adamw.write_text(adamw.read_text() + "weight_decay: 0.1\n")
    assert _identity([], conf).digest != _identity([]).digest


def test_seeds_of_one_setting_share_a_group_and_nothing_else():
    one, two = _identity(["seed=1"]), _identity(["seed=2"])
    assert one.group == two.group and one.run_id != two.run_id
    assert _identity(["seed=1", "mix=none"]).group != one.group


def test_long_paths_are_shortened_in_the_folder_name_and_stay_visible():
    teacher = "distill.teacher.checkpoint='/some/long/path/runs/model=cnn_demo-ab12'"
    identity = _identity(["distill=hard_token", teacher])
    assert "distill=hard_token" in identity.name and "teacher=model=cnn_demo-ab12@" in identity.name
    assert "/" not in identity.name


def _launch(args: list[str], cwd: Path, cache: Path) -> subprocess.Popen:
    env = {"DEIT_ABLATE_CACHE": str(cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    import os

    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_relaunch_with_other_runtime_settings_resumes_the_same_run(tmp_path, data_cache, tiny_data):
    args = TINY + ["train.epochs=3", "runtime.checkpoint_every_steps=1"]  # tiny_data: drawn before the clock starts
    proc = _launch(args, tmp_path, data_cache)
    runs = runs_root(tmp_path / "outputs")
    deadline = time.monotonic() + 300
    while not list(runs.glob(f"*/{LAST}")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # killed a step or two into a 24-step run
    proc.wait()
    (first,) = runs.iterdir()
    relaunched = run_train(args + ["runtime.cpu_threads=1", "runtime.checkpoint_every_steps=0",
                                   "runtime.log_interval=3", "runtime.num_workers=1"], tmp_path, data_cache)
    assert "resuming" in relaunched.stdout
    assert [p.name for p in runs.iterdir()] == [first.name]
    result = json.loads(RunDir(first).result.read_text())
    assert result["status"] == "finished" and result["steps_done"] == 24
    wandb_ids = {p.name.rsplit("-", 1)[-1] for p in (wandb_root(tmp_path / "outputs")).glob("offline-run-*")}
    assert wandb_ids == {result["run_id"]}


def _imagefolder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


@pytest.mark.slow
def test_the_data_counts_by_content_not_by_path(tmp_path, data_cache, tiny_data):
    tree = _imagefolder(tiny_data, tmp_path / "mount_a" / "shapes")  # TINY's built-in set
    args = TINY + ["data=imagefolder", "data.num_classes=10"]
    run_train(args + [f"data.root={tree}"], tmp_path, data_cache)
    moved = tree.rename(tmp_path / "mount_b")  # the same tree on another mount: the same run, already finished
    proc = run_train(args + [f"data.root={moved}"], tmp_path, data_cache)
    assert "already finished" in proc.stdout
    other = _imagefolder(moved, tmp_path / "other")
    next((other / "train").iterdir()).joinpath("extra.png").write_bytes(
        next(next((other / "train").iterdir()).iterdir()).read_bytes())
    proc = run_train(args + [f"data.root={other}"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "other data" in proc.stderr and "already finished" not in proc.stdout
    assert "runtime.output_root" in proc.stderr  # the fix is named
    identity = json.loads(next((runs_root(tmp_path / "outputs")).glob(f"*/{IDENTITY}")).read_text())
    result = json.loads(next((runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}")).read_text())
    assert identity["data_fingerprint"]["images"]["train"] == 300 and result["data_fingerprint"] == identity[
        "data_fingerprint"]  # one name for the data's fingerprint in both files
    run_train(args + [f"data.root={other}", "runtime.output_root=elsewhere"], tmp_path, data_cache)
    elsewhere = json.loads(next((tmp_path / "elsewhere" / "runs").glob(f"*/{RESULT}")).read_text())
    assert elsewhere["run_id"] != result["run_id"]  # two datasets never write to one wandb run


def _plan(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(line.split("): ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[dry run]"))


@pytest.mark.slow
def test_dry_run_plans_what_the_sweep_then_does(tmp_path, data_cache):
    sweep = ["-m", "ablation=baseline,no_mixup", "stage=pretrain,finetune", "finetune.lr=1e-3", "finetune.epochs=1",
             "train.max_steps=2"] + TINY
    plan = _plan(run_train(sweep + ["runtime.dry_run=true"], tmp_path, data_cache))
    assert plan[:2] == ["train from step 0", "train from step 0"]
    assert all(line.startswith("wait for its pre-training ablation=") for line in plan[2:]) and len(plan) == 4
    assert not (tmp_path / "outputs").exists()  # nothing trained, kept or written
    done = run_train(sweep, tmp_path, data_cache)
    assert done.stdout.count("fine-tuning from") == 2  # each fine-tune found its pre-training despite finetune.*
    assert _plan(run_train(sweep + ["runtime.dry_run=true"], tmp_path, data_cache)) == ["skip (already finished)"] * 4


@pytest.mark.parametrize(("args", "message"), [
    (["+mix.mixup_alpah=1"], "mix.mixup_alpah is not a setting"),
    (["distill.fusion=probb"], "expected one of [prob, logit]"),
    (["augment.remode=pixl"], "expected one of [pixel, rand, const]"),
    (["resolution=384"], "Did you mean resolution=384px?"),
])
def test_bad_keys_and_values_are_refused_before_anything_runs(tmp_path, data_cache, args, message):
    proc = run_train(TINY + args, tmp_path, data_cache, check=False)
    assert proc.returncode != 0 and message in proc.stderr
    assert not list(tmp_path.glob("outputs/runs/*")) and not list(tmp_path.glob("outputs/wandb/*"))


def test_a_typo_added_with_plus_names_the_close_key():
    from deit_ablate.core.errors import ConfigError
    from deit_ablate.run.validate import check_known_keys

    with pytest.raises(ConfigError, match="Did you mean mix.mixup_alpha"):
        check_known_keys(compose_config(["+mix.mixup_alpah=1"]))
    check_known_keys(compose_config(["+model.kwargs.qkv_bias=false"]))  # timm arguments are free-form


# A teacher named for a whole sweep (`-m ablation=baseline,no_mixup distill.teacher.checkpoint=/x/t.pt`) reaches
# rows that do not distil too: there it is no part of the experiment.
SWEEP_TEACHERS = ["distill.teacher.checkpoint=/x/t.pt", "distill.teacher.model=resnet50",
                  "++distill.teacher.kwargs.channels=[8,16,32,64]", "distill.teacher.chain=cnn_demo"]


@pytest.mark.parametrize("teacher", SWEEP_TEACHERS)
@pytest.mark.parametrize("row", [[], ["ablation=no_mixup"], ["preset=paper", "cait=ca_12_2"]])
def test_a_row_that_does_not_distil_carries_no_teacher(row, teacher):
    base, other = _identity(row), _identity([*row, teacher])
    assert (other.name, other.run_id, other.digest, other.group) == (base.name, base.run_id, base.digest, base.group)


@pytest.mark.parametrize("teacher", SWEEP_TEACHERS[:3])
def test_a_distilled_row_keeps_the_teacher_it_is_given(teacher):
    base, other = _identity(["distill=hard_token"]), _identity(["distill=hard_token", teacher])
    assert other.digest != base.digest and other.name != base.name
