"""The recipe against its definition: drop path, weight decay, lr rule, Mixup/CutMix, repeated augmentation."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from timm.data import Mixup
from timm.data.distributed_sampler import RepeatAugSampler
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch.utils.data import DistributedSampler

from deit_ablate.data.loader import build_train_sampler
from deit_ablate.train.losses import build_criterion, build_mixup
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler, scaled_lr
from tests.conftest import compose_config


def drop_path_rates(model: torch.nn.Module) -> list[float]:
    """The stochastic-depth rate of each residual block, in order (0 where a block has none)."""
    return [float(getattr(getattr(block, "drop_path1", None), "drop_prob", 0.0)) for block in model.blocks]


def weight_decay_groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, float]:
    """Parameter name -> the weight decay the optimizer applies to it."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)]: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}


def _tiny_vit(cfg, depth=4):
    cfg.model.kwargs.depth = depth
    return build_model(cfg.model, num_classes=10, img_size=32)


def test_drop_path_rates_are_linspace_from_zero():
    cfg = compose_config(["model.drop_path=0.1"])
    model = _tiny_vit(cfg, depth=6)
    expected = [0.1 * i / 5 for i in range(6)]  # timm / DeiT: linspace(0, p, depth), first block 0
    assert drop_path_rates(model) == pytest.approx(expected)
    assert drop_path_rates(model)[0] == 0.0


def test_paper_model_has_the_same_drop_path_schedule():
    cfg = compose_config(["preset=paper"])
    model = build_model(cfg.model, num_classes=1000, img_size=224)
    assert len(model.blocks) == 12 and model.embed_dim == 768
    assert drop_path_rates(model) == pytest.approx(np.linspace(0, 0.1, 12).tolist())


@pytest.mark.parametrize("preset", ["demo", "paper"])
def test_attention_runs_through_pytorch_sdpa(preset):
    from timm.models.vision_transformer import Attention

    cfg = compose_config([f"preset={preset}"])
    model = build_model(cfg.model, num_classes=10, img_size=cfg.resolution.train_size)
    attention = [module for module in model.modules() if isinstance(module, Attention)]
    assert attention and all(module.fused_attn for module in attention)  # F.scaled_dot_product_attention


def test_dropout_row_sets_every_dropout_of_deit():
    cfg = compose_config(["ablation=dropout"])
    model = _tiny_vit(cfg)
    assert model.pos_drop.p == 0.1 and model.blocks[0].mlp.drop1.p == 0.1 and model.blocks[0].attn.proj_drop.p == 0.1
    assert model.head_drop.p == 0.0  # timm 0.3.2's ViT, which DeiT trained with, had no dropout before the head


@pytest.mark.parametrize("model_option", ["vit_demo", "vit_demo_distilled"])
def test_weight_decay_skips_1d_params_tokens_and_position_table(model_option):
    cfg = compose_config([f"model={model_option}"])
    model = _tiny_vit(cfg, depth=2)
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05)
    decay = weight_decay_groups(optimizer, model)
    assert set(decay) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        no_decay = param.ndim <= 1 or name in ("cls_token", "dist_token", "pos_embed")
        assert decay[name] == (0.0 if no_decay else 0.05), name
    assert decay["blocks.0.attn.qkv.weight"] == 0.05 and decay["blocks.0.norm1.weight"] == 0.0
    assert decay["pos_embed"] == 0.0 and decay["cls_token"] == 0.0
    if model_option.endswith("distilled"):
        assert decay["dist_token"] == 0.0 and decay["head_dist.weight"] == 0.05


def test_adamw_and_sgd_settings():
    model = torch.nn.Linear(4, 2)
    adamw = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999), eps=1e-8)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.9, 0.999)
    sgd = build_optimizer(model, "sgd", lr=1e-3, weight_decay=0.05, momentum=0.9)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9


@pytest.mark.parametrize(("global_batch", "expected"), [(512, 5e-4), (1024, 1e-3), (256, 2.5e-4), (128, 1.25e-4)])
def test_lr_scales_linearly_from_512(global_batch, expected):
    assert scaled_lr(5e-4, global_batch) == pytest.approx(expected)


def test_schedule_warms_up_linearly_then_cosine_to_min_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = build_scheduler(optimizer, total_steps=100, warmup_steps=10, min_lr=1e-5, warmup_lr=1e-6)
    lrs = []
    for step in range(1, 101):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step_update(step)
    assert lrs[0] == pytest.approx(1e-6)
    assert lrs[5] == pytest.approx(1e-6 + 5 * (1e-3 - 1e-6) / 10)
    # timm 0.3.2 as DeiT built it (no warm-up prefix): one cosine over the whole run, its start replaced by warm-up.
    for step in (10, 55, 99):
        cosine = 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * step / 100))
        assert lrs[step] == pytest.approx(cosine, rel=1e-6)
    assert min(lrs[10:]) >= 1e-5 - 1e-12


def test_a_floor_above_the_peak_is_lowered_to_it_so_the_schedule_never_rises():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=2.5e-5)
    with pytest.warns(UserWarning, match="above the peak lr"):
        scheduler = build_scheduler(optimizer, total_steps=20, warmup_steps=0, min_lr=5e-5, warmup_lr=1e-6)
    lrs = []
    for step in range(1, 21):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step_update(step)
    assert max(lrs) == pytest.approx(2.5e-5) and all(b <= a + 1e-15 for a, b in zip(lrs, lrs[1:], strict=False))


