"""DeiT III's recipe against its definition: the recipe's values, binary cross-entropy, LAMB, layer-wise lr decay."""

from __future__ import annotations

import json
import math

import pytest
import timm
import torch
from omegaconf import OmegaConf
from timm.optim import Lamb, param_groups_layer_decay

from deit_ablate.core.errors import ConfigError
from deit_ablate.record.rundir import RunDir
from deit_ablate.run.stages import load_pretrained
from deit_ablate.run.validate import validate_config
from deit_ablate.train.losses import DistillationLoss, build_criterion, build_mixup
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler, layer_id
from tests.conftest import TINY, compose_config, run_train


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def _bce(logits: list[list[float]], targets: list[list[float]]) -> float:
    """Binary cross-entropy written out: -(y log s(z) + (1 - y) log(1 - s(z))), mean over images and classes."""
    terms = [-(y * math.log(_sigmoid(z)) + (1 - y) * math.log(1 - _sigmoid(z)))
             for row_z, row_y in zip(logits, targets, strict=True) for z, y in zip(row_z, row_y, strict=True)]
    return sum(terms) / len(terms)


# --- the recipe ---------------------------------------------------------------------------------------------------

def test_deit3_composes_at_paper_scale_with_vit_b_values():
    cfg = compose_config(["recipe=deit3", "preset=paper"])
    # DeiT III's ViT-B command: --opt fusedlamb --lr 3e-3 --unscale-lr at --batch 256 on 8 GPUs, --weight-decay 0.05
    opt = cfg.optimizer
    assert (opt.name, opt.lr, opt.lr_base_batch, opt.weight_decay) == ("lamb", 3e-3, 2048, 0.05)
    assert tuple(opt.betas) == (0.9, 0.999) and opt.eps == 1e-8 and opt.clip_grad is None
    assert (opt.sched, opt.warmup_epochs, opt.warmup_lr, opt.min_lr) == ("cosine", 5, 1e-6, 1e-5)
    assert (cfg.train.global_batch, cfg.train.epochs) == (2048, 800)
    # --bce-loss --smoothing 0.0 --mixup .8 --cutmix 1.0 (Beta alphas, switched per batch)
    mix = cfg.mix
    assert (mix.criterion, mix.label_smoothing, mix.mixup_alpha, mix.cutmix_alpha) == ("bce", 0.0, 0.8, 1.0)
    assert (mix.prob, mix.switch_prob) == (1.0, 0.5)
    # --ThreeAugment --color-jitter 0.3 --reprob 0.0 --repeated-aug; random-resized crop on ImageNet-1k
    aug = cfg.augment
    assert aug.three_augment is True and aug.auto_augment is None and aug.crop == "rrc"
    assert (aug.color_jitter, aug.reprob, aug.repeated_aug, tuple(aug.scale)) == (0.3, 0.0, 3, (0.08, 1.0))
    # deit_base_patch16_LS: LayerScale from 1e-4, the same drop-path rate 0.2 in every block, --drop 0.0
    model = cfg.model
    assert (model.drop_path, model.dropout) == (0.2, 0.0)
    assert model.kwargs.init_values == 1e-4 and model.kwargs.drop_path_schedule == "uniform"
    assert cfg.resolution.crop_pct == 1.0  # --eval-crop-ratio 1.0
    # the ViT-B fine-tune: --opt adamw --lr 1e-5 --unscale-lr at 16 x 32, --weight-decay 0.1 --epochs 20, train mode
    # (its loss and augmentation: tests/test_stage_recipes.py)
    ft = cfg.finetune
    assert (ft.optimizer, ft.global_batch, ft.weight_decay, ft.epochs, ft.warmup_epochs) == ("adamw", 512, 0.1, 20, 5)
    assert ft.lr * ft.global_batch / ft.lr_base_batch == pytest.approx(1e-5)
    assert ft.train_mode is True and ft.min_lr == 1e-5


def test_deit3_builds_vit_b_with_layer_scale_and_uniform_drop_path():
    cfg = compose_config(["recipe=deit3", "preset=paper"])
    with torch.device("meta"):
        model = build_model(cfg.model, num_classes=1000, img_size=224)
    assert len(model.blocks) == 12 and model.embed_dim == 768
    assert [block.drop_path1.drop_prob for block in model.blocks] == [0.2] * 12
    assert all(block.ls1.gamma.shape == (768,) for block in model.blocks)


