"""Sharpness of a trained model (Chen, Hsieh & Gong 2022, arXiv:2106.01548, Tables 1 and 4): lambda_max of the
training-loss Hessian, the loss under Gaussian weight noise, and the training loss, on a fixed set of images.

What every figure is computed on (the same for the command and for `sharpness.at_end=true`):

* images: the training split, the first `sharpness.images` (1024) images of a permutation drawn with
  `sharpness.seed`, so the same images every call for a seed; all of them when the split is smaller.
* augmentation: none. The evaluation transform (resize to eval_size / crop_pct, center crop, normalize), so the
  figures are deterministic; the training crops, flips, RandAugment, erasing and Mixup/CutMix are not applied.
* loss: plain cross-entropy against the true labels, the mean over the images; no label smoothing, no Mixup, no
  teacher term. A model with a distillation token is measured on its class head (the head trained on the labels).
* model: eval mode (no dropout, no drop path), float32 (no autocast), the run's final weights (not its EMA copy).
  Every parameter is a coordinate of the Hessian and receives the noise.

(a) lambda_max: power iteration on Hessian-vector products (double backward, Pearlmutter's trick) over all the
    images, from a seeded random unit vector, stopped after `sharpness.iters` products or when the Rayleigh
    quotient changes by less than `sharpness.tol` (relative). Power iteration finds the eigenvalue of largest
    magnitude; should that one be negative, a second run on H - lambda I gives the largest one.
(b) noisy loss: the mean over `sharpness.draws` seeded draws of the loss with N(0, sigma^2) added to every
    parameter (sigma = `sharpness.sigma`, 0.01 after Chen et al.'s Table 1); the weights are restored after.
(c) train loss: the loss at the final weights.

`python -m deit_ablate.sharpness <run folder>` measures any finished run (cli.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deit_ablate.core.logs import progress_bar

Vector = list[torch.Tensor]  # one tensor per parameter: a vector in weight space
Batches = list[tuple[torch.Tensor, torch.Tensor]]  # (images, labels) on the model's device
FIGURES = ("lambda_max", "train_loss", "noisy_loss")
SUMMARY_PREFIX = "sharpness/"  # the wandb summary's keys: sharpness/lambda_max, ...
HOW = {"split": "train", "order": "first N of a seeded permutation", "transform": "eval (no augmentation)",
       "loss": "cross-entropy on the true labels, mean over images (no label smoothing, no mixup)",
       "mode": "eval, float32", "weights": "final (not EMA)"}


@dataclass(frozen=True)
class SharpnessSettings:
    """How the figures are measured (the `sharpness` config node without `at_end`)."""

    images: int = 1024
    batch_size: int = 64
    iters: int = 20
    tol: float = 1e-3
    sigma: float = 0.01
    draws: int = 5
    seed: int = 0

    @classmethod
    def from_config(cls, node: Any) -> SharpnessSettings:
        """The settings of a `sharpness` config node (or any mapping with these keys)."""
        return cls(**{name: node[name] for name in cls.__dataclass_fields__ if name in node})


@dataclass(frozen=True)
class PowerResult:
    """lambda_max, the Hessian-vector products it took and whether the tolerance was met."""

    value: float
    products: int
    converged: bool


def _dot(a: Vector, b: Vector) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


def _normalized(v: Vector) -> Vector:
    norm = torch.sqrt(_dot(v, v))
    return [x / norm for x in v]


def hessian_vector_product(losses: Callable[[], Iterable[torch.Tensor]], params: Sequence[torch.Tensor],
                           vector: Vector) -> Vector:
    """H v for the sum of the scalar losses `losses()` yields (one graph at a time), by double backward."""
    total = [torch.zeros_like(p) for p in params]
    for loss in losses():
        # a parameter the loss does not use (a distilled ViT's distillation head) has zero curvature
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        grad_dot_v = sum((g * v).sum() for g, v in zip(grads, vector, strict=True) if g is not None)
        products = torch.autograd.grad(grad_dot_v, params, allow_unused=True)
        for acc, product in zip(total, products, strict=True):
            if product is not None:
                acc += product.detach()
    return total


def random_unit_vector(like: Sequence[torch.Tensor], seed: int) -> Vector:
    """A unit vector shaped like `like`, drawn on the CPU from `seed` (the same on any device)."""
    generator = torch.Generator().manual_seed(seed)
    return _normalized([torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) for p in like])


def _power(hvp: Callable[[Vector], Vector], start: Vector, iters: int, tol: float,
           step: Callable[[], None]) -> PowerResult:
    """Power iteration from `start`: the Rayleigh quotient v^T H v of the last unit vector."""
    v, value = start, math.nan
    for k in range(1, iters + 1):
        hv = hvp(v)
        previous, value = value, float(_dot(v, hv))
        step()
        if math.isfinite(previous) and abs(value - previous) <= tol * abs(value):
            return PowerResult(value, k, True)
        norm = float(torch.sqrt(_dot(hv, hv)))
        if norm == 0.0:  # H v = 0: v is an eigenvector of eigenvalue 0
            return PowerResult(0.0, k, True)
        v = [x / norm for x in hv]
    return PowerResult(value, iters, False)


def top_eigenvalue(hvp: Callable[[Vector], Vector], like: Sequence[torch.Tensor], iters: int = 20,
                   tol: float = 1e-3, seed: int = 0, step: Callable[[], None] = lambda: None) -> PowerResult:
    """The largest eigenvalue of the symmetric operator `hvp` by power iteration (at most 2 x `iters` products)."""
    start = random_unit_vector(like, seed)
    first = _power(hvp, start, iters, tol, step)
    if first.value >= 0:
        return first
    # The dominant eigenvalue is negative: H - first I has eigenvalues >= 0, its largest is lambda_max - first.
    shift = first.value
    shifted = _power(lambda v: [h - shift * x for h, x in zip(hvp(v), v, strict=True)], start, iters, tol, step)
    return PowerResult(shifted.value + shift, first.products + shifted.products, shifted.converged)


@contextlib.contextmanager
def differentiable_attention() -> Iterator[None]:
    """Attention through its plain math kernel: the fused kernels have no double backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def class_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The logits the loss is taken on: the model's, or a distilled ViT's class head (losses.py)."""
    if hasattr(model, "head_dist"):
        from deit_ablate.train.losses import distilled_head_logits

        return distilled_head_logits(model, images)[0]
    return model(images)


class BatchLoss:
    """The mean cross-entropy over all images of `batches`, as one scalar per batch weighted by its share."""

    def __init__(self, model: nn.Module, batches: Batches) -> None:
        self.model, self.batches = model, batches
        self.count = sum(len(labels) for _, labels in batches)

    def parts(self) -> Iterator[torch.Tensor]:
        """Each batch's summed loss over the total image count (their sum is the mean loss)."""
        for images, labels in self.batches:
            logits = class_logits(self.model, images)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            yield F.cross_entropy(logits, labels, reduction="sum") / self.count

    def value(self) -> float:
        """The mean loss at the current weights."""
        with torch.no_grad():
            return float(sum(part.double() for part in self.parts()))


