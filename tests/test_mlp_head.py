"""model.head=mlp_tanh, the original ViT's pre-training head (Dosovitskiy et al. 2021, section 3.1): its definition,
the models that take it, the vit_original recipe's pre-training, and what a fine-tune and a transfer do with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deit_ablate.config.stage_config import stage_config
from deit_ablate.core.errors import ConfigError
from deit_ablate.run.stages import load_backbone, load_pretrained
from deit_ablate.run.validate import validate_config
from deit_ablate.train.models import MlpHead, build_model
from tests.conftest import compose_config, identity_of

SMALL = ["model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"]


def _model(overrides: list[str], num_classes: int = 10, size: int = 32, seed: int = 0) -> nn.Module:
    cfg = compose_config([*SMALL, *overrides])
    torch.manual_seed(seed)
    return build_model(stage_config(cfg).model, num_classes, size).eval()


def test_the_mlp_head_is_w2_tanh_w1_x_plus_b1_plus_b2_on_the_class_tokens_final_feature():
    model = _model(["model.head=mlp_tanh"])
    head = model.head
    assert isinstance(head, MlpHead) and head.pre_logits.weight.shape == (32, 32) and head.fc.weight.shape == (10, 32)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        cls = model.forward_features(x)[:, 0]  # the class token after the final norm
        w1, b1, w2, b2 = head.pre_logits.weight, head.pre_logits.bias, head.fc.weight, head.fc.bias
        by_hand = torch.stack([w2 @ torch.tanh(w1 @ c + b1) + b2 for c in cls])
        assert torch.allclose(model(x), by_hand, atol=1e-5)
        assert not torch.allclose(model(x), cls @ w2.T + b2, atol=1e-3)  # not the classifier alone
    assert isinstance(_model([]).head, nn.Linear)  # DeiT's single linear layer stays the default


def test_the_default_leaves_every_run_id_and_the_mlp_head_is_another_run():
    assert identity_of(["model.head=linear"]).digest == identity_of([]).digest
    assert identity_of(["model.head=mlp_tanh"]).digest != identity_of([]).digest


def test_vit_original_pretrains_with_it_and_the_resnet_row_keeps_its_own_classifier():
    assert compose_config(["recipe=vit_original"]).model.head == "mlp_tanh"
    assert compose_config(["sam=baseline"]).model.head == "mlp_tanh"
    assert compose_config(["sam=resnet152"]).model.head == "linear"
    assert compose_config(["sam=resnet152_rho_005"]).model.head == "linear"
    assert compose_config(["sam=mixer_rho_02"]).model.head == "linear"  # the Mixer's own classifier
    assert compose_config(["sam=hybrid"]).model.head == "mlp_tanh"  # a ViT on ResNet features: ViT's head
    assert compose_config([]).model.head == "linear"


@pytest.mark.parametrize("overrides, message", [
    (["model=cnn_demo", "model.head=mlp_tanh"], "resnet10t is not timm's ViT"),
    (["cait=cait_s36", "model.head=mlp_tanh"], "is not timm's ViT"),
    (["recipe=vit_original", "distill=hard_token", "distill.teacher.checkpoint=x.pt"],
     "deit_tiny_distilled_patch16_224 is a DeiT with a distillation token"),
])
def test_a_model_that_cannot_take_it_is_refused_before_a_run_starts(overrides, message):
    with pytest.raises(ConfigError, match=rf"model.head=mlp_tanh .*{message}.*Set model.head=linear"):
        validate_config(compose_config(overrides))


def test_a_fine_tune_keeps_the_pre_logits_layer_it_pre_trained(tmp_path: Path):
    source = _model(["recipe=vit_original"], seed=0)
    torch.save({"model": source.state_dict(), "step": 1}, tmp_path / "checkpoint-last.pt")
    target = _model(["recipe=vit_original", "stage=finetune"], size=48, seed=1)
    assert isinstance(target.head, MlpHead)
    load_pretrained(target, tmp_path / "checkpoint-last.pt")
    for key in ("head.pre_logits.weight", "head.pre_logits.bias", "head.fc.weight", "head.fc.bias"):
        assert torch.equal(target.state_dict()[key], source.state_dict()[key]), key


def test_a_transfer_drops_the_pre_logits_layer_with_the_classifier_and_gets_a_linear_head(tmp_path: Path):
    source = _model(["recipe=vit_original"], seed=0)
    torch.save({"model": source.state_dict(), "step": 1}, tmp_path / "checkpoint-last.pt")
    target = _model(["recipe=vit_original", "stage=transfer"], num_classes=7, size=48, seed=1)
    assert isinstance(target.head, nn.Linear) and target.head.weight.shape == (7, 32)
    new_head = {k: v.clone() for k, v in target.head.state_dict().items()}
    assert load_backbone(target, tmp_path / "checkpoint-last.pt") == ("head",)
    assert all(torch.equal(v, new_head[k]) for k, v in target.head.state_dict().items())
    assert not any(k.startswith("head.pre_logits") for k in target.state_dict())
    before = source.state_dict()
    for key, value in target.state_dict().items():
        if not key.startswith(("head", "pos_embed")):
            assert torch.equal(value, before[key]), key