def _released_vit_b_params(dim: int = 768, depth: int = 12, patch: int = 16, patches: int = 196,
                           classes: int = 1000) -> int:
    """The parameters of DeiT III's released ViT-B (models_v2.py, deit_base_patch16_LS), layer by layer."""
    patch_embed = 3 * patch * patch * dim + dim
    tokens = dim + patches * dim  # the class token; position rows for the patches only
    block = (2 * dim + dim * 3 * dim + 3 * dim + dim * dim + dim + dim  # norm1, qkv, proj, gamma_1
             + 2 * dim + dim * 4 * dim + 4 * dim + 4 * dim * dim + dim + dim)  # norm2, fc1, fc2, gamma_2
    return patch_embed + tokens + depth * block + 2 * dim + dim * classes + classes  # final norm, head


@pytest.mark.parametrize("choice", ["recipe=deit3", "deit3=baseline"])
def test_deit3_builds_the_released_layout_without_a_class_position(choice):
    cfg = compose_config([choice, "preset=paper"])
    with torch.device("meta"):
        ours = build_model(cfg.model, num_classes=1000, img_size=224)
        released = timm.create_model("deit3_base_patch16_224", pretrained=False)  # timm's copy of that layout
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in released.parameters()) == _released_vit_b_params() == 86_585_320
    assert ours.pos_embed.shape == (1, 196, 768) and ours.cls_token.shape == (1, 1, 768)


def test_deit3_fine_tune_at_another_resolution_resizes_the_patch_positions_only(tmp_path):
    cfg = compose_config(["recipe=deit3"])  # the demo ViT: 8 px patches, width 128
    small = build_model(cfg.model, 10, img_size=32)
    torch.save({"model": small.state_dict(), "epoch": 3}, RunDir(tmp_path).last_checkpoint)
    large = build_model(cfg.model, 10, img_size=48)
    load_pretrained(large, RunDir(tmp_path).last_checkpoint)
    assert small.pos_embed.shape == (1, 16, 128) and large.pos_embed.shape == (1, 36, 128)
    grid = small.pos_embed.detach().reshape(1, 4, 4, 128).permute(0, 3, 1, 2)  # every row is a patch's
    by_hand = torch.nn.functional.interpolate(grid, size=(6, 6), mode="bicubic", align_corners=False)
    torch.testing.assert_close(large.pos_embed.detach(), by_hand.permute(0, 2, 3, 1).reshape(1, 36, 128))
    assert torch.equal(large.cls_token, small.cls_token)
    assert large(torch.randn(2, 3, 48, 48)).shape == (2, 10)


def test_a_distilled_vit_without_class_positions_has_one_position_row_per_patch():
    model_cfg = OmegaConf.create({"name": "deit_tiny_distilled_patch16_224", "dropout": 0.0, "drop_path": 0.0,
                                  "kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2,
                                             "no_embed_class": True}})
    model = build_model(model_cfg, 10, img_size=32).eval()
    assert model.num_prefix_tokens == 2 and model.pos_embed.shape == (1, 16, 32)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_deit3_at_demo_scale_passes_the_checks():
    cfg = compose_config(["recipe=deit3"])
    assert (cfg.optimizer.name, cfg.train.global_batch, cfg.train.epochs, cfg.mix.criterion) == ("lamb", 128, 10, "bce")
    validate_config(cfg)


def test_lamb_option_is_deit3s_lamb_under_deits_lr_rule():
    cfg = compose_config(["optimizer=lamb", "preset=paper"])
    assert (cfg.optimizer.name, cfg.optimizer.weight_decay, cfg.optimizer.eps) == ("lamb", 0.05, 1e-8)
    assert cfg.optimizer.lr * 2048 / cfg.optimizer.lr_base_batch == pytest.approx(3e-3)


# --- binary cross-entropy -----------------------------------------------------------------------------------------

def test_bce_on_mixed_targets_makes_every_class_in_the_mix_a_positive():
    cfg = compose_config(["mix.criterion=bce", "mix.label_smoothing=0"])
    criterion = build_criterion(cfg.mix, build_mixup(cfg.mix, num_classes=4))
    logits = [[2.0, -1.0, 0.5, 0.0], [-0.3, 1.5, -2.0, 0.7]]
    mixed = [[0.7, 0.0, 0.3, 0.0], [0.0, 0.0, 0.0, 1.0]]  # image 0: 70 % class 0, 30 % class 2
    positives = [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]  # DeiT III: target > 0 -> 1
    loss = criterion(torch.tensor(logits), torch.tensor(mixed))
    assert loss.item() == pytest.approx(_bce(logits, positives), rel=1e-6)
    assert loss.item() != pytest.approx(_bce(logits, mixed), rel=1e-3)


def test_bce_on_integer_labels_is_one_hot():
    cfg = compose_config(["mix=none", "mix.criterion=bce", "mix.label_smoothing=0"])
    criterion = build_criterion(cfg.mix, build_mixup(cfg.mix, num_classes=3))
    logits = [[0.2, -0.4, 1.0], [1.1, 0.0, -0.5]]
    loss = criterion(torch.tensor(logits), torch.tensor([2, 0]))
    assert loss.item() == pytest.approx(_bce(logits, [[0, 0, 1], [1, 0, 0]]), rel=1e-6)


