"""Train-step throughput of deit_ablate's Trainer on synthetic on-device batches, FLOPs per image and MFU."""

from __future__ import annotations

import copy
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from deit_ablate.bench.compose import compose_run
from deit_ablate.bench.env import synchronize, torch_threads
from deit_ablate.config.schema import ModelConfig, ResolutionConfig
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.streams import RunStreams
from deit_ablate.record.rundir import RunDir
from deit_ablate.run.assemble import build_pieces
from deit_ablate.run.plan import make_plan
from deit_ablate.train.models import compile_in_place
from deit_ablate.train.trainer import Trainer

# Optimizer implementations torch.optim.AdamW/SGD can take, set on the param groups before the first step.
OPTIMIZER_IMPLS = {"default": {}, "forloop": {"foreach": False, "fused": False},
                   "foreach": {"foreach": True, "fused": False}, "fused": {"foreach": False, "fused": True}}


@dataclass
class StepSetup:
    """A Trainer built the way run.py builds it, and the synthetic batch it trains on."""

    trainer: Trainer
    images: torch.Tensor
    targets: torch.Tensor
    batch: int
    compiled: bool = False
    threads: int | None = None  # torch intra-op threads while this setup runs (None: leave as is)


def build_trainer(overrides: list[str], device: torch.device, optimizer_impl: str = "default",
                  compile_model: bool = False, threads: int | None = None) -> StepSetup:
    """build_pieces() on the config of `python train.py <overrides>` (data loaders are built but never iterated),
    then a synthetic batch on device."""
    cfg = compose_run(overrides)
    RunStreams(cfg.seed).seed_init()
    info = DistInfo(device=device)
    plan = make_plan(cfg, info, RunDir(Path(tempfile.gettempdir()) / "deit-bench-no-run"), [])  # nothing is written
    pieces = build_pieces(plan, info)
    trainer = pieces.trainer
    for group in trainer.optimizer.param_groups:
        group.update(OPTIMIZER_IMPLS[optimizer_impl])
    compiled = False
    if compile_model:
        compiled = compile_in_place(trainer.model)
    batch, size = plan.batch.per_rank_batch, cfg.resolution.train_size
    images = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, cfg.data.num_classes, (batch,), device=device)
    return StepSetup(trainer, images, targets, batch, compiled, threads)


def run_steps(setup: StepSetup, steps: int) -> float:
    """Seconds for `steps` optimizer steps, the device drained before and after."""
    device = setup.images.device
    with torch_threads(setup.threads):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            setup.trainer.train_step(setup.images.clone(), setup.targets)
        synchronize(device)
        return time.perf_counter() - start


def alternate(setups: dict[str, StepSetup], steps: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Images/s of each setup, measured in turn (a, b, a, b, ...) so machine noise hits all alike."""
    for setup in setups.values():
        run_steps(setup, warmup)
    rates: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(repeats):
        for name, setup in setups.items():
            rates[name].append(steps * setup.batch / run_steps(setup, steps))
    return rates


def optimizer_step_seconds(setups: dict[str, StepSetup], steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per optimizer.step() of each setup's optimizer on fixed random gradients, measured in turn."""
    for setup in setups.values():
        for param in setup.trainer.model.parameters():
            param.grad = torch.randn_like(param) * 1e-3
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(repeats):
        for name, setup in setups.items():
            device = setup.images.device
            synchronize(device)
            start = time.perf_counter()
            for _ in range(steps):
                setup.trainer.optimizer.step()
            synchronize(device)
            seconds[name].append((time.perf_counter() - start) / steps)
    return seconds


def default_optimizer_impl(optimizer: torch.optim.Optimizer) -> str:
    """What torch runs for param groups that leave foreach/fused unset: 'fused', 'foreach' or 'for-loop'."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None:
        return "foreach" if group["foreach"] else "for-loop"
    fused, foreach = _default_to_fused_or_foreach(list(group["params"]), differentiable=False, use_fused=False)
    return "fused" if fused else "foreach" if foreach else "for-loop"


def train_flops_per_image(model: torch.nn.Module, size: int, device: torch.device) -> float:
    """FLOPs of one forward and backward pass per image (matmuls, convolutions, attention), counted by torch.

    Counted on a copy on the meta device (shapes only, no arithmetic), or on `device` if the model cannot go there."""
    model = getattr(model, "_orig_mod", model)
    for where in (torch.device("meta"), device):
        try:
            copy_ = copy.deepcopy(model).to(where).train()
            images = torch.randn(2, 3, size, size, device=where)
            with FlopCounterMode(display=False) as counter:
                out = copy_(images)
                out = out[0] if isinstance(out, tuple) else out
                out.float().sum().backward()
            return counter.get_total_flops() / 2
        except (NotImplementedError, RuntimeError):
            if where == device:
                raise
    raise AssertionError("unreachable")


def count_syncs_per_step(setup: StepSetup, steps: int = 6) -> float | None:
    """Host-device syncs per step inside Trainer.train_steps (CUDA sync-debug mode); None on CPU."""
    device = setup.images.device
    if device.type != "cuda":
        return None
    trainer = setup.trainer
    interval, trainer.log_interval = trainer.log_interval, 10**9  # only the end-of-epoch .item() remains
    batches = [(setup.images.clone(), setup.targets) for _ in range(steps)]
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_steps(batches, epoch=0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    trainer.log_interval = interval
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return max(syncs - 1, 0) / steps  # minus the epoch-end loss .item()


def step_settings(model: ModelConfig, resolution: ResolutionConfig, setup: StepSetup) -> dict[str, Any]:
    """The settings a train-step figure depends on."""
    trainer = setup.trainer
    group = trainer.optimizer.param_groups[0]
    return {"model": model.name, "model_kwargs": dict(model.kwargs), "train_size": resolution.train_size,
            "batch": setup.batch, "accum_steps": trainer.accum_steps, "amp": str(trainer.amp_dtype),
            "optimizer": type(trainer.optimizer).__name__, "foreach": group.get("foreach"), "fused": group.get("fused"),
            "mixup": trainer.mixup is not None, "ema": trainer.ema is not None, "drop_path": model.drop_path,
            "compiled": setup.compiled, "torch_threads": setup.threads or torch.get_num_threads()}


def measure(overrides: list[str], device: torch.device, variants: dict[str, dict[str, Any]], steps: int,
            repeats: int, warmup: int,
            log: Callable[[str], None] = print) -> tuple[dict[str, list[float]], dict[str, StepSetup]]:
    """Build one Trainer per variant (kwargs of build_trainer) on the config of `overrides`; measure them in turn."""
    setups = {}
    for name, kwargs in variants.items():
        log(f"[bench] building train step '{name}' ...")
        start = time.perf_counter()
        setups[name] = build_trainer(overrides, device, **kwargs)
        if setups[name].compiled:
            run_steps(setups[name], 1)  # compiles forward and backward
            log(f"[bench] compiled '{name}' in {time.perf_counter() - start:.0f}s")
    return alternate(setups, steps, repeats, warmup), setups
