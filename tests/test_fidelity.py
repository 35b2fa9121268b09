"""Reference parity: the ↑384 stage, the SGD rows, the dropout and no_randaugment rows, the Table 3 ladder and
Mixup per micro-batch, each against what the DeiT paper (Touvron et al. 2021) and its released code
(facebookresearch/deit, early 2021) did. Each test names its source."""

from __future__ import annotations

import pytest
import torch
from conftest import lr_trace
from timm.data import Mixup
from timm.layers import DropPath
from torchvision import transforms

from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.transforms import build_eval_transform, build_train_transform
from deit_ablate.record.rundir import LAST
from deit_ablate.run.stages import load_pretrained, stage_recipe
from deit_ablate.run.student import student_model_name
from deit_ablate.run.validate import plan_batch
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler, scaled_lr
from deit_ablate.train.trainer import Trainer
from tests.conftest import compose_config, transform_spec

FINETUNE = ["stage=finetune", "finetune.init_checkpoint=/pretrained.pt"]  # no pre-training run needed to compose
IMAGENET_TRAIN = 1_281_167


def _lr_trace(cfg, steps_per_epoch: int) -> tuple[float, list[float]]:
    """(peak lr, the lr of every update) of the stage `cfg` describes (conftest.lr_trace)."""
    return lr_trace(cfg, steps_per_epoch)


def test_paper_finetune_is_the_released_command_batch_512_lr_5e6():
    # README of facebookresearch/deit: --batch-size 32 on 2 nodes x 8 GPUs = 512, --lr 5e-6 (per 512 images).
    cfg = compose_config(["preset=paper", *FINETUNE])
    recipe = stage_recipe(cfg)
    assert recipe.global_batch == 512 and cfg.train.global_batch == 1024  # pre-training keeps Table 9's 1024
    assert scaled_lr(recipe.lr, recipe.global_batch, cfg.optimizer.lr_base_batch) == pytest.approx(5e-6)
    assert (recipe.optimizer, recipe.weight_decay, recipe.epochs, recipe.min_lr) == ("adamw", 1e-8, 30, 5e-6)
    plan = plan_batch(cfg, world_size=16)
    assert (plan.per_rank_batch, plan.accum_steps) == (32, 1)
    plan = plan_batch(cfg, world_size=1)  # one process: the same 16 micro-batches of 32, accumulated
    assert (plan.per_rank_batch, plan.accum_steps, plan.micro_batch) == (512, 16, 32)


def test_paper_finetune_lr_warms_up_from_1e6_for_5_epochs_then_stays_at_5e6():
    # main.py defaults --warmup-epochs 5 --warmup-lr 1e-6; --min-lr 5e-6 = --lr, so the cosine is flat.
    # Steps per epoch of the released run: the repeated-augmentation sampler keeps floor(N / 256) * 256 images.
    steps_per_epoch = IMAGENET_TRAIN // 256 * 256 // 512
    cfg = compose_config(["preset=paper", *FINETUNE])
    peak, lrs = _lr_trace(cfg, steps_per_epoch)
    warmup = 5 * steps_per_epoch
    assert peak == pytest.approx(5e-6)
    assert lrs[0] == pytest.approx(1e-6)
    assert lrs[warmup // 2] == pytest.approx(1e-6 + (5e-6 - 1e-6) * (warmup // 2) / warmup)
    assert lrs[warmup] == pytest.approx(5e-6)
    assert lrs[len(lrs) // 2] == pytest.approx(5e-6)
    assert lrs[-1] == pytest.approx(5e-6)
    assert len(lrs) == 30 * steps_per_epoch


def test_paper_pretraining_lr_is_timm_0_3_2_cosine_over_the_whole_run():
    # Table 9: 5e-4 x 1024 / 512 = 1e-3, warm-up 5 epochs from 1e-6, cosine to 1e-5 over 300 epochs
    # (timm 0.3.2's create_scheduler: no warm-up prefix, so the cosine is evaluated at the absolute epoch).
    import math

    cfg = compose_config(["preset=paper"])
    steps_per_epoch = 10  # the shape, not the length, is under test
    peak, lrs = _lr_trace(cfg, steps_per_epoch)
    assert peak == pytest.approx(1e-3)
    assert lrs[0] == pytest.approx(1e-6)
    total = 300 * steps_per_epoch
    for step in (50, total // 2, total - 1):
        assert lrs[step] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * step / total)))


def test_demo_finetune_has_the_same_structure_warm_up_then_flat():
    cfg = compose_config(FINETUNE)
    recipe = stage_recipe(cfg)
    peak, lrs = _lr_trace(cfg, steps_per_epoch=10)
    assert not recipe.train_mode and recipe.warmup_epochs > 0
    assert lrs[0] == pytest.approx(recipe.warmup_lr) and lrs[-1] == pytest.approx(peak)
    assert max(lrs) == pytest.approx(peak)