def test_bce_with_hard_distillation_is_bce_plus_the_teachers_label():
    cfg = compose_config(["mix.criterion=bce", "mix.label_smoothing=0"])
    loss_fn = DistillationLoss(build_criterion(cfg.mix, None), "hard", alpha=0.5, tau=1.0)
    logits, teacher = [[1.0, -1.0, 0.0]], torch.tensor([[0.0, 3.0, 1.0]])  # the teacher says class 1
    loss = loss_fn(torch.tensor(logits), teacher, torch.tensor([[0.0, 0.0, 1.0]]))
    ce_teacher = -math.log(math.exp(-1.0) / (math.exp(1.0) + math.exp(-1.0) + 1.0))
    assert loss.item() == pytest.approx(0.5 * _bce(logits, [[0, 0, 1]]) + 0.5 * ce_teacher, rel=1e-6)


def test_bce_with_label_smoothing_is_refused():
    with pytest.raises(ConfigError, match="mix.label_smoothing=0"):
        validate_config(compose_config(["mix.criterion=bce"]))  # the deit recipe smooths by 0.1


# --- LAMB ---------------------------------------------------------------------------------------------------------

def _named_groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, dict]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)]: group for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize("model_option", ["vit_demo", "vit_demo_distilled"])
def test_lamb_skips_weight_decay_on_1d_params_and_the_tokens(model_option):
    cfg = compose_config([f"model={model_option}", "model.kwargs.depth=2"])
    model = build_model(cfg.model, num_classes=10, img_size=32)
    optimizer = build_optimizer(model, "lamb", lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999), eps=1e-8)
    assert isinstance(optimizer, Lamb) and optimizer.defaults["max_grad_norm"] == 1.0  # as apex's FusedLAMB
    groups = _named_groups(optimizer, model)
    assert set(groups) == {name for name, _ in model.named_parameters()}
    skipped = {"cls_token", "pos_embed", "dist_token"} & set(model.no_weight_decay())
    for name, param in model.named_parameters():
        assert groups[name]["weight_decay"] == (0.0 if param.ndim <= 1 or name in skipped else 0.05), name
        assert groups[name]["betas"] == (0.9, 0.999) and groups[name]["eps"] == 1e-8
    assert skipped >= {"cls_token", "pos_embed"}


def test_lamb_step_is_adam_with_decay_scaled_by_the_trust_ratio():
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 3.0]]))
        model.bias.copy_(torch.tensor([0.1, -0.2]))
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    lr, wd, eps = 0.1, 0.05, 1e-8
    optimizer = build_optimizer(model, "lamb", lr=lr, weight_decay=wd, eps=eps)
    model.weight.grad = torch.tensor([[0.3, -0.1], [0.2, 0.4]])  # global norm < 1: no clipping
    model.bias.grad = torch.tensor([-0.05, 0.1])
    grad_w, grad_b = model.weight.grad.clone(), model.bias.grad.clone()
    optimizer.step()
    # step 1 with bias correction: m_hat = g, v_hat = g^2, so Adam's update is g / (|g| + eps)
    update = grad_w / (grad_w.abs() + eps) + wd * weight
    trust = weight.norm() / update.norm()
    assert torch.allclose(model.weight, weight - lr * trust * update, atol=1e-6)
    # the bias has no weight decay, hence no trust ratio (apex's use_nvlamb=False)
    assert torch.allclose(model.bias, bias - lr * grad_b / (grad_b.abs() + eps), atol=1e-6)


# --- layer-wise lr decay ------------------------------------------------------------------------------------------

def _expected_layer(name: str, depth: int) -> int:
    """The chapter's rule, spelled out: embeddings 0, blocks.k k + 1, the rest depth + 1."""
    if name.startswith("patch_embed.") or name in ("cls_token", "dist_token", "reg_token", "pos_embed"):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    assert name.startswith(("norm.", "head.", "head_dist.", "fc_norm.")), name
    return depth + 1


def _vit12(model_option: str, **kwargs) -> torch.nn.Module:
    cfg = compose_config([f"model={model_option}", "model.kwargs.depth=12", "model.kwargs.embed_dim=32",
                          "model.kwargs.num_heads=2", *(f"+model.kwargs.{k}={v}" for k, v in kwargs.items())])
    return build_model(cfg.model, num_classes=10, img_size=32)


