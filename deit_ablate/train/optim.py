"""Optimizer, lr rule and schedule: AdamW/SGD/LAMB from timm with DeiT's weight-decay exclusions, and layer-wise lr
decay for a fine-tune."""

from __future__ import annotations

import re
import warnings
from fnmatch import fnmatch
from typing import Any

import torch
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler, StepLRScheduler
from timm.scheduler.scheduler import Scheduler

from deit_ablate.config.keys import is_adam_like

# Layer 0 of layer-wise lr decay besides `patch_embed.*`: the prefix tokens and the position table.
EMBEDDING_NAMES = ("cls_token", "dist_token", "reg_token", "pos_embed")
_BLOCK = re.compile(r"blocks\.(\d+)\.")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int = 512) -> float:
    """DeiT's linear rule: the configured lr is for `base_batch` images per step (Table 9)."""
    return base_lr * global_batch / base_batch


def layer_id(name: str, depth: int) -> int:
    """The layer of a ViT parameter for layer-wise lr decay: 0 for the patch embedding (a Mixer's `stem`), prefix
    tokens and position table, k + 1 for `blocks.k.`, depth + 1 for everything else (final norm, heads)."""
    if name.startswith(("patch_embed", "stem.")) or name in EMBEDDING_NAMES:
        return 0
    block = _BLOCK.match(name)
    return int(block.group(1)) + 1 if block else depth + 1


def layer_lr_scale(layer: int, depth: int, zeta: float) -> float:
    """The share of the lr layer `layer` gets: zeta^(depth + 1 - layer), 1 for the head (Clark et al. 2020; Bao et
    al. 2022)."""
    return zeta ** (depth + 1 - layer)


def _skips_weight_decay(model: torch.nn.Module, name: str, param: torch.Tensor) -> bool:
    """DeiT's (and timm's) rule: no weight decay on 1-D parameters, biases and the model's no_weight_decay() set."""
    no_wd = getattr(model, "no_weight_decay", set)()
    return param.ndim <= 1 or name.endswith(".bias") or any(fnmatch(name, pattern) for pattern in no_wd)


def layer_decay_groups(model: torch.nn.Module, weight_decay: float, zeta: float) -> list[dict[str, Any]]:
    """Parameter groups of a ViT with `blocks`, one per (layer, decay or not), each with its lr_scale (which timm's
    schedulers apply) and weight decay; the head's layer first, so param_groups[0] holds the full lr."""
    depth = len(model.blocks)
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        layer, decay = layer_id(name, depth), not _skips_weight_decay(model, name, param)
        group = groups.setdefault((layer, decay), {
            "params": [], "param_names": [], "layer": layer, "lr_scale": layer_lr_scale(layer, depth, zeta),
            "weight_decay": weight_decay if decay else 0.0})
        group["params"].append(param)
        group["param_names"].append(name)
    return [groups[key] for key in sorted(groups, reverse=True)]


