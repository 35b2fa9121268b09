"""High-norm patch tokens (Darcet et al. 2024, Vision Transformers Need Registers, arXiv:2309.16588).

A ViT's output tokens are its prefix tokens (class, distillation, registers) followed by the patch tokens in raster
order. Large ViTs grow a few patch tokens whose output norm is about ten times that of the others (in DINOv2's ViT-g
2.37 % of the output tokens have a norm above 150, most are below 100); registers remove them. The measure here is
the share of output patch tokens whose norm exceeds HIGH_NORM_FACTOR times the median patch-token norm of their
image, summed over images and ranks."""

from __future__ import annotations

import torch
from torch import nn

# A patch token is high-norm when its norm exceeds this multiple of its image's median patch-token norm. Darcet et
# al. (2024, section 2.1) find outliers with about ten times the norm of the other tokens and cut DINOv2 ViT-g's
# norms at 150, above the bulk (most below 100). 3 x the median lies between the two: a normal token passes it only
# if the bulk spreads over more than a factor 3 above its median, an outlier at about 10 x always does. Relative
# to the median the rule needs no per-model constant, and a per-image median keeps the count a sum over images, so
# ranks add.
HIGH_NORM_FACTOR = 3.0


def patch_tokens(tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """The patch rows of a ViT's output tokens (B, T, D): the `num_prefix_tokens` leading rows dropped."""
    if tokens.ndim != 3 or tokens.shape[1] <= num_prefix_tokens:
        raise ValueError(f"tokens of shape {tuple(tokens.shape)} have no patch rows after {num_prefix_tokens} "
                         "prefix tokens; expected (batch, prefix + patches, width).")
    return tokens[:, num_prefix_tokens:]


def patch_grid(tokens: torch.Tensor, num_prefix_tokens: int, grid: tuple[int, int]) -> torch.Tensor:
    """The patch tokens of (B, T, D) output tokens as a (B, H, W, D) grid: patch i at row i // W, column i % W."""
    patches = patch_tokens(tokens, num_prefix_tokens)
    height, width = grid
    if patches.shape[1] != height * width:
        raise ValueError(f"{patches.shape[1]} patch tokens after {num_prefix_tokens} prefix tokens are not a "
                         f"{height} x {width} grid: the prefix count is wrong.")
    return patches.reshape(patches.shape[0], height, width, patches.shape[-1])


def high_norm_mask(tokens: torch.Tensor, num_prefix_tokens: int, factor: float = HIGH_NORM_FACTOR) -> torch.Tensor:
    """(B, N) mask of the patch tokens whose L2 norm exceeds `factor` x their image's median patch-token norm."""
    norms = patch_tokens(tokens, num_prefix_tokens).float().norm(dim=-1)
    # torch's median of an even count is the lower middle value: a slightly lower cut, never a mean of two
    median = norms.median(dim=1, keepdim=True).values
    return norms > factor * median


def high_norm_counts(tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """(high-norm patch tokens, patch tokens) of a batch as float64 sums, to add across batches and ranks."""
    mask = high_norm_mask(tokens, num_prefix_tokens)
    return torch.stack([mask.sum(), torch.tensor(mask.numel(), device=mask.device)]).to(torch.float64)


def measures_high_norm(model: nn.Module) -> bool:
    """Whether `model` is a ViT whose final norm outputs every token (prefix + patch grid): timm's ViT and DeiT."""
    from timm.models.vision_transformer import VisionTransformer

    return isinstance(model, VisionTransformer) and model.pos_embed is not None


class HighNormCounter:
    """Counts high-norm output patch tokens of `model` (see `measures_high_norm`) while registered, through a
    forward hook on its final norm, whose output is forward_features'; the sums stay on the device."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.num_prefix_tokens = int(model.num_prefix_tokens)
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)
        self._handle = model.norm.register_forward_hook(self._count)

    def _count(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.sums += high_norm_counts(output, self.num_prefix_tokens)

    def remove(self) -> None:
        """Stop counting."""
        self._handle.remove()


def high_norm_percent(sums: torch.Tensor) -> float:
    """The share in percent of high-norm patch tokens from (high-norm, total) sums."""
    return 100 * sums[0].item() / max(sums[1].item(), 1.0)
