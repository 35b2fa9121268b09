"""Registers (Darcet et al. 2024) as prefix tokens, and the high-norm patch-token share logged at evaluation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.rundir import RESULT, runs_root
from deit_ablate.run.validate import validate_config
from deit_ablate.train.artifacts import HIGH_NORM_FACTOR, high_norm_counts, measures_high_norm, patch_grid
from deit_ablate.train.losses import distilled_head_logits
from deit_ablate.train.models import build_model, resize_pos_embed_state
from deit_ablate.train.trainer import evaluate
from tests.conftest import TINY, compose_config, run_train

PATCH, WIDTH = 8, 16


def tiny_vit(name: str = "deit_tiny_distilled_patch16_224", img_size: int = 32, reg_tokens: int = 4) -> nn.Module:
    """A one-block ViT of width 16 on 8 px patches, built as train.py builds it."""
    cfg = OmegaConf.create({"name": name, "dropout": 0.0, "drop_path": 0.0, "kwargs": {
        "patch_size": PATCH, "embed_dim": WIDTH, "depth": 1, "num_heads": 2, "reg_tokens": reg_tokens}})
    torch.manual_seed(0)
    return build_model(cfg, 10, img_size).eval()


def test_class_distillation_and_register_tokens_leave_the_patch_grid_exact():
    model = tiny_vit()
    assert model.num_prefix_tokens == 1 + 1 + 4
    model.blocks, model.norm = nn.Identity(), nn.Identity()  # output tokens = the input sequence, position added
    images = torch.randn(2, 3, 32, 32)
    tokens = model.forward_features(images)
    pos = model.pos_embed[0]
    assert tokens.shape == (2, 6 + 16, WIDTH)
    # the prefix rows, in order: class, distillation, 4 registers, each with its own position row
    torch.testing.assert_close(tokens[:, 0], (model.cls_token[0, 0] + pos[0]).expand(2, -1))
    torch.testing.assert_close(tokens[:, 1], (model.dist_token[0, 0] + pos[1]).expand(2, -1))
    torch.testing.assert_close(tokens[:, 2:6], (model.reg_token[0] + pos[2:6]).expand(2, -1, -1))
    # the grid: patch (r, c) is the patch embedding of the image's crop at (r, c) plus position row 6 + 4 r + c
    grid = patch_grid(tokens, model.num_prefix_tokens, model.patch_embed.grid_size)
    assert grid.shape == (2, 4, 4, WIDTH)
    weight, bias = model.patch_embed.proj.weight, model.patch_embed.proj.bias
    for r in range(4):
        for c in range(4):
            crop = images[:, :, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH]
            expected = crop.flatten(1) @ weight.flatten(1).T + bias + pos[6 + 4 * r + c]
            torch.testing.assert_close(grid[:, r, c], expected)
    # both heads read the class and distillation rows, not a register
    cls_logits, dist_logits = distilled_head_logits(model, images)
    torch.testing.assert_close(cls_logits, model.head(tokens[:, 0]))
    torch.testing.assert_close(dist_logits, model.head_dist(tokens[:, 1]))


def test_the_registers_take_part_in_the_forward_pass():
    model = tiny_vit()
    images = torch.randn(2, 3, 32, 32)
    before = model(images)
    with torch.no_grad():
        model.reg_token.normal_(std=10.0)  # the class token reads them through attention
    assert (model(images) - before).abs().max() > 1e-3
    plain = tiny_vit(name="deit_tiny_patch16_224", reg_tokens=1)
    assert plain.num_prefix_tokens == 2 and plain.pos_embed.shape[1] == 2 + 16


def test_average_pooling_skips_the_registers():
    model = tiny_vit(name="deit_tiny_patch16_224")
    pooled = build_model(OmegaConf.create({"name": "deit_tiny_patch16_224", "dropout": 0.0, "drop_path": 0.0,
                                           "kwargs": {"patch_size": PATCH, "embed_dim": WIDTH, "depth": 1,
                                                      "num_heads": 2, "reg_tokens": 4, "class_token": False,
                                                      "global_pool": "avg"}}), 10, 32).eval()
    assert model.num_prefix_tokens == 5 and pooled.num_prefix_tokens == 4
    tokens = pooled.forward_features(torch.randn(2, 3, 32, 32))
    torch.testing.assert_close(pooled.forward_head(tokens, pre_logits=True), pooled.fc_norm(tokens[:, 4:].mean(1)))


def test_the_finetune_resize_keeps_the_prefix_rows_and_resizes_only_the_grid():
    small, large = tiny_vit(img_size=32), tiny_vit(img_size=48)  # 4 x 4 patches, then 6 x 6
    state = resize_pos_embed_state(small.state_dict(), large)
    large.load_state_dict(state)
    src, out = small.pos_embed.detach(), state["pos_embed"]
    assert out.shape == (1, 6 + 36, WIDTH)
    torch.testing.assert_close(out[:, :6], src[:, :6])  # class, distillation, registers: untouched
    grid = src[:, 6:].reshape(1, 4, 4, WIDTH).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(6, 6), mode="bicubic", align_corners=False)
    torch.testing.assert_close(out[:, 6:], expected.permute(0, 2, 3, 1).reshape(1, 36, WIDTH))


def test_the_high_norm_share_equals_the_hand_count():
    # 2 images, 2 prefix tokens (never counted, however long), 5 patches each; norms chosen per token
    norms = torch.tensor([[99.0, 99.0, 1.0, 2.0, 2.0, 6.1, 5.9],    # median 2: 6.1 > 3 x 2, 5.9 is not
                          [0.0, 0.0, 10.0, 10.0, 10.0, 31.0, 90.0]])  # median 10: 31 and 90
    direction = F.normalize(torch.randn(2, 7, 4), dim=-1)
    tokens = direction * norms[..., None]
    assert HIGH_NORM_FACTOR == 3.0
    assert high_norm_counts(tokens, 2).tolist() == [3.0, 10.0]
    # per image, so halves of a batch (two ranks) add up to the whole
    halves = high_norm_counts(tokens[:1], 2) + high_norm_counts(tokens[1:], 2)
    assert halves.tolist() == [3.0, 10.0]


def outlier_images() -> torch.Tensor:
    """8 images, some with one patch 100 times brighter than the rest: high-norm tokens without a final norm."""
    torch.manual_seed(1)
    images = torch.randn(8, 3, 32, 32) * 0.1
    for index in range(0, 8, 3):
        images[index, :, 8:16, 16:24] *= 1000
    return images


def _evaluate_half(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = tiny_vit()
        model.norm = nn.Identity()
        images = outlier_images()[rank * 4:(rank + 1) * 4]
        loader = [(images[:2], torch.zeros(2, dtype=torch.long)), (images[2:], torch.ones(2, dtype=torch.long))]
        metrics = evaluate(model, loader, DistInfo(rank=rank, world_size=2))
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(metrics, f)


def test_evaluate_logs_the_high_norm_share_summed_over_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    model = tiny_vit()
    model.norm = nn.Identity()
    images = outlier_images()
    targets = torch.tensor([0, 0, 1, 1] * 2)
    alone = evaluate(model, [(images, targets)], DistInfo())
    tokens = model.forward_features(images)
    hand = 100 * high_norm_counts(tokens, 6)[0].item() / (8 * 16)
    assert alone["high_norm_tokens"] == pytest.approx(hand) and hand > 0
    mp.spawn(_evaluate_half, args=(str(tmp_path / "store"), str(tmp_path / "metrics")), nprocs=2, join=True)
    for rank in (0, 1):
        metrics = json.loads((tmp_path / f"metrics.{rank}").read_text())
        assert metrics["high_norm_tokens"] == pytest.approx(hand)
        assert metrics["top1"] == pytest.approx(alone["top1"])


def test_only_vits_are_measured():
    import timm

    assert measures_high_norm(tiny_vit()) and measures_high_norm(tiny_vit(name="deit_tiny_patch16_224"))
    assert not measures_high_norm(timm.create_model("resnet10t", num_classes=10))
    class_attention = build_model(OmegaConf.create({"name": "deit_tiny_patch16_224", "dropout": 0.0, "drop_path": 0.0,
                                                    "kwargs": {"patch_size": PATCH, "embed_dim": WIDTH, "depth": 1,
                                                               "num_heads": 2, "class_attn_depth": 1}}), 10, 32)
    assert not measures_high_norm(class_attention)  # its final norm sees the class embedding only
    cnn = timm.create_model("resnet10t", num_classes=10).eval()
    metrics = evaluate(cnn, [(torch.randn(2, 3, 32, 32), torch.tensor([0, 1]))], DistInfo())
    assert "high_norm_tokens" not in metrics


@pytest.mark.parametrize("count", [0, 1, 4])
def test_reg_tokens_compose_with_the_vit_and_its_distilled_twin(count, tmp_path):
    import timm

    teacher = tmp_path / "teacher.pt"
    torch.save({"model": timm.create_model("resnet10t", num_classes=10).state_dict()}, teacher)
    validate_config(compose_config(["model=vit_demo", f"+model.kwargs.reg_tokens={count}"]))
    validate_config(compose_config(["model=vit_demo", f"+model.kwargs.reg_tokens={count}", "distill=hard_token",
                                    f"distill.teacher.checkpoint={teacher}"]))


@pytest.mark.parametrize("overrides, message", [
    (["+model.kwargs.reg_tokens=-1"], "must be a whole number >= 0"),
    (["model=cnn_demo", "+model.kwargs.reg_tokens=4"], "register tokens exist for timm's ViT and DeiT"),
    (["cait=ca_12_2", "+model.kwargs.reg_tokens=1"], "the class-attention stage reads patches only"),
])
def test_reg_tokens_are_refused_where_there_is_no_place_for_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(["model=vit_demo", *overrides]))


@pytest.mark.slow
def test_a_run_with_four_registers_trains_and_logs_the_high_norm_share(tmp_path, data_cache):
    run_train(TINY + ["+model.kwargs.reg_tokens=4", "train.max_steps=2"], tmp_path, data_cache)
    [result] = [json.loads(p.read_text()) for p in runs_root(tmp_path / "outputs").glob(f"*/{RESULT}")]
    assert result["status"] == "finished" and 0.0 <= result["high_norm_tokens"] <= 100.0
    [metrics] = runs_root(tmp_path / "outputs").glob("*/metrics.csv")
    assert "val/high_norm_tokens" in metrics.read_text().splitlines()[0].split(",")
