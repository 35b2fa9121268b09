"""Opt-in faster JPEG decoding for training: decode at a reduced DCT scale when the random crop is large.

A JPEG can be decoded at 1/2, 1/4 or 1/8 of its size for a fraction of the cost (PIL's `Image.draft`, the
DCT scaling of libjpeg). The default pipeline decodes every image at full size and then lets the random-resized
crop shrink most crops to the train size. Here the loader only opens the file (`lazy_loader`), the crop's
position and size are drawn first from the header's size (the same draw as timm's crop, from the same RNG), and
the image is decoded at the coarsest scale that still leaves the crop `keep` x the train size on each side.
With the default keep=0.5, a crop is decoded coarser only when it would have been shrunk to the train size
anyway; smaller crops, PNGs and other formats are decoded and cropped exactly as by timm.

It changes pixels (a DCT-scaled decode is not a bicubic shrink), so it is off by default.
"""

from __future__ import annotations

import random

from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms
from torchvision.transforms import functional as F

KEEP = 0.5
_FACTORS = (8, 4, 2)


def lazy_loader(path: str) -> Image.Image:
    """An ImageFolder `loader=`: JPEGs opened but not decoded (the crop decodes them), anything else as RGB."""
    image = Image.open(path)
    if image.format == "JPEG":
        return image
    with image:
        return image.convert("RGB")


def is_undecoded_jpeg(image: Image.Image) -> bool:
    """Whether `image` is a JPEG whose pixels have not been decoded yet (a draft can still apply)."""
    return image.format == "JPEG" and bool(getattr(image, "tile", None))


def dct_factor(crop_w: int, crop_h: int, out_w: int, out_h: int, keep: float = KEEP) -> int:
    """The largest f in 8, 4, 2 (else 1) with crop_w / f >= keep * out_w and crop_h / f >= keep * out_h."""
    for factor in _FACTORS:
        if crop_w / factor >= keep * out_w and crop_h / factor >= keep * out_h:
            return factor
    return 1


def decode_reduced(image: Image.Image, factor: int) -> tuple[Image.Image, float]:
    """Decode a lazily opened JPEG at 1/factor of its size (or the nearest scale PIL allows) as RGB.

    Returns the RGB image and the scale actually used (original pixels per decoded pixel)."""
    scale = 1.0
    if factor > 1 and is_undecoded_jpeg(image):
        width, height = image.size
        drafted = image.draft("RGB", (max(width // factor, 1), max(height // factor, 1)))
        if drafted is not None:
            scale = width / drafted[1][2]
    image.load()
    return (image if image.mode == "RGB" else image.convert("RGB")), scale


class DraftRandomResizedCrop:
    """timm's random-resized crop (same parameter draw), decoding a lazily opened JPEG only as finely as needed."""

    def __init__(self, size: int | tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), interpolation=F.InterpolationMode.BICUBIC,
                 keep: float = KEEP) -> None:
        self.size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        self.scale, self.ratio, self.interpolation, self.keep = scale, ratio, interpolation, keep

    @classmethod
    def from_timm(cls, crop: RandomResizedCropAndInterpolation, keep: float = KEEP) -> DraftRandomResizedCrop:
        """The draft crop with the settings of timm's crop."""
        return cls(crop.size, crop.scale, crop.ratio, crop.interpolation, keep)

    def __call__(self, image: Image.Image) -> Image.Image:
        """Crop and resize to `size`; a large crop of an undecoded JPEG is decoded at a reduced scale first."""
        top, left, height, width = RandomResizedCropAndInterpolation.get_params(image, self.scale, self.ratio)
        interpolation = self.interpolation
        if isinstance(interpolation, (tuple, list)):
            interpolation = random.choice(interpolation)
        out_h, out_w = self.size
        factor = dct_factor(width, height, out_w, out_h, self.keep) if is_undecoded_jpeg(image) else 1
        image, scale = decode_reduced(image, factor) if isinstance(image, Image.Image) else (image, 1.0)
        if scale == 1.0:
            return F.resized_crop(image, top, left, height, width, [out_h, out_w], interpolation)
        box = (left / scale, top / scale, (left + width) / scale, (top + height) / scale)
        return image.resize((out_w, out_h), F.pil_modes_mapping[interpolation], box=box)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
                f"interpolation={self.interpolation}, keep={self.keep})")


def with_draft_crop(transform: transforms.Compose, keep: float = KEEP) -> transforms.Compose:
    """timm's training Compose with its random-resized crop replaced by the draft crop (pair with lazy_loader)."""
    steps = list(transform.transforms)
    index = next((i for i, step in enumerate(steps) if isinstance(step, RandomResizedCropAndInterpolation)), None)
    if index is None:
        raise ValueError("fast JPEG decoding needs a training transform with a random-resized crop; none found in "
                         f"{transform}. Turn data.fast_jpeg off for this transform.")
    steps[index] = DraftRandomResizedCrop.from_timm(steps[index], keep)
    if index > 0:  # steps before the crop would decode the image at full size: decode it first
        steps.insert(0, _decode_full)
    return transforms.Compose(steps)


def _decode_full(image: Image.Image) -> Image.Image:
    return decode_reduced(image, 1)[0]
