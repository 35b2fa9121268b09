"""Train and eval transforms from timm's create_transform, with DeiT's augmentation settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from timm.data import create_transform

from deit_ablate.config.schema import AugmentConfig, CropMode, DataBackend, DataConfig, ResolutionConfig
from deit_ablate.data.batch import BatchNormalize, split_for_batches
from deit_ablate.data.fast_jpeg import fast_train_transform
from deit_ablate.data.three_augment import THREE_AUGMENT_POLICY, with_simple_crop


@dataclass(frozen=True)
class TransformSpec:
    """The config groups the image transforms read, from the config the stage runs (stage_config.py: a fine-tune's
    or transfer's override set applied, transfer.reprob among them): built once by the caller."""

    data: DataConfig
    augment: AugmentConfig
    resolution: ResolutionConfig


def build_train_transform(spec: TransformSpec) -> Callable:
    """Random-resized (or DeiT III's simple) crop, flip, the auto-augment policy or 3-Augment, colour jitter where
    timm applies it, normalization and random erasing (at the stage's augment.reprob)."""
    aug = spec.augment
    transform = create_transform(
        input_size=spec.resolution.train_size,
        is_training=True,
        no_aug=aug.no_aug,
        scale=tuple(aug.scale),
        hflip=aug.hflip,
        color_jitter=aug.color_jitter,
        auto_augment=THREE_AUGMENT_POLICY if aug.three_augment else aug.auto_augment,
        interpolation=aug.interpolation,
        re_prob=float(aug.reprob),
        re_mode=aug.remode,
        re_count=aug.recount,
        mean=tuple(spec.data.mean),
        std=tuple(spec.data.std),
    )
    if aug.crop == CropMode.simple:
        transform = with_simple_crop(transform, spec.resolution.train_size, aug.interpolation)
    return transform


def build_train_pipeline(spec: TransformSpec) -> tuple[Callable | None, BatchNormalize]:
    """The training transform split in two: per image up to uint8 pixels (in the loader workers; with
    data.fast_jpeg, the fast crop), and per batch the float work the trainer runs on the device (data.batch).
    With data.backend=dali there is no per-image transform (None): DALI decodes and augments (data/dali.py)."""
    per_image, per_batch = split_for_batches(build_train_transform(spec))
    if spec.data.backend == DataBackend.dali:
        return None, per_batch
    if spec.data.fast_jpeg:
        per_image = fast_train_transform(per_image)
    return per_image, per_batch


def build_eval_transform(spec: TransformSpec, size: int | None = None) -> Callable:
    """Resize to size / crop_pct, center-crop size (resolution.eval_size unless given), normalize."""
    return create_transform(
        input_size=size or spec.resolution.eval_size,
        is_training=False,
        crop_pct=spec.resolution.crop_pct,
        interpolation=spec.augment.interpolation,
        mean=tuple(spec.data.mean),
        std=tuple(spec.data.std),
    )
