"""Patient and consistent teaching (Beyer et al. 2022): the fixed teacher's cached outputs, function matching's
Mixup, and a 2-step run with a fixed teacher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

import deit_ablate.run.assemble as assemble_module
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.rundir import LAST, RunDir, runs_root
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.student import student_model_name
from deit_ablate.run.teacher import TeacherSource, check_resizable_teacher, check_teacher_sizes, run_teacher
from deit_ablate.run.teacher_cache import FixedView, WithIndex, fixed_view_transform, teacher_table
from deit_ablate.run.validate import check_ranges, check_teacher_view
from deit_ablate.train.losses import DistillationLoss, FixedTeacherLoss, build_criterion, build_mixup, split_targets
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler
from deit_ablate.train.teacher import MultiSizeTeacher, teacher_forward
from deit_ablate.train.trainer import Trainer
from tests import teaching_ddp_worker
from tests.conftest import REPO, TINY, compose_config, identity_of, run_train, transform_spec

STUDENT = ["model=vit_demo", "model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"]


class Pictures(Dataset):
    """A few random RGB pictures of other sizes, labelled i % 10, each in `transform`."""

    def __init__(self, transform, count: int = 5) -> None:
        generator = np.random.default_rng(0)
        self.images = [Image.fromarray(generator.integers(0, 256, (40 + 3 * i, 52 - 2 * i, 3), dtype=np.uint8))
                       for i in range(count)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.transform(self.images[index]), index % 10


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory) -> Path:
    """A resnet10t with 10 classes, saved the way our runs save checkpoints."""
    path = tmp_path_factory.mktemp("teacher") / LAST
    torch.save({"model": timm.create_model("resnet10t", num_classes=10).state_dict()}, path)
    return path


def _view(cfg) -> FixedView:
    return FixedView(transform_spec(cfg), cfg.runtime)


def _check_view(cfg):
    check_teacher_view(cfg.distill, cfg.mix, cfg.data)


def test_the_fixed_view_is_resize_then_centre_crop_at_the_training_size():
    cfg = compose_config(["resolution.crop_pct=0.875"])
    size = cfg.resolution.train_size
    image = Pictures(lambda x: x).images[3]
    by_hand = transforms.Compose([
        transforms.Resize(math.floor(size / 0.875), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(size), transforms.ToTensor(),
        transforms.Normalize(tuple(cfg.data.mean), tuple(cfg.data.std))])
    assert cfg.augment.interpolation == "bicubic"
    torch.testing.assert_close(fixed_view_transform(transform_spec(cfg))(image), by_hand(image))


def test_the_cached_outputs_are_the_teachers_outputs_on_each_images_fixed_view():
    cfg = compose_config(["runtime.num_workers=0"])
    teacher = timm.create_model("resnet10t", num_classes=10).eval()
    view = fixed_view_transform(transform_spec(cfg))
    dataset = Pictures(view)
    table = teacher_table(teacher, dataset, 2, cfg.runtime, 10, DistInfo())  # batches of 2: rows filled across batches
    assert table.shape == (5, 10) and table.dtype == torch.float32
    with torch.no_grad():
        for i, picture in enumerate(dataset.images):
            torch.testing.assert_close(table[i], teacher(view(picture)[None])[0])


def test_the_image_index_travels_with_its_label():
    dataset = WithIndex(Pictures(transforms.ToTensor()))
    image, target = dataset[3]
    assert target.tolist() == [3, 3] and image.shape == (3, 49, 46)
    labels, indices = split_targets(next(iter(DataLoader(WithIndex(Pictures(lambda x: 0)), batch_size=5)))[1])
    assert labels.tolist() == [0, 1, 2, 3, 4] and indices.tolist() == [0, 1, 2, 3, 4]


def test_the_fixed_teacher_loss_uses_the_cached_rows_of_the_batchs_images():
    torch.manual_seed(0)
    table, student = torch.randn(6, 10), torch.randn(3, 10)
    labels, indices = torch.tensor([7, 2, 7]), torch.tensor([4, 1, 4])
    alpha, tau = 0.1, 3.0
    loss = FixedTeacherLoss(DistillationLoss(torch.nn.CrossEntropyLoss(), "soft", alpha, tau), table)
    got = loss(torch.randn(3, 3, 8, 8), student, torch.stack([labels, indices], dim=1))
    # DeiT Eq. 2 written out: (1 - alpha) CE + alpha tau^2 KL(teacher rows 4, 1, 4 || student) / (B K)
    p_t = (table[indices] / tau).softmax(-1)
    kl = (p_t * (p_t.log() - (student / tau).log_softmax(-1))).sum() / student.numel()
    expected = (1 - alpha) * F.cross_entropy(student, labels) + alpha * tau * tau * kl
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("overrides, words", [
    (["distill.teacher_view=fixed"], "distill=none has no teacher"),
    (["distill=soft", "distill.teacher_view=fixed"], "add mix=none"),
    (["distill=soft", "distill.teacher_view=fixed", "mix=function_matching"], "add mix=none"),
    (["distill=soft", "distill.teacher_view=fixed", "mix=none", "data.backend=dali"], "data.backend=pil"),
])
def test_a_fixed_teacher_that_cannot_work_is_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words):
        _check_view(compose_config(overrides))


def test_function_matching_is_mixup_with_lambda_uniform_on_0_1_on_every_batch():
    cfg = compose_config(["mix=function_matching"])
    mixup = build_mixup(cfg.mix, 10)
    # Beta(1, 1) is the uniform density on [0, 1]; no CutMix, no unmixed batch, no label smoothing.
    assert (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.mix_prob, mixup.label_smoothing) == (1.0, 0.0, 1.0, 0.0)
    assert mixup.mode == "batch" and mixup.mixup_enabled
    np.random.seed(0)
    draws = [mixup._params_per_batch() for _ in range(4000)]
    assert not any(cutmix for _, cutmix in draws)
    lam = np.sort([lam for lam, _ in draws])
    assert 0 < lam[0] and lam[-1] < 1
    ks = np.max(np.abs(lam - np.arange(1, len(lam) + 1) / len(lam)))  # Kolmogorov-Smirnov distance to U(0, 1)
    assert ks < 1.36 / math.sqrt(len(lam))  # the 5 % critical value
    assert abs(lam.mean() - 0.5) < 0.02 and abs(lam.var() - 1 / 12) < 0.01


def test_under_function_matching_the_teacher_sees_the_students_mixed_images(teacher_checkpoint, monkeypatch):
    cfg = compose_config(STUDENT + ["mix=function_matching", "distill=soft",
                                    f"distill.teacher.checkpoint={teacher_checkpoint}"])
    student = build_model(cfg.model, 10, 32, name=student_model_name(cfg.model, cfg.distill))
    seen = {}
    student.register_forward_pre_hook(lambda module, args: seen.__setitem__("student", args[0].clone()))
    real_forward = assemble_module.teacher_forward

    def recording_forward(teacher, images):
        seen["teacher"] = images.clone()
        return real_forward(teacher, images)

    monkeypatch.setattr(assemble_module, "teacher_forward", recording_forward)
    mixup = build_mixup(cfg.mix, 10)
    loss_fn = assemble_module.build_loss_fn(
        cfg.distill,
        _view(cfg),
        run_teacher(Lineage.of(cfg, ()), cfg.distill.teacher),
        student,
        build_criterion(cfg.mix, mixup),
        torch.device("cpu"),
    )
    optimizer = build_optimizer(student, "adamw", 1e-3, 0.05)
    trainer = Trainer(model=student, optimizer=optimizer, loss_fn=loss_fn, info=DistInfo(), mixup=mixup,
                      scheduler=build_scheduler(optimizer, 10, 0, 1e-5, 1e-6))
    images, labels = torch.randn(8, 3, 32, 32), torch.arange(8)
    original = images.clone()  # timm's Mixup mixes in place
    np.random.seed(1)
    lam, _ = mixup._params_per_batch()  # the draw train_step's Mixup makes next
    np.random.seed(1)
    assert torch.isfinite(trainer.train_step(images, labels))
    assert torch.equal(seen["teacher"], seen["student"])
    # Mixup's definition: lam x + (1 - lam) x flipped along the batch, lam the Beta(1, 1) draw
    torch.testing.assert_close(seen["teacher"], lam * original + (1 - lam) * original.flip(0))


@pytest.mark.slow
def test_a_two_step_run_with_a_fixed_teacher(tmp_path, data_cache, teacher_run):
    teacher_run.copy_into(tmp_path)
    teacher = runs_root(tmp_path / "outputs") / teacher_run.run_dir("model=cnn_demo").name
    data = [item for item in TINY if not item.startswith(("model.", "train.epochs="))]
    proc = run_train(STUDENT + data + ["train.epochs=1", "train.max_steps=2", "distill=soft", "mix=none",
                                       "distill.teacher_view=fixed", f"distill.teacher.checkpoint='{teacher}'"],
                     tmp_path, data_cache)
    assert "fixed teacher (Beyer et al. 2022): outputs of 300 training images" in proc.stderr + proc.stdout
    (student,) = [p for p in runs_root(tmp_path / "outputs").iterdir() if p.is_dir() and p != teacher]
    assert "distill.teacher_view=fixed" in student.name
    result = json.loads(RunDir(student).result.read_text())
    assert result["status"] == "finished"


@pytest.mark.slow
def test_under_two_ranks_every_rank_holds_every_images_cached_outputs(tmp_path):
    out = tmp_path / "table"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29861",
               str(REPO / "tests" / "teaching_ddp_worker.py"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        expected = torch.stack([teaching_ddp_worker.teacher()(image[None])[0]
                                for image in teaching_ddp_worker.images()])
    for rank in (0, 1):  # rank 0 computed images 0, 2, 4 and rank 1 images 1, 3; both hold all five
        torch.testing.assert_close(torch.load(f"{out}.{rank}.pt"), expected)


def test_both_options_compose_at_paper_scale_with_their_values():
    cfg = compose_config(["preset=paper", "stage=pretrain", "mix=function_matching", "distill=soft"])
    assert (cfg.mix.mixup_alpha, cfg.mix.cutmix_alpha, cfg.mix.prob, cfg.mix.label_smoothing) == (1.0, 0.0, 1.0, 0.0)
    assert cfg.distill.teacher_view == "same"
    _check_view(cfg)
    cfg = compose_config(["preset=paper", "distill=soft", "distill.teacher_view=fixed", "mix=none"])
    _check_view(cfg)
    assert cfg.distill.teacher_view == "fixed" and cfg.resolution.train_size == 224


def test_a_training_step_in_two_chunks_looks_up_each_chunks_own_rows():
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
    table = torch.randn(9, 10)
    loss = FixedTeacherLoss(DistillationLoss(torch.nn.CrossEntropyLoss(), "hard", 0.5, 1.0), table)
    images, labels, indices = torch.randn(4, 3, 2, 2), torch.tensor([1, 2, 3, 4]), torch.tensor([8, 0, 5, 5])
    with torch.no_grad():  # by hand, at the starting weights: 1/2 CE(label) + 1/2 CE(teacher's arg-max), per chunk
        logits = student(images)
        halves = [0.5 * F.cross_entropy(logits[s], labels[s]) + 0.5 * F.cross_entropy(logits[s], table[indices[s]]
                  .argmax(-1)) for s in (slice(0, 2), slice(2, 4))]
    optimizer = build_optimizer(student, "sgd", 0.1, 0.0)
    trainer = Trainer(model=student, optimizer=optimizer, loss_fn=loss, info=DistInfo(), accum_steps=2,
                      scheduler=build_scheduler(optimizer, 10, 0, 0.1, 0.1))
    got = trainer.train_step(images, torch.stack([labels, indices], dim=1))
    torch.testing.assert_close(got, (halves[0] + halves[1]) / 2)


class SizeProbe(torch.nn.Module):
    """A teacher whose two logits are channel 0's pixel (row 0, column 1) and the image's side: both depend on the
    size the teacher sees."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.stack([images[:, 0, 0, 1], torch.full((len(images),), float(images.shape[-1]))], dim=1)


