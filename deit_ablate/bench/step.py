"""Train-step throughput of deit_ablate's Trainer on synthetic batches shaped as the loader yields them, FLOPs per
image, MFU and host-device syncs per step."""

from __future__ import annotations

import copy
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from deit_ablate.bench.compose import compose_run
from deit_ablate.bench.env import SYNC_WARNING, DeviceCalls, device_calls, torch_threads
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
    """A Trainer built the way run.py builds it, and the synthetic batch it trains on, as the loader yields it."""

    trainer: Trainer
    pixels: torch.Tensor  # uint8 B x H x W x 3 on the device, as data.backend=dali's loader yields a batch
    targets: torch.Tensor  # int64 labels on the device
    batch: int
    streams: RunStreams  # the run's random streams, as run.py hands them to train_steps
    calls: DeviceCalls  # the CUDA calls around the steps (bench.env), or their CPU equivalents
    compiled: bool = False
    threads: int | None = None  # torch intra-op threads while this setup runs (None: leave as is)
    _reused: torch.Tensor | None = field(default=None, init=False, repr=False)  # train_steps' float batch on CPU

    @property
    def device(self) -> torch.device:
        return self.pixels.device

    def images(self) -> torch.Tensor:
        """The float batch train_steps hands train_step: the pixels through the trainer's per-batch transform
        (normalize, random erasing), into the last step's tensor on the CPU as train_steps does."""
        images = self.trainer.batch_transform(self.pixels, out=self._reused)
        self._reused = images if images.device.type == "cpu" else None
        return images


def loader_batch(batch: int, size: int, num_classes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch as the training loader yields it: uint8 B x H x W x 3 pixels and int64 labels, on `device`."""
    pixels = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=device)
    return pixels, torch.randint(0, num_classes, (batch,), device=device)


def build_trainer(overrides: list[str], device: torch.device, optimizer_impl: str = "default",
                  compile_model: bool = False, threads: int | None = None, calls: DeviceCalls | None = None,
                  compile_backend: str = "inductor") -> StepSetup:
    """build_pieces() on the config of `python train.py <overrides>` (data loaders are built but never iterated),
    then a synthetic loader batch on device."""
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
        compiled = compile_in_place(trainer.model, compile_backend)
    batch = plan.batch.per_rank_batch
    pixels, targets = loader_batch(batch, cfg.resolution.train_size, cfg.data.num_classes, device)
    return StepSetup(trainer, pixels, targets, batch, RunStreams(cfg.seed), calls or device_calls(device), compiled,
                     threads)


def run_steps(setup: StepSetup, steps: int) -> float:
    """Seconds for `steps` optimizer steps, each on the batch as train_steps hands it over (the per-batch transform
    counts), the device drained before and after."""
    with torch_threads(setup.threads):
        setup.calls.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            setup.trainer.train_step(setup.images(), setup.targets)
        setup.calls.synchronize()
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
            setup.calls.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                setup.trainer.optimizer.step()
            setup.calls.synchronize()
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


def count_syncs_per_step(setup: StepSetup, steps: int = 6) -> float:
    """Host-device syncs per step inside Trainer.train_steps on the loader's batches, with the run's streams, between
    two log rows: the warnings of the device's sync debug mode (on the CPU, bench.env.HostReads: each host read)."""
    trainer = setup.trainer
    interval, trainer.log_interval = trainer.log_interval, 10**9  # only the end-of-epoch .item() remains
    batches = [(setup.pixels, setup.targets)] * steps  # train_steps reads its batches, never writes them
    setup.calls.synchronize()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            setup.calls.sync_debug_mode("warn")
            try:
                trainer.train_steps(batches, epoch=0, streams=setup.streams)
            finally:
                setup.calls.sync_debug_mode("default")
    finally:
        trainer.log_interval = interval
    syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
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
