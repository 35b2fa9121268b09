"""Mixup/CutMix and the matching training criterion."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy


def build_mixup(mix: DictConfig, num_classes: int) -> Mixup | None:
    """timm's Mixup with DeiT's Beta alphas and switch probability; None when both alphas are 0."""
    if mix.mixup_alpha <= 0 and mix.cutmix_alpha <= 0:
        return None
    return Mixup(
        mixup_alpha=mix.mixup_alpha,
        cutmix_alpha=mix.cutmix_alpha,
        prob=mix.prob,
        switch_prob=mix.switch_prob,
        mode=mix.mode,
        label_smoothing=mix.label_smoothing,
        num_classes=num_classes,
    )


def build_criterion(mix: DictConfig, mixup: Mixup | None) -> torch.nn.Module:
    """Soft-target CE when Mixup makes (smoothed) soft targets, else label-smoothed CE on integer labels."""
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if mix.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=mix.label_smoothing)
    return torch.nn.CrossEntropyLoss()