def noisy_loss(loss: BatchLoss, params: Sequence[torch.Tensor], sigma: float, draws: int, seed: int,
               step: Callable[[], None] = lambda: None) -> float:
    """The loss with N(0, sigma^2) added to every parameter, averaged over `draws` draws from `seed` (drawn on the
    CPU: the same noise on any device); the parameters are restored exactly after."""
    generator = torch.Generator().manual_seed(seed)
    saved = [p.detach().clone() for p in params]
    total = 0.0
    try:
        with torch.no_grad():
            for _ in range(draws):
                for p, p0 in zip(params, saved, strict=True):
                    noise = torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device)
                    p.copy_(p0 + sigma * noise)
                total += loss.value()
                step()
    finally:
        with torch.no_grad():
            for p, p0 in zip(params, saved, strict=True):
                p.copy_(p0)
    return total / draws


def measure(model: nn.Module, batches: Batches, settings: SharpnessSettings, show_progress: bool = True,
            ) -> dict[str, Any]:
    """lambda_max, train loss and noisy loss of `model` on `batches`, with what was measured (`settings`)."""
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = BatchLoss(model, batches)
    bar = progress_bar(total=settings.iters + settings.draws + 1, desc="sharpness", leave=False, dynamic_ncols=True,
                       disable=not show_progress)  # plain lines in a log file
    try:
        train_loss = loss.value()
        bar.update()
        with differentiable_attention():
            power = top_eigenvalue(lambda v: hessian_vector_product(loss.parts, params, v), params,
                                   settings.iters, settings.tol, settings.seed, step=bar.update)
        noisy = noisy_loss(loss, params, settings.sigma, settings.draws, settings.seed, step=bar.update)
    finally:
        bar.close()
    details = {"images": loss.count, "parameters": sum(p.numel() for p in params),
               "hessian_vector_products": power.products, "converged": power.converged}
    return {"lambda_max": power.value, "train_loss": train_loss, "noisy_loss": noisy,
            "settings": {**asdict(settings), **details, **HOW}}


def summary_values(record: dict[str, Any]) -> dict[str, float]:
    """The figures as the wandb summary keeps them: `sharpness/lambda_max`, `sharpness/train_loss`, ..."""
    return {SUMMARY_PREFIX + name: record[name] for name in FIGURES}


def figures_text(record: dict[str, Any]) -> str:
    """A short table of the figures and how they were measured, for a person."""
    s = record["settings"]
    converged = "converged" if s["converged"] else f"not converged to tol {s['tol']:g}"
    lines = [f"lambda_max   {record['lambda_max']:.4g}   ({s['hessian_vector_products']} Hessian-vector products, "
             f"{converged})",
             f"train loss   {record['train_loss']:.4f}",
             f"noisy loss   {record['noisy_loss']:.4f}   (sigma {s['sigma']:g}, mean of {s['draws']} draws)",
             f"on           {s['images']} training images (seed {s['seed']}), eval transform, cross-entropy, "
             f"{s['parameters']:,} parameters"]
    return "\n".join(lines)
