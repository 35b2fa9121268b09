"""Distillation inside a run: the teacher sees the mixed batch; a CNN teacher -> DeiT student end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

import deit_ablate.run.assemble as assemble_module
from deit_ablate.core.distributed import DistInfo
from deit_ablate.record.rundir import LAST, RESULT, RunDir, runs_root
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.student import student_model_name
from deit_ablate.run.teacher import run_teacher
from deit_ablate.run.teacher_cache import FixedView
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler
from deit_ablate.train.trainer import Trainer
from tests.conftest import TINY, compose_config, run_train, transform_spec

DATA = [item for item in TINY if not item.startswith("model.")]
STUDENT = ["model=vit_demo", "model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"]


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory) -> Path:
    """A resnet10t with 10 classes, saved the way our runs save checkpoints."""
    path = tmp_path_factory.mktemp("teacher") / LAST
    torch.save({"model": timm.create_model("resnet10t", num_classes=10).state_dict()}, path)
    return path


def test_teacher_receives_exactly_the_mixed_batch_the_student_sees(teacher_checkpoint, monkeypatch):
    cfg = compose_config(STUDENT + ["distill=hard_token", f"distill.teacher.checkpoint={teacher_checkpoint}"])
    student = build_model(cfg.model, 10, 32, name=student_model_name(cfg.model, cfg.distill))
    seen = {}
    student.register_forward_pre_hook(lambda module, args: seen.__setitem__("student", args[0].clone()))
    real_forward = assemble_module.teacher_forward

    def recording_forward(teacher, images):
        seen["teacher"] = images.clone()
        assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
        return real_forward(teacher, images)

    monkeypatch.setattr(assemble_module, "teacher_forward", recording_forward)
    loss_fn = assemble_module.build_loss_fn(
        cfg.distill,
        FixedView(transform_spec(cfg), cfg.runtime),
        run_teacher(Lineage.of(cfg, ()), cfg.distill.teacher),
        student,
        SoftTargetCrossEntropy(),
        torch.device("cpu"),
    )
    optimizer = build_optimizer(student, "adamw", 1e-3, 0.05)
    trainer = Trainer(model=student, optimizer=optimizer, loss_fn=loss_fn, info=DistInfo(),
                      scheduler=build_scheduler(optimizer, 10, 0, 1e-5, 1e-6),
                      mixup=Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10))
    images = torch.randn(8, 3, 32, 32)
    original = images.clone()  # timm's Mixup mixes in place
    loss = trainer.train_step(images, torch.randint(0, 10, (8,)))
    assert torch.isfinite(loss)
    assert torch.equal(seen["teacher"], seen["student"])
    assert not torch.equal(seen["teacher"], original)  # Mixup/CutMix had changed the batch first
    assert student.distilled_training  # the student returns (class, distillation) logits in training


def _run_dir(cwd: Path, fragment: str) -> Path:
    return next(p for p in (runs_root(cwd / "outputs")).iterdir() if fragment in p.name)


@pytest.mark.slow
def test_table_3_ladder_from_one_command_trains_the_paper_models(tmp_path, data_cache, teacher_run):
    teacher_run.copy_into(tmp_path)  # a demo CNN teacher, trained once
    teacher = _run_dir(tmp_path, "model=cnn_demo")
    assert RunDir(teacher).best_checkpoint.exists()
    # The README's Table 3 command: no model= named; the token kinds train the distilled twin by themselves.
    sweep = ["-m", "distill=none,soft,hard,hard_token,soft_token", "stage=pretrain,finetune", "train.max_steps=3",
             f"distill.teacher.checkpoint='{teacher}'"]
    proc = run_train(sweep + STUDENT[1:] + DATA, tmp_path, data_cache)
    results = {}
    for path in (runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}"):
        overrides = RunDir(path.parent).hydra_overrides.read_text()
        if "distill=" in overrides:
            kind = overrides.split("distill=")[1].split()[0]
            stage = "finetune" if "stage=finetune" in overrides else "pretrain"
            results[(kind, stage)] = json.loads(path.read_text())
    kinds = ("none", "soft", "hard", "hard_token", "soft_token")
    assert set(results) == {(k, s) for k in kinds for s in ("pretrain", "finetune")}
    for (kind, _), result in results.items():
        assert result["status"] == "finished"
        token = kind.endswith("_token")
        assert result["model_name"] == ("deit_tiny_distilled_patch16_224" if token else "deit_tiny_patch16_224")
        assert ({"top1_cls", "top1_dist", "top1_fused", "top1_fused_alt"} <= set(result)) == token
        if token:
            assert result["top1"] == result["top1_fused"]  # headline: the paper's fusion rule by default
    assert proc.stdout.count("heads     class") == 4


@pytest.mark.slow
def test_distillation_without_a_teacher_checkpoint_fails_before_training(tmp_path, data_cache):
    proc = run_train(STUDENT + DATA + ["distill=hard_token"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "distill.teacher.checkpoint is not set" in proc.stderr
    assert "python train.py model=" in proc.stderr
    proc = run_train(STUDENT + DATA + ["distill=hard_token", f"distill.teacher.checkpoint={tmp_path}/no.pt"],
                     tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "no.pt" in proc.stderr


def test_teacher_with_another_class_count_is_named(tmp_path, data_cache):
    path = tmp_path / "teacher5.pt"
    torch.save({"model": timm.create_model("resnet10t", num_classes=5).state_dict()}, path)
    proc = run_train(STUDENT + DATA + ["distill=hard_token", f"distill.teacher.checkpoint={path}"], tmp_path,
                     data_cache, check=False)
    assert proc.returncode == 2 and "5" in proc.stderr and "10" in proc.stderr and "classes" in proc.stderr
    assert not list(tmp_path.glob("outputs/wandb/offline-run-*"))  # failed before anything was logged
    assert not list(tmp_path.glob("outputs/runs/*"))


def test_token_kind_without_a_distillation_token_is_a_clear_error(teacher_checkpoint, tmp_path, data_cache):
    proc = run_train(TINY + ["distill=hard_token", "model.distilled_name=null",
                             f"distill.teacher.checkpoint={teacher_checkpoint}"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "distillation token" in proc.stderr and "distilled_name" in proc.stderr


def test_distilled_model_with_a_class_token_kind_is_refused_before_anything_runs(teacher_checkpoint, tmp_path,
                                                                                data_cache):
    proc = run_train(TINY + ["model=vit_demo_distilled", "distill=hard",
                             f"distill.teacher.checkpoint={teacher_checkpoint}"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "average of its two heads" in proc.stderr and "model=vit_demo" in proc.stderr
    assert not list(tmp_path.glob("outputs/runs/*"))