def describe_layer_decay(optimizer: torch.optim.Optimizer, zeta: float) -> str:
    """One line with the lr scale of every layer of a layer-decay optimizer (0: embeddings, L + 1: head)."""
    scales = sorted({(group["layer"], group["lr_scale"]) for group in optimizer.param_groups if "layer" in group})
    depth = scales[-1][0] - 1
    names = {0: "patch embed + prefix tokens", depth + 1: "norm + head"}
    parts = [f"{layer} ({names.get(layer, f'block {layer - 1}')}) x{scale:.4g}" for layer, scale in scales]
    return f"layer-wise lr decay zeta {zeta} over {depth} blocks, lr scale per layer: " + ", ".join(parts)


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, momentum: float = 0.9,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    layer_decay: float | None = None) -> torch.optim.Optimizer:
    """timm's optimizer; weight decay skips 1-D parameters and the model's no_weight_decay() set (cls_token,
    dist_token, pos_embed); with `layer_decay` zeta, a ViT's layers get zeta^(L + 1 - layer) of the lr."""
    # timm's "lamb" is apex's FusedLAMB that DeiT III trained with (--opt fusedlamb): Adam's betas and eps, the
    # gradient clipped to global norm 1 inside the step, no trust ratio where weight decay is 0.
    extra = {"betas": tuple(betas), "eps": eps} if is_adam_like(name) else {"momentum": momentum}
    if name in ("adam", "adamw"):
        # One fused kernel instead of a loop over ~400 tensors: 4.4x faster optimizer.step() on this CPU
        # (docs/PERFORMANCE.md); torch would pick the per-tensor loop on CPU and foreach on GPU.
        extra["fused"] = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in model.parameters())
    if layer_decay is not None:
        groups = layer_decay_groups(model, weight_decay, layer_decay)
        return create_optimizer_v2(groups, opt=name, lr=lr, weight_decay=weight_decay, **extra)
    # timm's "sgd" is SGD with Nesterov momentum, as DeiT's --opt sgd was.
    return create_optimizer_v2(model, opt=name, lr=lr, weight_decay=weight_decay, filter_bias_and_bn=True, **extra)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: float, warmup_steps: float, min_lr: float,
                    warmup_lr: float, sched: str = "cosine", decay_steps: float = 1.0, decay_rate: float = 0.1
                    ) -> Scheduler:
    """timm's schedule `sched` over `total_steps` ticks (optimizer updates, or epochs under EpochStepped), with a
    linear warm-up from warmup_lr over its first `warmup_steps`.

    cosine: as timm 0.3.2's create_scheduler built it for DeiT (no warm-up prefix): the cosine spans the whole run and
    the warm-up replaces its first ticks, so the lr right after the warm-up is cos(pi * warmup / total) of the way.
    step: the peak times decay_rate every decay_steps ticks (the warm-up replacing its first ticks, as in 0.3.2).
    none: the peak throughout, no warm-up (timm's create_scheduler builds no scheduler for it).

    min_lr is absolute while the peak scales with the batch, so at a small batch the floor can exceed the
    peak; it is then lowered to the peak (a flat schedule) rather than letting the cosine rise. A group's
    lr_scale (layer-wise decay) scales its whole schedule, floor included."""
    peak = optimizer.param_groups[0]["lr"]
    if sched == "cosine":
        if min_lr > peak:
            warnings.warn(f"min lr {min_lr:.3g} is above the peak lr {peak:.3g} at this batch size; using "
                          f"{peak:.3g} as the floor.", stacklevel=2)
            min_lr = peak
        scheduler = CosineLRScheduler(optimizer, t_initial=max(total_steps, 1), lr_min=min_lr, warmup_t=warmup_steps,
                                      warmup_lr_init=warmup_lr, warmup_prefix=False, t_in_epochs=False)
    elif sched == "step":
        scheduler = StepLRScheduler(optimizer, decay_t=decay_steps, decay_rate=decay_rate, warmup_t=warmup_steps,
                                    warmup_lr_init=warmup_lr, warmup_prefix=False, t_in_epochs=False)
    elif sched == "none":
        scheduler = StepLRScheduler(optimizer, decay_t=1, decay_rate=1.0, t_in_epochs=False)  # applies lr_scale
    else:
        raise ValueError(f"optimizer.sched={sched}: one of cosine, step, none")
    # the first step's lr as the schedule gives it: timm sets it only under a warm-up, and without its lr_scale
    # a layer-decay group would take its first step at the full lr
    scheduler.step_update(num_updates=0)
    return scheduler


class EpochStepped:
    """A schedule in epochs moved as the released DeiT main.py moves it: `lr_scheduler.step(epoch)` after each epoch,
    so epoch e > 0 trains at lr(e - 1) and epochs 0 and 1 both at lr(0) (optimizer.sched_on=epoch).

    Stepped per update like any schedule here (Trainer.step_update), from the update count alone, so a resume at any
    step sets what the uninterrupted run had."""

    def __init__(self, scheduler: Scheduler, steps_per_epoch: int) -> None:
        self.scheduler, self.steps_per_epoch = scheduler, max(steps_per_epoch, 1)

    def step_update(self, num_updates: int) -> None:
        """Set the lr of the update `num_updates` (0-based): the schedule's value one epoch before its epoch."""
        self.scheduler.step_update(num_updates=max(num_updates // self.steps_per_epoch - 1, 0))

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
