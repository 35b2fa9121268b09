"""DeiT III's 3-Augment and simple random crop (Touvron, Cord & Jégou 2022, DeiT III, arXiv:2204.07118, Sec. 3).

3-Augment: after the crop and the flip, each image gets exactly one of grayscale, solarization or Gaussian blur,
chosen uniformly, then colour jitter (brightness, contrast, saturation at 0.3; no hue). timm builds it as its
AutoAugment policy "3a" (three single-op sub-policies, one drawn per image) and keeps its colour jitter on beside
it; the parameters, as DeiT III's released augment.py sets them:

- grayscale: PIL's ITU-R 601-2 luma on all three channels (timm's Desaturate at magnitude 10: saturation 0);
- solarization: PIL's `ImageOps.solarize` at threshold 128 (values >= 128 inverted; timm's Solarize at 5);
- Gaussian blur: PIL's `GaussianBlur` with a radius (its sigma) drawn uniformly from [0.1, 2.0] per image.

Simple random crop: the smaller side resized to the train size, then a random crop of the train size from the
image padded by 4 pixels on every side with its reflection (DeiT III's `--src`, used on ImageNet-21k).
"""

from __future__ import annotations

from timm.data.transforms import RandomResizedCropAndInterpolation, str_to_interp_mode
from torchvision import transforms

# timm's AutoAugment policy that is DeiT III's choice of one of three ops (timm.data.auto_augment).
THREE_AUGMENT_POLICY = "3a"
SOLARIZE_THRESHOLD = 128
BLUR_RADIUS = (0.1, 2.0)
SIMPLE_CROP_PADDING = 4


def simple_random_crop(size: int, interpolation: str) -> list:
    """DeiT III's simple random crop as two steps: resize the smaller side to `size`, then a reflect-padded crop."""
    return [transforms.Resize(size, interpolation=str_to_interp_mode(interpolation)),
            transforms.RandomCrop(size, padding=SIMPLE_CROP_PADDING, padding_mode="reflect")]


def with_simple_crop(transform: transforms.Compose, size: int, interpolation: str) -> transforms.Compose:
    """`transform` (timm's training transform) with its random-resized crop replaced by the simple random crop."""
    steps = list(transform.transforms)
    index = next((i for i, step in enumerate(steps) if isinstance(step, RandomResizedCropAndInterpolation)), None)
    if index is None:
        raise ValueError(f"expected timm's random-resized crop to replace: {transform}")
    steps[index:index + 1] = simple_random_crop(size, interpolation)
    return transforms.Compose(steps)