def _regularizer_modes(train_mode: bool) -> set[bool]:
    """The `training` flag every dropout and drop-path module had during one training step."""
    cfg = compose_config(["ablation=dropout", "model.kwargs.depth=2", "model.kwargs.embed_dim=32",
                          "model.kwargs.num_heads=2"])
    model = build_model(cfg.model, num_classes=10, img_size=32)
    seen = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.Dropout, DropPath)):
            module.register_forward_hook(lambda mod, args, out: seen.add(mod.training))
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05)
    scheduler = build_scheduler(optimizer, total_steps=2, warmup_steps=0, min_lr=1e-5, warmup_lr=1e-6)
    criterion = torch.nn.CrossEntropyLoss()
    trainer = Trainer(model=model, optimizer=optimizer, scheduler=scheduler, info=DistInfo(),
                      loss_fn=lambda images, outputs, targets: criterion(outputs, targets), train_mode=train_mode)
    trainer.train_steps([(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))], epoch=0)
    return seen


def test_finetune_step_runs_with_dropout_and_drop_path_inactive():
    # facebookresearch/deit a8e9096 (Jan 2021): train_one_epoch(..., set_training_mode=args.finetune == '').
    assert stage_recipe(compose_config(["preset=paper", *FINETUNE])).train_mode is False
    assert stage_recipe(compose_config(["preset=paper"])).train_mode is True
    assert _regularizer_modes(train_mode=False) == {False}
    assert _regularizer_modes(train_mode=True) == {True}


def test_distilled_student_returns_both_heads_when_fine_tuned_in_eval_mode():
    cfg = compose_config(["distill=hard_token", "model.kwargs.depth=1", "model.kwargs.embed_dim=32",
                          "model.kwargs.num_heads=2"])
    model = build_model(cfg.model, num_classes=10, img_size=32, name=student_model_name(cfg.model, cfg.distill))
    model.set_distilled_training(True)
    outputs = []
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05)
    trainer = Trainer(model=model, optimizer=optimizer, info=DistInfo(), train_mode=False,
                      scheduler=build_scheduler(optimizer, 2, 0, 1e-5, 1e-6),
                      loss_fn=lambda images, out, targets: outputs.append(out) or out[0].sum() + out[1].sum())
    trainer.train_steps([(torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))], epoch=0)
    assert isinstance(outputs[0], tuple) and len(outputs[0]) == 2
    assert not any(module.training for module in model.blocks.modules())  # drop path and dropout stay off


@pytest.mark.parametrize(("size", "resize"), [(224, 256), (384, 438), (160, 182), (320, 365)])
def test_eval_resizes_as_the_released_datasets_py(size, resize):
    # datasets.build_transform: Resize(int(256 / 224 * input_size), bicubic), CenterCrop(input_size).
    cfg = compose_config(["preset=paper", f"resolution={size}px"])
    steps = build_eval_transform(transform_spec(cfg)).transforms
    resizes = [t for t in steps if isinstance(t, transforms.Resize)]
    crops = [t for t in steps if isinstance(t, transforms.CenterCrop)]
    assert resize == int(256 / 224 * size)
    assert resizes[0].size in (resize, [resize]) and list(crops[0].size) == [size, size]
    assert resizes[0].interpolation == transforms.InterpolationMode.BICUBIC


def test_paper_finetune_evaluates_at_384_from_438():
    cfg = compose_config(["preset=paper", *FINETUNE])
    steps = build_eval_transform(transform_spec(cfg)).transforms
    assert next(t for t in steps if isinstance(t, transforms.Resize)).size in (438, [438])


@pytest.mark.parametrize("preset", ["demo", "paper"])
@pytest.mark.parametrize("kind", ["none", "soft", "hard", "hard_token", "soft_token"])
def test_each_table_3_option_trains_the_model_the_paper_trained(kind, preset):
    # DeiT Table 3: no distillation and the class-token kinds train DeiT-B; the token kinds DeiT-B⚗.
    cfg = compose_config([f"preset={preset}", f"distill={kind}"])
    name = student_model_name(cfg.model, cfg.distill)
    assert ("_distilled_" in name) == kind.endswith("_token")
    assert name.replace("_distilled", "") == cfg.model.name


