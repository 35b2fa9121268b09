"""Sharpness-aware minimization (Foret et al. 2021) against its definition, on small tensors written out by hand:
g = grad L(theta), eps = rho g / ||g||_2, g_SAM = grad L(theta + eps) on the same minibatch, the base optimizer
steps from theta with g_SAM; per rank and per accumulation chunk (m-sharpness)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from timm.data import Mixup

from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.run.assemble import grad_scaler
from deit_ablate.run.stages import stage_recipe
from deit_ablate.run.validate import validate_config
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler
from deit_ablate.train.sam import perturbation
from deit_ablate.train.trainer import Trainer
from tests.conftest import REPO, TINY, compose_config, run_train
from tests.sam_ddp_worker import BIAS, LR, RHO, SHARDS, WEIGHT, mse

X = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
Y = torch.tensor([[1.0], [0.0]])


def hand_grad(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """dL/dW, dL/db of L = mean((x W^T + b - y)^2), written out: 2/N sum_i r_i x_i and 2/N sum_i r_i."""
    residual = x @ weight.T + bias - y
    return 2 / residual.numel() * residual.T @ x, 2 / residual.numel() * residual.sum(0)


def hand_eps(grad_w: torch.Tensor, grad_b: torch.Tensor, rho: float):
    """rho g / ||g||_2 over both tensors together (0 for g = 0)."""
    norm = torch.sqrt(grad_w.square().sum() + grad_b.square().sum())
    return (rho * grad_w / norm, rho * grad_b / norm) if norm > 0 else (0 * grad_w, 0 * grad_b)


def hand_sam_grad(weight, bias, x, y, rho, g=None):
    """g_SAM = grad L(theta + rho g / ||g||) on (x, y); g is the gradient there unless given."""
    g = g or hand_grad(weight, bias, x, y)
    eps_w, eps_b = hand_eps(*g, rho)
    return hand_grad(weight + eps_w, bias + eps_b, x, y)


def _linear(weight=WEIGHT, bias=BIAS) -> torch.nn.Linear:
    model = torch.nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
        model.bias.copy_(torch.tensor(bias))
    return model


def _trainer(model, rho, optimizer=None, loss_fn=mse, **kwargs) -> Trainer:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=0, min_lr=1e-5, warmup_lr=1e-6)
    return Trainer(model=model, optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn, info=DistInfo(),
                   sam_rho=rho, **kwargs)


def _close(a: torch.Tensor, b, atol: float = 1e-6) -> bool:
    return torch.allclose(a, torch.as_tensor(b, dtype=a.dtype).reshape(a.shape), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_one_sam_step_is_the_hand_computed_step(name):
    weight, bias = torch.tensor(WEIGHT), torch.tensor(BIAS)
    # residuals r = (-2.25, 2.75): g_W = r1 x1 + r2 x2 = (6, -7.25), g_b = r1 + r2 = 0.5; L = (2.25^2 + 2.75^2) / 2
    g_w, g_b = hand_grad(weight, bias, X, Y)
    assert g_w.tolist() == [[6.0, -7.25]] and g_b.tolist() == [0.5]
    eps_w, eps_b = hand_eps(g_w, g_b, 0.5)
    assert _close(eps_w, [[0.5 * 6 / 88.8125**0.5, -0.5 * 7.25 / 88.8125**0.5]])
    sam_w, sam_b = hand_grad(weight + eps_w, bias + eps_b, X, Y)

    model, twin = _linear(), _linear()
    seen = []  # the weights each forward pass ran at
    model.register_forward_pre_hook(lambda module, args: seen.append(module.weight.detach().clone()))
    trainer = _trainer(model, 0.5, build_optimizer(model, name, lr=0.1, weight_decay=0.05))
    loss = trainer.train_step(X, Y)
    assert loss.item() == 6.3125  # the loss at theta, not at theta + eps
    assert len(seen) == 2 and torch.equal(seen[0], weight) and _close(seen[1], weight + eps_w)
    assert _close(model.weight.grad, sam_w) and _close(model.bias.grad, sam_b)
    # The base optimizer (its weight decay and all) stepped from theta with the hand g_SAM.
    reference = build_optimizer(twin, name, lr=0.1, weight_decay=0.05)
    twin.weight.grad, twin.bias.grad = sam_w.clone(), sam_b.clone()
    reference.step()
    assert _close(model.weight, twin.weight) and _close(model.bias, twin.bias)
    assert not _close(model.weight, _linear().weight)  # it moved


def test_a_zero_gradient_gives_no_perturbation_and_the_base_step():
    eps, finite = perturbation([torch.zeros(2, 3), torch.zeros(4)], rho=0.2)
    assert bool(finite) and all(torch.equal(e, torch.zeros_like(e)) for e in eps)  # 0, not 0/0 = NaN
    exact = X @ torch.tensor(WEIGHT).T + torch.tensor(BIAS)  # (-1.25, 2.75): targets met exactly, so g = 0
    weights = []
    for rho in (0.2, 0.0):
        model = _linear()
        trainer = _trainer(model, rho, build_optimizer(model, "adamw", lr=0.1, weight_decay=0.05))
        assert trainer.train_step(X, exact).item() == 0.0
        assert torch.equal(model.weight.grad, torch.zeros(1, 2)) and torch.equal(model.bias.grad, torch.zeros(1))
        weights.append((model.weight.detach().clone(), model.bias.detach().clone()))
    (sam_w, sam_b), (plain_w, plain_b) = weights
    assert torch.equal(sam_w, plain_w) and torch.equal(sam_b, plain_b)
    assert not torch.equal(plain_w, torch.tensor(WEIGHT))  # AdamW's decoupled decay moved it all the same


def _vit() -> torch.nn.Module:
    cfg = compose_config(["model.drop_path=0", "model.kwargs.depth=1", "model.kwargs.embed_dim=32",
                          "model.kwargs.num_heads=2"])
    torch.manual_seed(0)
    return build_model(cfg.model, num_classes=10, img_size=32)


def test_rho_zero_is_the_plain_step_bit_for_bit():
    model = _vit()
    twin = copy.deepcopy(model)
    criterion = torch.nn.CrossEntropyLoss()
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    trainer = _trainer(model, 0.0, build_optimizer(model, "adamw", lr=1e-3, weight_decay=0.05),
                       loss_fn=lambda images, outputs, targets: criterion(outputs, targets), clip_grad=1.0)
    generator = torch.Generator().manual_seed(1)
    images, targets = torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    trainer.train_step(images, targets)
    assert len(forwards) == 1 and trainer.sam_metrics() == {}
    # The step as written before SAM: backward, clip, optimizer step.
    reference = build_optimizer(twin, "adamw", lr=1e-3, weight_decay=0.05)
    (criterion(twin(images), targets) / 1).backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    reference.step()
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_ddp_ranks_each_perturb_with_their_own_gradient_and_average_g_sam(tmp_path):
    out = tmp_path / "step"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29641",
               str(REPO / "tests" / "sam_ddp_worker.py"), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    weight, bias = torch.tensor(WEIGHT), torch.tensor(BIAS)
    own = [hand_sam_grad(weight, bias, x, y, RHO) for x, y in SHARDS]  # each rank's eps from its own g
    mean_w, mean_b = (own[0][0] + own[1][0]) / 2, (own[0][1] + own[1][1]) / 2
    # The variant that all-reduces the first gradient: one eps from the mean g, for both ranks.
    grads = [hand_grad(weight, bias, x, y) for x, y in SHARDS]
    mean_g = ((grads[0][0] + grads[1][0]) / 2, (grads[0][1] + grads[1][1]) / 2)
    shared = [hand_sam_grad(weight, bias, x, y, RHO, g=mean_g) for x, y in SHARDS]
    shared_w = (shared[0][0] + shared[1][0]) / 2
    assert (shared_w - mean_w).abs().max() > 0.1  # the two definitions differ: this test can tell them apart
    for rank in (0, 1):
        result = torch.load(f"{out}.{rank}.pt", weights_only=True)
        assert _close(result["grad_weight"], mean_w) and _close(result["grad_bias"], mean_b), rank
        assert _close(result["weight"], weight - LR * mean_w) and _close(result["bias"], bias - LR * mean_b)


def test_each_accumulation_chunk_is_perturbed_by_its_own_gradient():
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [-2.0, 1.0], [0.5, 0.5]])
    y = torch.tensor([[1.0], [0.0], [2.0], [-1.0]])
    weight, bias = torch.tensor(WEIGHT), torch.tensor(BIAS)
    model = _linear()
    _trainer(model, RHO, accum_steps=2).train_step(x, y)
    first, second = hand_sam_grad(weight, bias, x[:2], y[:2], RHO), hand_sam_grad(weight, bias, x[2:], y[2:], RHO)
    expected_w, expected_b = (first[0] + second[0]) / 2, (first[1] + second[1]) / 2
    assert _close(model.weight.grad, expected_w) and _close(model.bias.grad, expected_b)
    assert _close(model.weight, weight - LR * expected_w)
    # Neither one eps for the whole batch, nor the second chunk's g mixed with the first chunk's g_SAM.
    whole = hand_sam_grad(weight, bias, x, y, RHO)[0]
    g2 = hand_grad(weight, bias, x[2:], y[2:])
    leaked = hand_sam_grad(weight, bias, x[2:], y[2:], RHO, g=((first[0] + g2[0]) / 2, (first[1] + g2[1]) / 2))
    for wrong in (whole, (first[0] + leaked[0]) / 2):
        assert (wrong - expected_w).abs().max() > 0.05


def test_both_passes_see_the_same_mixed_batch_and_each_chunk_its_own_mix():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3))
    calls = []

    def loss_fn(images, outputs, targets):
        calls.append((images.clone(), targets.clone()))
        return torch.sum(-targets * torch.log_softmax(outputs, dim=-1), dim=-1).mean()

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=3)
    images, targets = torch.randn(8, 3, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    _trainer(model, 0.1, loss_fn=loss_fn, accum_steps=2, mixup=mixup).train_step(images.clone(), targets)
    assert len(calls) == 4
    for first, second in ((calls[0], calls[1]), (calls[2], calls[3])):
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(calls[0][0], images[:4])  # mixed
    assert calls[0][1].shape == (4, 3) and calls[0][1].max() < 1  # soft targets: mixed (with smoothing)


def test_the_second_pass_redraws_the_first_pass_dropout_masks():
    def model_and_masks():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        masks = []
        model[1].register_forward_hook(lambda module, args, out: masks.append((out == 0) & (args[0] != 0)))
        return model, masks

    model, masks = model_and_masks()
    torch.manual_seed(1)
    _trainer(model, RHO).train_step(X, Y)
    after_sam = torch.rand(4)
    assert len(masks) == 2 and torch.equal(masks[0], masks[1]) and 0 < masks[0].sum() < masks[0].numel()
    plain, _ = model_and_masks()
    torch.manual_seed(1)
    _trainer(plain, 0.0).train_step(X, Y)
    assert torch.equal(torch.rand(4), after_sam)  # the stream goes on where a plain step leaves it


def test_the_second_pass_leaves_batchnorm_running_statistics_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    twin = copy.deepcopy(model)
    _trainer(model, RHO).train_step(X, Y)
    twin(X)  # one forward at theta: what the first pass counts
    norm, reference = model[1], twin[1]
    assert norm.num_batches_tracked.item() == 1
    assert torch.equal(norm.running_mean, reference.running_mean) and torch.equal(norm.running_var,
                                                                                  reference.running_var)


def test_the_fp16_loss_scale_leaves_eps_unchanged():
    weight, bias = torch.tensor(WEIGHT), torch.tensor(BIAS)
    sam_w, sam_b = hand_sam_grad(weight, bias, X, Y, RHO)
    model = _linear()
    trainer = _trainer(model, RHO, scaler=grad_scaler("fp16", torch.device("cpu")))
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": 2.0**10})
    trainer.train_step(X, Y)
    assert trainer.amp_skipped_steps == 0
    assert _close(model.weight.grad, sam_w) and _close(model.bias.grad, sam_b)  # unscaled by the scaler's step
    assert _close(model.weight, weight - LR * sam_w)


def test_a_non_finite_first_gradient_under_fp16_perturbs_nothing_and_skips_the_step():
    calls = []

    def overflow_once(images, outputs, targets):  # the first pass overflows, the second would not
        calls.append(1)
        return mse(images, outputs, targets) * (float("inf") if len(calls) == 1 else 1.0)

    model = _linear()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.weight.detach().clone()))
    trainer = _trainer(model, RHO, loss_fn=overflow_once, scaler=grad_scaler("fp16", torch.device("cpu")))
    trainer.train_step(X, Y)
    assert torch.equal(seen[1], seen[0])  # eps = 0
    assert trainer.amp_skipped_steps == 1 and trainer.scaler.get_scale() == 2.0**15
    assert torch.equal(model.weight, torch.tensor(WEIGHT)) and torch.equal(model.bias, torch.tensor(BIAS))


def test_negative_or_non_finite_rho_is_refused_and_a_finetune_runs_without_sam():
    for rho in ("-0.1", "nan", "inf"):
        with pytest.raises(ConfigError, match=r"optimizer.sam_rho=.* must be (a finite number )?>= 0: SAM.s radius"):
            validate_config(compose_config([f"optimizer.sam_rho={rho}"]))
    assert stage_recipe(compose_config(["optimizer.sam_rho=0.2"])).sam_rho == 0.2
    finetune = compose_config(["optimizer.sam_rho=0.2", "stage=finetune", "finetune.init_checkpoint=/x.pt"])
    assert stage_recipe(finetune).sam_rho == 0.0


def _history_rows(outputs) -> list[dict]:
    """Every history row of the one offline wandb log under `outputs`."""
    from wandb.proto.wandb_internal_pb2 import Record

    from deit_ablate.analysis.aggregate.reader import _history_value, find_run_files
    from deit_ablate.analysis.aggregate.wandb_log import read_log

    (path,) = find_run_files(outputs)
    rows, record = [], Record()
    for payload in read_log(path).records:
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): _history_value(item) for item in record.history.item})
    return rows


@pytest.mark.slow
def test_a_demo_run_with_sam_finishes_and_logs_its_cost(tmp_path, data_cache):
    proc = run_train(TINY + ["optimizer.sam_rho=0.2", "train.max_steps=3", "runtime.log_interval=1"], tmp_path,
                     data_cache)
    assert "SAM on: rho 0.2 around adamw" in proc.stdout
    rows = [row for row in _history_rows(tmp_path / "outputs") if "train/loss" in row]
    assert [row["_step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/sam_grad_evals_per_step"] == 2.0
        # Measured: about 0.4 of a warm step of this tiny model, less in the first steps (their set-up time)
        assert 0 < row["train/sam_second_pass_share"] < 1