def test_mixup_gets_deits_beta_alphas_and_switch_probability():
    cfg = compose_config([])
    mixup = build_mixup(cfg.mix, num_classes=10)
    assert isinstance(mixup, Mixup)
    assert mixup.mixup_alpha == 0.8 and mixup.cutmix_alpha == 1.0  # Beta(0.8, 0.8) and Beta(1, 1)
    assert mixup.mix_prob == 1.0 and mixup.switch_prob == 0.5 and mixup.mode == "batch"
    assert mixup.label_smoothing == 0.1 and mixup.correct_lam  # CutMix's lambda from the clipped box area
    assert isinstance(build_criterion(cfg.mix, mixup), SoftTargetCrossEntropy)


def test_mixup_draws_lambda_from_the_beta_distribution():
    cfg = compose_config(["mix=mixup_only"])
    mixup = build_mixup(cfg.mix, num_classes=10)
    np.random.seed(0)
    lams = np.array([mixup._params_per_batch()[0] for _ in range(4000)])
    # Beta(0.8, 0.8): mean 0.5, variance a^2 / ((2a)^2 (2a + 1)) = 1 / (4 (2a + 1)) = 0.0962
    assert lams.mean() == pytest.approx(0.5, abs=0.02)
    assert lams.var() == pytest.approx(1 / (4 * 2.6), rel=0.08)


def test_one_of_mixup_or_cutmix_per_batch_half_the_time():
    cfg = compose_config([])
    mixup = build_mixup(cfg.mix, num_classes=10)
    np.random.seed(1)
    use_cutmix = [mixup._params_per_batch()[1] for _ in range(4000)]
    assert np.mean(use_cutmix) == pytest.approx(0.5, abs=0.03)


def test_no_mixing_uses_label_smoothing_on_integer_labels():
    cfg = compose_config(["mix=none"])
    assert build_mixup(cfg.mix, 10) is None
    criterion = build_criterion(cfg.mix, None)
    assert isinstance(criterion, LabelSmoothingCrossEntropy) and criterion.smoothing == 0.1


def _slot_indices(length: int, repeats: int, slots: int, micro: int, epoch: int = 0) -> list[list[int]]:
    """Each virtual slot's indices of one epoch, from a process that computes every slot."""
    sampler = build_train_sampler(length, repeats, slots, tuple(range(slots)), micro)
    sampler.set_epoch(epoch)
    flat, per_slot = list(sampler), [[] for _ in range(slots)]
    for position, index in enumerate(flat):  # step by step: slot 0's micro-batch, slot 1's, ...
        per_slot[position // micro % slots].append(index)
    return per_slot


@pytest.mark.parametrize(("length", "repeats", "slots", "micro"), [(1024, 3, 8, 16), (600, 3, 4, 8), (100, 3, 3, 5),
                                                                   (100, 1, 4, 5)])
def test_each_slot_is_what_the_released_sampler_deals_to_that_gpu(length, repeats, slots, micro):
    # DeiT's RASampler (timm's RepeatAugSampler) on `slots` GPUs, and torch's DistributedSampler without repeats
    dataset = list(range(length))
    for slot, ours in enumerate(_slot_indices(length, repeats, slots, micro, epoch=5)):
        reference = RepeatAugSampler(dataset, num_replicas=slots, rank=slot, num_repeats=repeats) if repeats > 1 \
            else DistributedSampler(dataset, num_replicas=slots, rank=slot, shuffle=True, seed=0, drop_last=True)
        reference.set_epoch(5)
        expected = list(reference)
        assert ours == expected[:len(expected) // micro * micro]  # whole steps only


def test_repeated_augmentation_in_one_process_cuts_the_epoch_to_the_dataset():
    per_slot = _slot_indices(600, 3, 1, 8)
    assert sum(map(len, per_slot)) == 512  # DeiT: an epoch is cut back to the dataset size, rounded down to 256s


@pytest.mark.parametrize("slots", [3, 4, 8])
def test_the_copies_of_an_image_land_in_different_slots(slots):
    where, per_slot = defaultdict(list), _slot_indices(1024, 3, slots, 8)
    for slot, indices in enumerate(per_slot):
        for index in indices:
            where[index].append(slot)
    full = [found for found in where.values() if len(found) == 3]
    assert len(full) > 250 and all(len(set(found)) == 3 for found in full)  # three copies, three slots
    assert len(where) >= sum(map(len, per_slot)) // 3  # a third of the epoch's images, each seen three times


def test_any_layout_computes_the_same_slots():
    # one process with every slot; two processes of four; eight of one: the same images in each slot and step
    length, slots, micro = 1024, 8, 16
    expected = _slot_indices(length, 3, slots, micro, epoch=2)
    for world in (2, 8):
        per_process = slots // world
        for rank in range(world):
            own = tuple(range(rank * per_process, (rank + 1) * per_process))
            sampler = build_train_sampler(length, 3, slots, own, micro)
            sampler.set_epoch(2)
            flat = list(sampler)
            for position, index in enumerate(flat):
                slot = own[position // micro % per_process]
                step, within = divmod(position, micro * per_process)
                assert index == expected[slot][step * micro + within % micro]


def test_without_repeats_the_slots_partition_the_data():
    shards = _slot_indices(100, 1, 4, 25, epoch=3)
    assert sorted(i for shard in shards for i in shard) == list(range(100))
