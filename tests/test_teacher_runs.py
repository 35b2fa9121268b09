"""A student and the teacher it distils from: an unfinished teacher run is refused (or used, with a warning, when
allowed), the weights it used are recorded, and a student whose teacher's weights changed is never skipped as if it
were the same experiment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import timm
import torch

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.checkpoint import read_weights
from deit_ablate.record.identity import with_teacher
from deit_ablate.record.rundir import RunDir, runs_root, wandb_root
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.teacher import run_teacher, teacher_identity, weights_digest
from tests.conftest import TINY, SharedRun, compose_config, identity_of, run_train

DATA = [item for item in TINY if not item.startswith(("model.", "train.epochs="))]
STUDENT = ["model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2", "distill=hard_token",
           "train.epochs=1", "train.max_steps=1"]


def _copy_teacher(cwd: Path, teacher_run: SharedRun) -> Path:
    """A copy under `cwd` of the shared demo CNN teacher run (8 steps, 1 of its 2 epochs); its folder."""
    teacher_run.copy_into(cwd)
    return runs_root(cwd / "outputs") / teacher_run.run_dir("model=cnn_demo").name


def _student(teacher: Path | str, *extra: str) -> list[str]:
    return STUDENT + DATA + [f"distill.teacher.checkpoint='{teacher}'", *extra]


def _students(cwd: Path, teacher: Path, root: str = "outputs") -> list[Path]:
    return [p for p in (runs_root(cwd / root)).iterdir() if p.is_dir() and p != teacher]


@pytest.mark.slow
def test_an_unfinished_teacher_run_is_refused_before_anything_starts(tmp_path, data_cache, teacher_run):
    teacher = _copy_teacher(tmp_path, teacher_run)
    RunDir(teacher).result.unlink()  # killed after 1 of its 2 epochs
    proc = run_train(_student(teacher), tmp_path, data_cache, check=False)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr
    assert teacher.name in message and "has not finished" in message and "1 of 2 epochs" in message
    assert "python train.py" in message and "model=cnn_demo" in message  # its command, to finish it
    assert "distill.teacher.allow_unfinished=true" in message
    assert "Traceback" not in message
    assert not _students(tmp_path, teacher)  # nothing written for the student
    assert len(list((wandb_root(tmp_path / "outputs")).glob("offline-run-*"))) == 1  # the teacher's own

    proc = run_train(_student(teacher, "distill.teacher.allow_unfinished=true"), tmp_path, data_cache)
    assert "has not finished" in proc.stderr and "latest checkpoint" in proc.stderr  # used, with a warning
    (student,) = _students(tmp_path, teacher)
    result = json.loads(RunDir(student).result.read_text())
    assert result["status"] == "finished" and result["teacher"]["run"] == teacher.name
    assert "unfinished" in result["teacher"]["status"]
    assert "has not finished" in RunDir(student).log.read_text()

    RunDir(teacher).result.write_text(json.dumps({"status": "diverged", "run_id": "x"}))
    proc = run_train(_student(teacher), tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "ended as diverged" in proc.stderr and teacher.name in proc.stderr


@pytest.mark.slow
def test_a_student_records_its_teacher_and_is_refused_when_the_teacher_changes(tmp_path, data_cache, teacher_run):
    teacher = _copy_teacher(tmp_path, teacher_run)
    weights = RunDir(teacher).best_checkpoint
    digest = weights_digest(read_weights(weights))
    proc = run_train(_student(teacher), tmp_path, data_cache)
    (student,) = _students(tmp_path, teacher)
    result = json.loads(RunDir(student).result.read_text())
    teacher_result = json.loads(RunDir(teacher).result.read_text())
    assert result["teacher"]["run"] == teacher.name and result["teacher"]["run_id"] == teacher_result["run_id"]
    assert result["teacher"]["checkpoint"] == str(weights.resolve()) and result["teacher"]["digest"] == digest
    assert result["teacher"]["status"] == "finished"
    assert json.loads(RunDir(student).identity.read_text())["teacher"]["digest"] == digest
    assert f"distilling from the teacher run {teacher.name}" in proc.stdout and digest[:12] in proc.stdout
    assert digest[:12] in RunDir(student).log.read_text()
    (logged,) = [r for r in read_offline(wandb_root(tmp_path / "outputs")) if r.run_id == result["run_id"]]
    assert logged.summary["teacher"]["digest"] == digest

    assert "already finished" in run_train(_student(teacher), tmp_path, data_cache).stdout
    os.utime(weights)  # touched, same weights: still the same experiment
    assert "already finished" in run_train(_student(teacher), tmp_path, data_cache).stdout

    state = torch.load(weights, weights_only=True)  # the teacher trained on: other weights in the same file
    state["model"] = {k: v + 1 if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, weights)
    proc = run_train(_student(teacher), tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "already finished" not in proc.stdout
    assert "other teacher weights" in proc.stderr and str(student) in proc.stderr
    assert "runtime.output_root" in proc.stderr  # the fix is named
    assert json.loads(RunDir(student).result.read_text()) == result  # the old student is left as it was

    run_train(_student(teacher, "runtime.output_root=elsewhere"), tmp_path, data_cache)
    (other,) = _students(tmp_path, teacher, "elsewhere")
    assert other.name == student.name  # the same settings...
    assert json.loads(RunDir(other).result.read_text())["run_id"] != result["run_id"]  # ...another wandb run


def _file_teacher(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    torch.save({"model": timm.create_model("resnet10t", num_classes=10).state_dict()}, path)
    return path


def test_a_replaced_teacher_file_is_another_teacher(tmp_path):
    path = _file_teacher(tmp_path / "teacher.pt", 0)
    overrides = STUDENT + [f"distill.teacher.checkpoint={path}", f"runtime.output_root={tmp_path}"]
    cfg = compose_config(overrides)
    run_dir = RunDir(tmp_path / "student")
    run_dir.path.mkdir()
    source = run_teacher(Lineage.of(cfg, ()), cfg.distill.teacher)
    first = teacher_identity(source, run_dir)
    assert first["run"] is None and first["checkpoint"] == str(path.resolve())
    assert first["digest"] == weights_digest(read_weights(path))
    run_dir.write_identity({"digest": "d", "teacher": first})
    assert teacher_identity(source, run_dir)["digest"] == first["digest"]
    _file_teacher(path, 1)  # replaced by another teacher's weights
    with pytest.raises(ConfigError, match="other teacher weights"):
        teacher_identity(run_teacher(Lineage.of(cfg, ()), cfg.distill.teacher), run_dir)


def test_the_weights_digest_is_of_the_weights_not_of_the_file(tmp_path):
    state = timm.create_model("resnet10t", num_classes=10).state_dict()
    torch.save({"model": state}, tmp_path / "a.pt")
    torch.save(dict(reversed(list(state.items()))), tmp_path / "b.pt")
    assert weights_digest(read_weights(tmp_path / "a.pt")) == weights_digest(read_weights(tmp_path / "b.pt"))
    changed = {**state, "fc.bias": state["fc.bias"] + 1e-6}
    assert weights_digest(changed) != weights_digest(state)


def test_the_teacher_changes_the_wandb_id_of_distilled_runs_only():
    plain = identity_of(["seed=1"])
    assert with_teacher(plain, None) == plain
    teacher = {"run": None, "checkpoint": "/t.pt", "digest": "a" * 40}
    one = with_teacher(plain, teacher)
    two = with_teacher(plain, {**teacher, "digest": "b" * 40})
    assert one.name == plain.name and one.digest == plain.digest and one.run_id != plain.run_id != two.run_id
    assert one.teacher == teacher
    # a run folder started before teachers were recorded keeps the wandb id it has
    legacy = with_teacher(plain, teacher, recorded={"run_id": plain.run_id, "digest": plain.digest})
    assert legacy.run_id == plain.run_id


# The names and wandb ids of demo runs, as recording teachers left them; refreshed once when the demo preset got its
# micro-batch (train.micro_batch=32: 4 virtual slots, another computation than the old per-device batch of 128).
BEFORE = [
    ([], "default-a2b61b3503", "f879d56f5df9afcc"),
    (["seed=1", "ablation=sgd"], "ablation=sgd,seed=1-35aaa90bc5", "0d1bceca7c10deaf"),
    (["cait=ca_12_2", "seed=2"], "cait=ca_12_2,seed=2-7ab33794f0", "a258b0c18f1e58c6"),
    (["model=cnn_demo"], "model=cnn_demo-7c8ade5316", "47d11906db1ec915"),
    (["distill=hard_token", "distill.teacher.checkpoint=/x/y.pt"], "distill=hard_token,teacher=y.pt@eb54-5a63a4e80d",
     "d6285b51680b3ce0"),
]


@pytest.mark.parametrize(("overrides", "name", "run_id"), BEFORE)
def test_existing_run_names_and_wandb_ids_are_unchanged(overrides, name, run_id):
    identity = identity_of(overrides)
    assert (identity.name, identity.run_id) == (name, run_id)
    allowed = [*overrides, "distill.teacher.allow_unfinished=true"]  # a permission, not the experiment
    assert identity_of(allowed) == identity


def test_allowing_an_unfinished_teacher_never_splits_a_table_cell():
    from deit_ablate.analysis.aggregate.settings import is_execution_key

    assert is_execution_key("distill.teacher.allow_unfinished") and not is_execution_key("distill.teacher.model")
