"""The sam study's other networks: MLP-Mixer-B/16 and the hybrid R50+ViT-B/16 (Chen, Hsieh & Gong 2022), built from
their model options at both scales, never with weights, and everything model-specific the project does to a network
(dropout, weight-decay groups, layer-wise lr decay, SAM's step, the sharpness figures, a resolution change) works on
them at demo size."""

from __future__ import annotations

import pytest
import torch
from timm.models.mlp_mixer import MlpMixer

from deit_ablate.core.errors import ConfigError
from deit_ablate.run.stages import load_pretrained
from deit_ablate.run.validate import validate_config
from deit_ablate.train.models import build_mixer, build_model
from deit_ablate.train.optim import build_optimizer, layer_decay_groups
from deit_ablate.train.sharpness import SharpnessSettings, measure
from tests.conftest import compose_config
from tests.test_sam import _trainer

MODELS = ("mixer_b16", "vit_hybrid_r50_b16")
# timm's names and parameter counts at paper scale (1000 classes): Mixer-B/16 59.9 M (the paper's 59 M), the hybrid
# 98.7 M (ViT-B/16's 86.6 M plus ResNet-50's first three stages)
PAPER = {"mixer_b16": ("mixer_b16_224", 59_880_472), "vit_hybrid_r50_b16": ("vit_base_r50_s16_224", 98_659_112)}


def _cfg(model: str, preset: str = "demo", *more: str):
    """The network under the ViT recipe, with timm's linear classifier (the recipe's MLP head is a ViT's only)."""
    return compose_config([f"model={model}", f"preset={preset}", "recipe=vit_original", "model.head=linear", *more])


def _demo(model: str, img_size: int | None = None) -> torch.nn.Module:
    cfg = _cfg(model)
    torch.manual_seed(0)
    return build_model(cfg.model, cfg.data.num_classes, img_size or cfg.resolution.train_size)


@pytest.mark.parametrize("model", MODELS)
def test_paper_scale_is_the_papers_network_and_no_weights_are_loaded(model: str, monkeypatch) -> None:
    import timm.models._builder as builder

    monkeypatch.setattr(builder, "load_pretrained", lambda *a, **k: pytest.fail("weights were loaded"))
    cfg = _cfg(model, "paper")
    name, params = PAPER[model]
    assert cfg.model.name == name and cfg.resolution.train_size == 224
    with torch.device("meta"):
        built = build_model(cfg.model, cfg.data.num_classes, 224)
    assert sum(p.numel() for p in built.parameters()) == params


def test_the_mixer_built_by_size_is_timms_named_mixer() -> None:
    import timm

    with torch.device("meta"):
        named = timm.create_model("mixer_b16_224", pretrained=False)
        sized = build_mixer("mixer_b16_224", patch_size=16, num_blocks=12, embed_dim=768)
        plain = build_mixer("mixer_b16_224")  # no size given: the name's
    shapes = {k: v.shape for k, v in named.state_dict().items()}
    assert {k: v.shape for k, v in sized.state_dict().items()} == shapes
    assert {k: v.shape for k, v in plain.state_dict().items()} == shapes


def test_demo_sizes_read_32px_images_in_16_tokens_at_the_demo_vits_width() -> None:
    mixer, hybrid = _demo("mixer_b16"), _demo("vit_hybrid_r50_b16")
    assert isinstance(mixer, MlpMixer) and len(mixer.blocks) == 6 and mixer.embed_dim == 128
    assert mixer.stem.num_patches == 16 and mixer.stem.patch_size == (8, 8)
    assert hybrid.patch_embed.grid_size == (4, 4) and len(hybrid.blocks) == 6 and hybrid.embed_dim == 128
    assert hybrid.blocks[0].attn.num_heads == 4
    assert sum(p.numel() for p in mixer.parameters()) < 2e6 and sum(p.numel() for p in hybrid.parameters()) < 2e6


@pytest.mark.parametrize("model", MODELS)
def test_dropout_goes_where_vits_goes_not_before_the_head(model: str) -> None:
    built = _demo(model)  # the recipe's model.dropout 0.1
    rates = {name: m.p for name, m in built.named_modules() if isinstance(m, torch.nn.Dropout) and m.p}
    assert rates and set(rates.values()) == {0.1}
    assert not any(name.startswith("head") for name in rates)  # timm's drop_rate, before the head: off
    assert all(".mlp" in name or ".attn" in name or name == "pos_drop" for name in rates)
    assert sum(".mlp" in name for name in rates) == 6 * (4 if model == "mixer_b16" else 2)


