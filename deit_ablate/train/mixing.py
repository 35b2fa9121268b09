"""Mixup/CutMix and the matching training criterion."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from deit_ablate.config.schema import Criterion


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
    """Soft-target CE when Mixup makes (smoothed) soft targets, else label-smoothed CE on integer labels; or
    DeiT III's binary cross-entropy (mix.criterion=bce)."""
    if mix.criterion == Criterion.bce:
        return binary_cross_entropy()
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if mix.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=mix.label_smoothing)
    return torch.nn.CrossEntropyLoss()


def binary_cross_entropy() -> torch.nn.Module:
    """DeiT III's loss (Touvron, Cord & Jegou 2022; Wightman et al. 2021): a sigmoid per class, every class present
    in the (mixed) target a positive of target 1, the mean over images and classes."""
    # DeiT III's engine sets targets = targets.gt(0.0) before torch's BCEWithLogitsLoss (mean reduction): the
    # threshold 0 is that; integer labels (no Mixup/CutMix) become one-hot.
    return BinaryCrossEntropy(smoothing=0.0, target_threshold=0.0, reduction="mean")
