"""train.amp=fp16, the released DeiT code's precision: fp16 autocast + a loss scaler that skips steps with inf/NaN
gradients, counted, logged, checkpointed and resumed exactly. It runs on the CPU too (torch 2.14)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from timm.utils import ModelEmaV3

from deit_ablate.bench.timm_ref import timm_args
from deit_ablate.core.distributed import DistInfo
from deit_ablate.record.rundir import RunDir, rank_log_name
from deit_ablate.run.assemble import amp_dtype, build_pieces, grad_scaler
from deit_ablate.run.plan import make_plan
from deit_ablate.run.validate import validate_config
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler
from deit_ablate.train.trainer import Trainer
from tests.conftest import TINY, compose_config, train_straight_and_resumed

CPU = torch.device("cpu")


def _model() -> torch.nn.Module:
    cfg = compose_config(["model.drop_path=0", "model.kwargs.depth=1", "model.kwargs.embed_dim=32",
                          "model.kwargs.num_heads=2"])
    torch.manual_seed(0)
    return build_model(cfg.model, num_classes=10, img_size=32)


def _trainer(model: torch.nn.Module, fp16: bool, clip_grad: float | None = None) -> Trainer:
    optimizer = build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=0, min_lr=1e-5, warmup_lr=1e-6)
    criterion = torch.nn.CrossEntropyLoss()
    setting = "fp16" if fp16 else "fp32"
    return Trainer(model=model, optimizer=optimizer, scheduler=scheduler,
                   loss_fn=lambda images, outputs, targets: criterion(outputs, targets), info=DistInfo(),
                   amp_dtype=amp_dtype(setting, CPU), scaler=grad_scaler(setting, CPU), clip_grad=clip_grad)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_fp16_runs_in_half_precision_on_the_cpu():
    trainer = _trainer(_model(), fp16=True)
    images, _ = _batch()
    with trainer.autocast():
        assert trainer.model(images).dtype == torch.float16  # autocast is not silently off on this device
    assert isinstance(trainer.scaler, torch.amp.GradScaler) and trainer.scaler.is_enabled()
    state = trainer.scaler.state_dict()  # GradScaler's definition, which the README documents
    assert (state["scale"], state["backoff_factor"], state["growth_factor"], state["growth_interval"]) == \
        (2.0**16, 0.5, 2.0, 2000)


@pytest.mark.parametrize("clip_grad", [None, 1.0])
def test_a_step_with_an_inf_gradient_is_skipped_counted_and_halves_the_scale(clip_grad):
    model = _model()
    trainer = _trainer(model, fp16=True, clip_grad=clip_grad)
    trainer.ema = ModelEmaV3(model, decay=0.5)
    # From 2**16 this model's first fp16 backward overflows (a real skip); from 2**10 it does not.
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 2.0**10})
    images, targets = _batch()
    trainer.train_step(images, targets)  # a good step: the weights move, nothing is skipped
    after_good = _params(model)
    assert any(not torch.equal(after_good[n], p) for n, p in _params(_model()).items())
    assert trainer.amp_skipped_steps == 0 and trainer.scaler.get_scale() == 2.0**10
    # A finite loss whose scaled gradient overflows float32: the case the scaler exists for.
    criterion = torch.nn.CrossEntropyLoss()
    trainer.loss_fn = lambda images, outputs, targets: criterion(outputs, targets) * 1e34
    adam_state = copy.deepcopy(trainer.optimizer.state_dict()["state"])
    lr_before = trainer.optimizer.param_groups[0]["lr"]
    with torch.no_grad():  # an EMA apart from the weights, so that an update shows
        for param in trainer.ema.module.parameters():
            param.add_(1.0)
    ema_before = _params(trainer.ema.module)
    loss = trainer.train_step(images, targets)
    assert torch.isfinite(loss)
    for name, param in _params(model).items():
        assert torch.equal(param, after_good[name]), name  # the optimizer step was skipped
    for index, state in trainer.optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], adam_state[index]["exp_avg"])  # nor did Adam's moments move
    assert trainer.amp_skipped_steps == 1
    assert trainer.scaler.get_scale() == 2.0**10 * 0.5  # backoff 0.5
    assert trainer.scaler.state_dict()["_growth_tracker"] == 0
    # The step counter, the schedule and the EMA still advance (documented in Trainer.train_step).
    assert trainer.step == 2 and trainer.optimizer.param_groups[0]["lr"] != lr_before
    ema_after = _params(trainer.ema.module)
    assert any(not torch.equal(ema_before[name], ema_after[name]) for name in ema_after)  # toward the kept weights
    metrics = trainer.amp_metrics()
    assert metrics == {"train/loss_scale": 2.0**9, "train/amp_skipped_steps": 1}


def test_clipping_under_fp16_sees_the_true_gradients():
    """A clip bound above the true gradient norm leaves the step as it is; on the scaled gradients it would cut."""
    images, targets = _batch()
    weights = {}
    for clip_grad in (None, 100.0):
        model = _model()
        trainer = _trainer(model, fp16=True, clip_grad=clip_grad)
        trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 2.0**10})
        trainer.train_step(images, targets)
        assert trainer.amp_skipped_steps == 0
        weights[clip_grad] = _params(model)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        assert norm < 100.0 < norm * 2.0**10  # the bound lies between the true and the scaled norm
    for name, tensor in weights[None].items():
        assert torch.equal(tensor, weights[100.0][name]), name


def test_scale_doubles_after_2000_good_steps_and_the_state_round_trips():
    trainer = _trainer(_model(), fp16=True)
    images, targets = _batch()
    trainer.step = 5
    state = trainer.state_dict()
    assert state["amp_skipped_steps"] == 0 and state["scaler"]["scale"] == 2.0**16
    state["scaler"] = {**state["scaler"], "scale": 1024.0, "_growth_tracker": 1999}
    state["amp_skipped_steps"] = 7
    resumed = _trainer(_model(), fp16=True)
    resumed.load_state_dict(state)
    assert resumed.amp_skipped_steps == 7 and resumed.scaler.get_scale() == 1024.0
    resumed.train_step(images, targets)  # the 2000th good step in a row
    assert resumed.scaler.get_scale() == 2048.0 and resumed.scaler.state_dict()["_growth_tracker"] == 0
    assert resumed.amp_skipped_steps == 7 and resumed.state_dict()["amp_skipped_steps"] == 7


def test_a_checkpoint_without_a_scaler_still_loads_under_fp16():
    old = _trainer(_model(), fp16=False)
    old.step = 3
    state = old.state_dict()
    assert "scaler" not in state and "amp_skipped_steps" not in state
    trainer = _trainer(_model(), fp16=True)
    trainer.load_state_dict(state)
    assert trainer.step == 3 and trainer.scaler.get_scale() == 2.0**16 and trainer.amp_skipped_steps == 0


@pytest.mark.parametrize("fp16", [True, False])
def test_fp16_log_rows_carry_the_scale_and_the_skipped_steps_and_others_do_not(fp16):
    trainer = _trainer(_model(), fp16=fp16)
    trainer.log_interval = 1
    rows = []
    trainer.on_log = lambda metrics, step: rows.append(metrics)
    trainer.train_steps([_batch()] * 2, epoch=0)
    assert len(rows) == 2 and all("train/loss" in row for row in rows)
    if fp16:  # this model's first fp16 backward overflows at 2**16: skipped, the scale halved; the next is good
        assert [(r["train/amp_skipped_steps"], r["train/loss_scale"]) for r in rows] == [(1, 2.0**15)] * 2
        assert trainer.amp_skipped_steps == 1 and trainer.step == 2
    else:
        assert not {"train/loss_scale", "train/amp_skipped_steps"} & set(rows[-1])


@pytest.mark.parametrize("setting", ["auto", "bf16", "fp32"])
def test_other_precisions_build_no_scaler_and_step_as_before(setting):
    assert grad_scaler(setting, CPU) is None and grad_scaler(setting, torch.device("cuda")) is None
    assert amp_dtype(setting, torch.device("cuda")) == (None if setting == "fp32" else torch.bfloat16)
    model = _model()
    twin = copy.deepcopy(model)
    trainer = _trainer(model, fp16=False, clip_grad=1.0)
    trainer.amp_dtype = amp_dtype(setting, CPU)  # bf16 on the CPU when asked, as run.py builds it
    assert trainer.scaler is None and "scaler" not in trainer.state_dict()
    images, targets = _batch()
    trainer.train_step(images, targets)
    # The step as it was written before fp16: plain backward, clip, optimizer step (bit for bit).
    reference = _trainer(twin, fp16=False)
    reference.optimizer.zero_grad(set_to_none=True)
    with trainer.autocast():
        loss = torch.nn.CrossEntropyLoss()(twin(images), targets)
    (loss / 1).backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    reference.optimizer.step()
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_run_builds_the_scaler_only_for_fp16(data_cache, tmp_path):
    root = f"data.root={data_cache / 'builtin'}"
    for setting, expected in (("fp16", torch.float16), ("auto", None)):
        cfg = compose_config(TINY + [root, f"train.amp={setting}"])
        validate_config(cfg)  # fp16 runs on this CPU: nothing to refuse
        trainer = build_pieces(make_plan(cfg, DistInfo(), RunDir(tmp_path), []), DistInfo()).trainer
        assert trainer.amp_dtype == expected
        assert (trainer.scaler is not None) == (setting == "fp16")


def test_timm_reference_gets_fp16_with_its_loss_scaler_on_a_gpu(tmp_path):
    overrides = ["augment.repeated_aug=1", "train.amp=fp16"]
    args = " ".join(timm_args(overrides, tmp_path, tmp_path / "out", workers=2, device="cuda"))
    assert "--amp --amp-dtype float16" in args


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory, data_cache) -> tuple[Path, tuple[dict, dict, dict]]:
    """Two fp16 epochs straight, and one + a resume + one (the existing exact-resume helper)."""
    cwd = tmp_path_factory.mktemp("fp16")
    two = TINY + ["train.epochs=2", "train.amp=fp16"]
    return cwd, train_straight_and_resumed(two, cwd, data_cache)


def test_fp16_trains_on_the_cpu_and_reports_its_skipped_steps(fp16_runs):
    cwd, (straight, _, _) = fp16_runs
    result = json.loads(RunDir(cwd / "straight").result.read_text())
    assert result["status"] == "finished" and result["steps_done"] == 16
    skipped = straight["amp_skipped_steps"]
    assert result["amp_skipped_steps"] == skipped
    # GradScaler's definition over 16 steps (no growth before 2,000 good ones): each skip halves the scale from 2^16
    assert straight["scaler"]["growth_interval"] == 2000 and straight["scaler"]["scale"] == 2.0 ** (16 - skipped)
    log = (cwd / "straight" / rank_log_name(0)).read_text()
    assert f"fp16      {skipped} optimizer step(s) skipped by the loss scaler" in log


def test_fp16_resume_is_exact_and_restores_the_scaler(fp16_runs):
    _, (straight, resumed, first_half) = fp16_runs  # the weights are bit-for-bit equal (checked by the helper)
    assert first_half["step"] == 8
    # The first half's scaler is in its checkpoint, by GradScaler's definition from its own skip count; whether a
    # fresh scaler after the resume would end elsewhere depends on where the skips fall (the restore itself:
    # test_scale_doubles_after_2000_good_steps_and_the_state_round_trips).
    assert first_half["scaler"]["scale"] == 2.0 ** (16 - first_half["amp_skipped_steps"])
    assert resumed["scaler"] == straight["scaler"]
    assert resumed["amp_skipped_steps"] == straight["amp_skipped_steps"] >= first_half["amp_skipped_steps"]
    for index, state in straight["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], resumed["optimizer"]["state"][index]["exp_avg"])
