"""Train and eval transforms from timm's create_transform, with DeiT's augmentation settings."""

from __future__ import annotations

from collections.abc import Callable

import torch
from omegaconf import DictConfig
from timm.data import create_transform

from deit_ablate.data.fast_jpeg import fast_train_transform


def build_train_transform(cfg: DictConfig) -> Callable:
    """Random-resized crop, flip, the auto-augment policy, normalization and random erasing."""
    aug = cfg.augment
    return create_transform(
        input_size=cfg.resolution.train_size,
        is_training=True,
        no_aug=aug.no_aug,
        scale=tuple(aug.scale),
        hflip=aug.hflip,
        color_jitter=aug.color_jitter,
        auto_augment=aug.auto_augment,
        interpolation=aug.interpolation,
        re_prob=aug.reprob,
        re_mode=aug.remode,
        re_count=aug.recount,
        mean=tuple(cfg.data.mean),
        std=tuple(cfg.data.std),
    )


def build_train_pipeline(cfg: DictConfig) -> tuple[Callable, Callable[..., torch.Tensor] | None]:
    """The per-image training transform and, with data.fast_jpeg, the per-batch step the trainer runs on the device."""
    transform = build_train_transform(cfg)
    if not cfg.data.fast_jpeg:
        return transform, None
    return fast_train_transform(transform)


def build_eval_transform(cfg: DictConfig) -> Callable:
    """Resize to eval_size / crop_pct, center-crop eval_size, normalize."""
    return create_transform(
        input_size=cfg.resolution.eval_size,
        is_training=False,
        crop_pct=cfg.resolution.crop_pct,
        interpolation=cfg.augment.interpolation,
        mean=tuple(cfg.data.mean),
        std=tuple(cfg.data.std),
    )
