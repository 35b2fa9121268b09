"""Train and eval transforms from timm's create_transform, with DeiT's augmentation settings."""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig
from timm.data import create_transform

from deit_ablate.config.schema import CropMode, DataBackend
from deit_ablate.config.stage_config import stage_config
from deit_ablate.data.batch import BatchNormalize, split_for_batches
from deit_ablate.data.fast_jpeg import fast_train_transform
from deit_ablate.data.three_augment import THREE_AUGMENT_POLICY, with_simple_crop


def stage_reprob(cfg: DictConfig) -> float:
    """Random erasing's probability in this stage (stage_config.py: transfer.reprob in a transfer, which issue #45
    removes; a fine-tune's override set may change it)."""
    return float(stage_config(cfg).augment.reprob)


def build_train_transform(cfg: DictConfig) -> Callable:
    """Random-resized (or DeiT III's simple) crop, flip, the auto-augment policy or 3-Augment, colour jitter where
    timm applies it, normalization and random erasing."""
    aug = cfg.augment
    transform = create_transform(
        input_size=cfg.resolution.train_size,
        is_training=True,
        no_aug=aug.no_aug,
        scale=tuple(aug.scale),
        hflip=aug.hflip,
        color_jitter=aug.color_jitter,
        auto_augment=THREE_AUGMENT_POLICY if aug.three_augment else aug.auto_augment,
        interpolation=aug.interpolation,
        re_prob=stage_reprob(cfg),
        re_mode=aug.remode,
        re_count=aug.recount,
        mean=tuple(cfg.data.mean),
        std=tuple(cfg.data.std),
    )
    if aug.crop == CropMode.simple:
        transform = with_simple_crop(transform, cfg.resolution.train_size, aug.interpolation)
    return transform


def build_train_pipeline(cfg: DictConfig) -> tuple[Callable | None, BatchNormalize]:
    """The training transform split in two: per image up to uint8 pixels (in the loader workers; with
    data.fast_jpeg, the fast crop), and per batch the float work the trainer runs on the device (data.batch).
    With data.backend=dali there is no per-image transform (None): DALI decodes and augments (data/dali.py)."""
    per_image, per_batch = split_for_batches(build_train_transform(cfg))
    if cfg.data.backend == DataBackend.dali:
        return None, per_batch
    if cfg.data.fast_jpeg:
        per_image = fast_train_transform(per_image)
    return per_image, per_batch


def build_eval_transform(cfg: DictConfig, size: int | None = None) -> Callable:
    """Resize to size / crop_pct, center-crop size (resolution.eval_size unless given), normalize."""
    return create_transform(
        input_size=size or cfg.resolution.eval_size,
        is_training=False,
        crop_pct=cfg.resolution.crop_pct,
        interpolation=cfg.augment.interpolation,
        mean=tuple(cfg.data.mean),
        std=tuple(cfg.data.std),
    )
