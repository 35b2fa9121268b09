"""Sharpness-aware minimization (Foret et al. 2021, arXiv:2010.01412): the weight perturbation of a SAM step and
what its second pass must find as the first left it (random masks, normalization statistics).

One SAM step on a minibatch: g = grad L(theta), eps = rho * g / ||g||_2 (the norm over every parameter with a
gradient), g_SAM = grad L(theta + eps) on the same minibatch, then the base optimizer steps from theta with g_SAM.
The Trainer (engine.py) runs the two passes; this module holds the pieces it runs them with."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase

from deit_ablate.core.distributed import device_generator

# Forward and backward passes per image and optimizer step with SAM (1 without): its compute cost.
GRAD_EVALS_PER_STEP = 2


def with_grad(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the last backward gave a gradient: the ones SAM perturbs."""
    return [p for p in module.parameters() if p.grad is not None]


@torch.no_grad()
def perturbation(grads: Sequence[torch.Tensor], rho: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """eps = rho * g / ||g||_2 over all of `grads` together, computed in place in them (they are given up); and
    whether g was finite, as a device tensor (no host sync).

    g = 0 gives eps = 0 (no NaN). A non-finite g (an fp16 overflow) gives eps = 0 too. A scaled gradient (fp16's
    loss scale S) gives the same eps: rho * S g / ||S g|| = rho * g / ||g||."""
    if not grads:
        return [], torch.ones((), dtype=torch.bool)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    finite = torch.isfinite(norm)
    scale = torch.where(finite & (norm > 0), rho / norm, torch.zeros_like(norm))
    eps = list(grads)
    torch._foreach_mul_(eps, scale)
    for tensor in eps:  # only a non-finite g leaves anything to replace: inf * 0 is NaN
        torch.nan_to_num_(tensor, nan=0.0, posinf=0.0, neginf=0.0)
    return eps, finite


@contextlib.contextmanager
def perturbed(params: Sequence[torch.nn.Parameter], eps: Sequence[torch.Tensor]) -> Iterator[None]:
    """The weights at theta + eps inside, exactly theta again on leaving (restored from a copy: theta + eps - eps
    can differ from theta in the last bit)."""
    with torch.no_grad():
        theta = [p.detach().clone() for p in params]
        torch._foreach_add_([p.data for p in params], list(eps))
    del eps  # no longer needed: theta comes back from the copy
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in zip(params, theta, strict=True):
                p.copy_(saved)


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The generators drop path and dropout draw from: the CPU's and the device's (the CPU's again on a CPU)."""
    return torch.get_rng_state(), device_generator(device).get_state()


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> None:
    """Put the generators back to `state`, so the second pass draws the first pass's masks again."""
    cpu, on_device = state
    torch.set_rng_state(cpu)
    device_generator(device).set_state(on_device)


class ClockEvent:
    """torch.cuda.Event's timing interface on the host clock: PassTimer's event on the CPU."""

    def __init__(self) -> None:
        self.time = 0.0

    def record(self) -> None:
        self.time = time.perf_counter()

    def elapsed_time(self, end: ClockEvent) -> float:
        """Milliseconds from this event to `end`, as torch.cuda.Event counts them."""
        return 1e3 * (end.time - self.time)

    def synchronize(self) -> None:
        """Nothing to wait for: the clock was read when the event was recorded."""


@contextlib.contextmanager
def frozen_running_stats(model: torch.nn.Module) -> Iterator[None]:
    """BatchNorm's running statistics as the first pass left them: the second pass sees the same batch again and
    must not count it twice (a ViT's LayerNorms keep none)."""
    norms = [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats and m.training]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, buffers in zip(norms, saved, strict=True):
                for buffer, value in zip(module.buffers(recurse=False), buffers, strict=True):
                    buffer.copy_(value)


class PassTimer:
    """The share of step time SAM's second passes take, read at the log interval only: on a GPU through CUDA
    events (no host-device sync per step), on the CPU through the clock."""

    def __init__(self, device: torch.device, event: Callable[[], Any] | None = None) -> None:
        """`event` makes a timing event (default: torch.cuda.Event on a GPU, ClockEvent on the CPU)."""
        cuda_event = functools.partial(torch.cuda.Event, enable_timing=True)
        self.event = event or (cuda_event if device.type == "cuda" else ClockEvent)
        self._steps: list[list] = []  # per step: start, (second pass begins, ends)*, end

    def mark(self) -> None:
        """A time point in the current step (the first one of a step starts it)."""
        event = self.event()
        event.record()
        self._steps[-1].append(event)

    def start_step(self) -> None:
        """Begin a step's list of time points."""
        self._steps.append([])
        self.mark()

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3

    def share(self) -> float | None:
        """The second passes' share of the time of the steps since the last call (None before any); resets."""
        steps = [marks for marks in self._steps if len(marks) >= 4 and len(marks) % 2 == 0]
        self._steps = []
        if not steps:
            return None
        steps[-1][-1].synchronize()  # the caller has just synced at the log interval: this waits for nothing
        second = sum(self._elapsed(m[i], m[i + 1]) for m in steps for i in range(1, len(m) - 1, 2))
        total = sum(self._elapsed(m[0], m[-1]) for m in steps)
        return second / total if total > 0 else None