@pytest.mark.parametrize(("model_option", "kwargs"), [("vit_demo", {"reg_tokens": 4}), ("vit_demo_distilled", {})])
def test_layer_decay_gives_every_parameter_zeta_to_its_distance_from_the_head(model_option, kwargs):
    model, zeta, lr = _vit12(model_option, **kwargs), 0.75, 1e-3
    optimizer = build_optimizer(model, "adamw", lr=lr, weight_decay=0.05, layer_decay=zeta)
    build_scheduler(optimizer, total_steps=10, warmup_steps=0, min_lr=0.0, warmup_lr=0.0)  # applies lr_scale
    groups = _named_groups(optimizer, model)
    assert set(groups) == {name for name, _ in model.named_parameters()}
    assert {"patch_embed.proj.weight", "cls_token", "pos_embed", "head.weight"} <= set(groups)
    assert {"reg_token"} <= set(groups) if kwargs else {"dist_token", "head_dist.weight"} <= set(groups)
    for name, param in model.named_parameters():
        layer = _expected_layer(name, 12)
        assert layer_id(name, 12) == layer, name
        assert groups[name]["lr"] == pytest.approx(lr * zeta ** (13 - layer)), name
        no_decay = param.ndim <= 1 or name in ("cls_token", "dist_token", "reg_token", "pos_embed")
        assert groups[name]["weight_decay"] == (0.0 if no_decay else 0.05), name
    assert groups["blocks.11.attn.qkv.weight"]["lr"] == pytest.approx(lr * 0.75)  # the last block: zeta
    assert groups["blocks.0.mlp.fc1.weight"]["lr"] == pytest.approx(lr * 0.75 ** 12)  # block k: zeta^(L - k)
    assert groups["patch_embed.proj.weight"]["lr"] == pytest.approx(lr * 0.0238, rel=1e-2)  # the chapter's table
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)  # the logged lr is the head's


def test_layer_decay_agrees_with_timms_groups_but_for_the_final_norm():
    model = _vit12("vit_demo")  # class token only: timm's ViT stem and blocks are the chapter's layers
    ours = _named_groups(build_optimizer(model, "adamw", lr=1.0, weight_decay=0.05, layer_decay=0.65), model)
    timm_groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.65,
                                           no_weight_decay_list=model.no_weight_decay())
    by_id = {id(p): name for name, p in model.named_parameters()}
    for group in timm_groups:
        for param in group["params"]:
            name = by_id[id(param)]
            assert ours[name]["weight_decay"] == group["weight_decay"], name
            if name.startswith("norm."):
                # timm puts the final norm with the last block; the chapter's rule puts it with the head
                assert (ours[name]["lr_scale"], group["lr_scale"]) == (1.0, pytest.approx(0.65)), name
            else:
                assert ours[name]["lr_scale"] == pytest.approx(group["lr_scale"]), name


def test_layer_decay_scales_the_whole_schedule():
    model = _vit12("vit_demo")
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.8)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=2, min_lr=1e-5, warmup_lr=1e-6)
    embed = next(g for g in optimizer.param_groups if g["layer"] == 0)
    assert embed["lr"] == pytest.approx(1e-6 * 0.8 ** 13)  # the warm-up's start
    scheduler.step_update(num_updates=2)
    assert embed["lr"] == pytest.approx((1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * 2 / 10))) * 0.8 ** 13)


@pytest.mark.parametrize("zeta", [0.0, -0.5, 1.5])
def test_layer_decay_outside_0_1_is_refused(zeta):
    with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
        validate_config(compose_config([f"finetune.layer_decay={zeta}"]))


def test_layer_decay_on_a_model_without_blocks_is_refused():
    with pytest.raises(ConfigError, match="finetune.layer_decay=0.75 decays the lr over a ViT's `blocks`"):
        validate_config(compose_config(["model=cnn_demo", "finetune.layer_decay=0.75"]))


# --- a run --------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_deit3_pretrains_then_fine_tunes_with_layer_decay(tmp_path, data_cache):
    proc = run_train(["-m", "recipe=deit3", "stage=pretrain,finetune", "finetune.layer_decay=0.75",
                      "train.max_steps=2"] + TINY, tmp_path, data_cache)
    runs = sorted((tmp_path / "outputs" / "runs").glob("*/result.json"))
    assert len(runs) == 2 and all(json.loads(p.read_text())["status"] == "finished" for p in runs), proc.stdout[-2000:]
    logs = "".join(p.with_name("train.log").read_text() for p in runs)
    # TINY's ViT has one block: embeddings at 0.75^2, the block at 0.75, the head at 1
    assert "layer-wise lr decay zeta 0.75 over 1 blocks" in logs
    assert "0 (patch embed + prefix tokens) x0.5625, 1 (block 0) x0.75, 2 (norm + head) x1" in logs