@pytest.mark.parametrize("model", MODELS)
def test_a_sam_step_runs_forward_and_backward_twice_and_moves_every_weight(model: str) -> None:
    built = _demo(model)
    before = {n: p.detach().clone() for n, p in built.named_parameters()}
    forwards = []
    built.register_forward_hook(lambda *args: forwards.append(1))
    criterion = torch.nn.CrossEntropyLoss()
    trainer = _trainer(built, 0.2, build_optimizer(built, "adamw", lr=1e-3, weight_decay=0.3),
                       loss_fn=lambda images, outputs, targets: criterion(outputs, targets), clip_grad=1.0)
    generator = torch.Generator().manual_seed(1)
    images, targets = torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,), generator=generator)
    assert torch.isfinite(trainer.train_step(images, targets))
    assert len(forwards) == 2
    assert all(not torch.equal(p, before[n]) for n, p in built.named_parameters()), "a weight did not move"


@pytest.mark.parametrize("model", MODELS)
def test_weight_decay_skips_biases_norms_and_position_table(model: str) -> None:
    built = _demo(model)
    optimizer = build_optimizer(built, "adamw", lr=1e-3, weight_decay=0.3)
    names = {id(p): n for n, p in built.named_parameters()}
    skipped = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.3 for p in g["params"]}
    assert skipped | decayed == set(names.values()) and not skipped & decayed
    assert all(built.get_parameter(n).ndim <= 1 or n in ("pos_embed", "cls_token") for n in skipped)
    assert all(built.get_parameter(n).ndim > 1 and n not in ("pos_embed", "cls_token") for n in decayed)
    if model == "vit_hybrid_r50_b16":
        assert {"pos_embed", "cls_token"} <= skipped
        assert any(n.startswith("patch_embed.backbone.") for n in decayed)  # the ResNet stem's convolution


def test_layer_wise_lr_decay_puts_the_mixers_stem_in_layer_0() -> None:
    mixer = _demo("mixer_b16")
    layers = {n: g["layer"] for g in layer_decay_groups(mixer, 0.05, 0.65) for n in g["param_names"]}
    assert {layers[n] for n in layers if n.startswith("stem.")} == {0}
    assert layers["blocks.0.norm1.weight"] == 1 and layers["head.weight"] == 7


@pytest.mark.parametrize("model", MODELS)
def test_the_sharpness_figures_measure_them(model: str) -> None:
    built = _demo(model)
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,), generator=generator))]
    figures = measure(built, batches, SharpnessSettings(images=4, batch_size=4, iters=2, draws=1), False)
    assert all(torch.isfinite(torch.tensor(figures[k])) for k in ("lambda_max", "train_loss", "noisy_loss"))
    assert figures["settings"]["parameters"] == sum(p.numel() for p in built.parameters())


def test_the_hybrid_fine_tunes_at_another_size_its_position_table_resampled(tmp_path) -> None:
    small = _demo("vit_hybrid_r50_b16")
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": small.state_dict()}, path)
    large = _demo("vit_hybrid_r50_b16", img_size=48)  # the demo's fine-tune size: 6 x 6 tokens
    load_pretrained(large, path)
    assert large.pos_embed.shape == (1, 37, 128)
    assert torch.equal(large.pos_embed[:, 0], small.pos_embed[:, 0])  # the class token's row kept
    assert torch.equal(large.patch_embed.backbone.conv.weight, small.patch_embed.backbone.conv.weight)
    assert large(torch.randn(2, 3, 48, 48)).shape == (2, 10)


def test_the_mixer_fine_tunes_only_at_the_size_it_pre_trained_at() -> None:
    with pytest.raises(ConfigError, match="token-mixing MLPs are sized to the patch grid") as error:
        validate_config(_cfg("mixer_b16", "demo", "stage=finetune"))
    assert "finetune.pretrain_size" in str(error.value) and "\n" not in str(error.value)
    validate_config(_cfg("mixer_b16", "demo", "stage=finetune", "resolution=32px", "finetune.pretrain_size=32"))