def test_a_teacher_at_several_sizes_averages_its_logits_over_the_batch_resized_to_each():
    ramp, flat = torch.tensor([[0.0, 4.0], [8.0, 12.0]]), torch.ones(2, 2)
    images = torch.stack([ramp, flat])[:, None]  # 2 images, 1 channel, 2 x 2
    # Bilinear to 4 x 4 with half-pixel centres: output column 1 samples x = 0.25 of the way from 4's left
    # neighbour 0 to 4, row 0 samples y = -0.25, clamped to row 0: 0.25 * 4 = 1. A flat image stays flat.
    got = teacher_forward(MultiSizeTeacher(SizeProbe(), [2, 4]), images)
    torch.testing.assert_close(got, torch.tensor([[(4.0 + 1.0) / 2, (2 + 4) / 2], [1.0, 3.0]]))
    torch.testing.assert_close(teacher_forward(MultiSizeTeacher(SizeProbe(), [4]), images),
                               torch.tensor([[1.0, 4.0], [1.0, 4.0]]))
    # Down to 2 x 2 without antialiasing, each output pixel is the mean of its 2 x 2 block: pixel (0, 1) of
    # x[r, c] = 4r + c is (2 + 3 + 6 + 7) / 4 = 4.5; at its own size pixel (0, 1) is 1.
    big = (4 * torch.arange(4.0)[:, None] + torch.arange(4.0))[None, None]
    torch.testing.assert_close(teacher_forward(MultiSizeTeacher(SizeProbe(), [4, 2]), big),
                               torch.tensor([[(1 + 4.5) / 2, (4 + 2) / 2]]))