def test_the_token_kinds_build_a_model_with_a_distillation_head_and_the_others_without():
    for kind, has_token in (("hard", False), ("hard_token", True)):
        cfg = compose_config([f"distill={kind}", "model.kwargs.depth=1"])
        model = build_model(cfg.model, num_classes=10, img_size=32, name=student_model_name(cfg.model, cfg.distill))
        assert hasattr(model, "head_dist") == has_token and hasattr(model, "dist_token") == has_token


@pytest.mark.parametrize("kind", ["none", "soft", "hard"])
def test_a_distilled_model_with_a_class_token_kind_is_refused_never_averaged(kind):
    cfg = compose_config(["model=vit_demo_distilled", f"distill={kind}"])
    with pytest.raises(ConfigError, match="average of its two heads"):
        student_model_name(cfg.model, cfg.distill)


def test_dropout_row_drops_where_timm_0_3_2_did_and_not_before_the_head():
    # timm 0.3.2 VisionTransformer: pos_drop(drop_rate), Attention.proj_drop(drop), Mlp.drop(drop) twice;
    # attention dropout is its own rate (0) and there is no dropout before the head.
    cfg = compose_config(["preset=paper", "ablation=dropout"])
    model = build_model(cfg.model, num_classes=1000, img_size=224)
    assert model.pos_drop.p == 0.1 and model.head_drop.p == 0.0
    for block in model.blocks:
        assert block.attn.proj_drop.p == 0.1 and block.attn.attn_drop.p == 0.0
        assert block.mlp.drop1.p == 0.1 and block.mlp.drop2.p == 0.1
    baseline = build_model(compose_config(["preset=paper"]).model, num_classes=1000, img_size=224)
    assert {m.p for m in baseline.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}


@pytest.mark.parametrize(("row", "pretrain", "finetune"),
                         [("baseline", "adamw", "adamw"), ("sgd", "sgd", "adamw"), ("sgd_finetune", "adamw", "sgd")])
def test_sgd_rows_change_only_their_own_stage_optimizer(row, pretrain, finetune):
    # Table 8: "SGD instead of AdamW for pretraining" vs SGD for the fine-tuning only.
    assert stage_recipe(compose_config([f"ablation={row}"])).optimizer == pretrain
    assert stage_recipe(compose_config([f"ablation={row}", *FINETUNE])).optimizer == finetune


def test_no_randaugment_row_falls_back_to_the_paper_era_colour_jitter():
    # facebookresearch/deit 1d38fa4 (Dec 2020) main.py: --color-jitter default 0.4 (0.3 only since 2022).
    cfg = compose_config(["ablation=no_randaugment"])
    jitter = [t for t in build_train_transform(transform_spec(cfg)).transforms if isinstance(t, transforms.ColorJitter)]
    assert cfg.augment.color_jitter == 0.4 and jitter and jitter[0].brightness == pytest.approx((0.6, 1.4))
    baseline = build_train_transform(transform_spec(compose_config([]))).transforms
    assert not any(isinstance(t, transforms.ColorJitter) for t in baseline)  # RandAugment replaces it


def test_ema_row_finetunes_from_the_ema_weights(tmp_path):
    cfg = compose_config(["model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"])
    trained = build_model(cfg.model, num_classes=10, img_size=32)
    averaged = build_model(cfg.model, num_classes=10, img_size=32)
    path = tmp_path / LAST
    torch.save({"model": trained.state_dict(), "ema": averaged.state_dict(), "step": 1}, path)
    student = build_model(cfg.model, num_classes=10, img_size=48)
    load_pretrained(student, path)
    assert torch.equal(student.head.weight, averaged.head.weight)
    assert not torch.equal(student.head.weight, trained.head.weight)
    torch.save({"model": trained.state_dict(), "step": 1}, path)  # no EMA kept: the trained weights
    load_pretrained(student, path)
    assert torch.equal(student.head.weight, trained.head.weight)


def test_each_micro_batch_draws_its_own_mixup_as_each_gpu_of_the_reference_did():
    # 8 GPUs x 128 in the reference: 8 Mixup/CutMix draws per update. One process accumulating 8 x 128 must
    # draw 8 times too, each on its own micro-batch.
    draws = []

    class CountingMixup(Mixup):
        def __call__(self, x, target):
            draws.append(x.shape[0])
            return super().__call__(x, target)

    cfg = compose_config(["model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"])
    model = build_model(cfg.model, num_classes=10, img_size=32)
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    trainer = Trainer(model=model, optimizer=optimizer, info=DistInfo(), accum_steps=4,
                      scheduler=build_scheduler(optimizer, 2, 0, 1e-5, 1e-6),
                      mixup=CountingMixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10),
                      loss_fn=lambda images, outputs, targets: criterion(outputs, targets))
    trainer.train_step(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
    assert draws == [4, 4, 4, 4]
