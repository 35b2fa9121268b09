"""Names that say what trained: the start line and result.json give the architecture the run built."""

from __future__ import annotations

import json

import pytest
import timm

from deit_ablate.aggregate.reader import read_offline
from deit_ablate.models import architecture, build_model, describe_architecture
from tests.conftest import TINY, compose_config, run_train

# TINY's overrides alone are longer than a folder name keeps.
LONG = TINY + ["train.max_steps=1"]


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_start_line_and_the_result_name_the_architecture_that_trained(tmp_path, data_cache):
    args = LONG + ["model.kwargs.patch_size=4"]
    proc = run_train(args, tmp_path, data_cache)
    cfg = compose_config(args)
    model = build_model(cfg.model, 10, 32)
    millions = f"{_params(model) / 1e6:.2f} M params"
    assert f"of deit_tiny_patch16_224 (patch 4, width 32, depth 1, heads 2, {millions})" in proc.stdout
    (run,) = (tmp_path / "outputs" / "runs").iterdir()
    result = json.loads((run / "result.json").read_text())
    expected = {"name": "deit_tiny_patch16_224", "patch_size": 4, "width": 32, "depth": 1, "heads": 2,
                "params": _params(model)}
    assert result["architecture"] == expected
    (logged,) = read_offline(tmp_path / "outputs" / "wandb")
    assert logged.summary["architecture"] == expected


@pytest.mark.parametrize(("overrides", "text"), [
    (["cait=ca_12_2"], "patch 8, width 128, depth 4 + 1 class-attention, heads 4"),
    (["cait=cait_s36"], "patch 8, width 128, depth 12 + 2 class-attention, heads 8"),
    (["cait=talking_heads"], "patch 8, width 128, depth 4, heads 4"),
    (["distill=hard_token"], "patch 8, width 128, depth 6, heads 4"),
])
def test_vits_and_cait_are_described_from_the_built_model(overrides, text):
    from deit_ablate.models import student_model_name

    cfg = compose_config(overrides)
    name = student_model_name(cfg)
    model = build_model(cfg.model, 10, 32, name=name)
    arch = architecture(model, name)
    assert describe_architecture(arch) == f"{name} ({text}, {_params(model) / 1e6:.2f} M params)"
    assert arch["params"] == _params(model)


def test_a_cnn_is_described_by_its_parameters():
    model = timm.create_model("resnet10t", num_classes=10)
    arch = architecture(model, "resnet10t")
    assert arch == {"name": "resnet10t", "params": _params(model)}
    assert describe_architecture(arch) == f"resnet10t ({_params(model) / 1e6:.2f} M params)"