def test_the_fixed_views_cached_outputs_average_the_teacher_over_its_sizes():
    cfg = compose_config(["runtime.num_workers=0"])
    view = fixed_view_transform(transform_spec(cfg))
    dataset = Pictures(view)
    table = teacher_table(MultiSizeTeacher(SizeProbe(), [32, 48]), dataset, 2, cfg.runtime, 10, DistInfo())
    size = cfg.resolution.train_size
    for i, picture in enumerate(dataset.images):
        image = view(picture)[None]
        resized = F.interpolate(image, size=(48, 48), mode="bilinear", align_corners=False)
        assert size == 32 and table[i, 1] == (32 + 48) / 2
        torch.testing.assert_close(table[i, 0], (image[0, 0, 0, 1] + resized[0, 0, 0, 1]) / 2)


def test_the_runs_teacher_sees_each_batch_at_the_sizes_it_names(teacher_checkpoint, monkeypatch):
    cfg = compose_config(STUDENT + ["distill=soft", f"distill.teacher.checkpoint={teacher_checkpoint}",
                                    "distill.teacher.model=resnet10t", "distill.teacher.sizes=[32,48]"])
    seen = {}

    def recording_forward(teacher, images):
        seen["teacher"] = teacher
        return teacher_forward(teacher, images)

    monkeypatch.setattr(assemble_module, "teacher_forward", recording_forward)
    student = build_model(cfg.model, 10, 32, name=student_model_name(cfg.model, cfg.distill))
    loss_fn = assemble_module.build_loss_fn(
        cfg.distill,
        _view(cfg),
        run_teacher(Lineage.of(cfg, ()), cfg.distill.teacher),
        student,
        torch.nn.CrossEntropyLoss(),
        torch.device("cpu"),
    )
    assert torch.isfinite(loss_fn(torch.randn(2, 3, 32, 32), torch.randn(2, 10), torch.tensor([0, 1])))
    teacher = seen["teacher"]
    assert isinstance(teacher, MultiSizeTeacher) and teacher.sizes == (32, 48) and not teacher.training
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        by_hand = (teacher.teacher(images) + teacher.teacher(F.interpolate(images, size=(48, 48), mode="bilinear"))) / 2
    torch.testing.assert_close(teacher_forward(teacher, images), by_hand)
    # the default (null) is the run as before the key; sizes are another experiment
    plain, default = identity_of(["distill=soft"]), identity_of(["distill=soft", "distill.teacher.sizes=null"])
    assert (plain.digest, plain.run_id) == (default.digest, default.run_id)
    assert plain.digest != identity_of(["distill=soft", "distill.teacher.sizes=[32,48]"]).digest


@pytest.mark.parametrize("sizes, model, words", [
    ("[]", "resnet10t", "at least one"),
    ("[224,224]", "resnet10t", "Name each size once"),
    ("[224,384]", "vit_tiny_patch16_224", "dynamic_img_size=true"),
])
def test_teacher_sizes_that_cannot_work_are_refused(sizes, model, words):
    sizes = compose_config(["distill=soft", f"distill.teacher.sizes={sizes}"]).distill.teacher.sizes
    with pytest.raises(ConfigError, match=words):
        check_teacher_sizes(sizes)
        check_resizable_teacher(sizes, TeacherSource(model, {}, None))
    check_resizable_teacher(sizes, TeacherSource(model, {"dynamic_img_size": True}, None))  # it takes any size
    with pytest.raises(ConfigError, match=r"distill.teacher.sizes=\[0, 224\] must be in \[1, 2048\]"):
        check_ranges(compose_config(["distill.teacher.sizes=[0,224]"]))
