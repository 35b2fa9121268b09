"""Opt-in fast JPEG path for the training transform (`data.fast_jpeg`): cheaper decode and crop.

timm's training transform decodes every JPEG at full size with PIL, then crops and resizes it with PIL's bicubic
filter. Here (measured in docs/PERFORMANCE.md):

1. The loader only opens the file (`lazy_loader`). The crop's position and size are drawn first, from the
   header's size, by timm's own `get_params` (same RNG use). The JPEG is then decoded by libjpeg-turbo
   (simplejpeg) at the coarsest power-of-two DCT scale that still leaves the crop `keep` x the train size on
   each side (1/2, 1/4 and 1/8 cost less than a full decode). With the default keep=0.5 a crop is decoded
   coarser only when it would be shrunk anyway.
2. The crop is flipped (when the flip that follows it in timm's transform says so) and resized by torch's
   antialiased uint8 resize, the same filter as PIL's (within one grey level).
3. As on the default path, the loader hands over uint8 images, and the float conversion, normalization and
   random erasing run once per batch on the device (data.batch).

A crop decoded at full scale comes out within a grey level or two of timm's. Anything else (PNGs, CMYK or
EXIF-rotated JPEGs, decoded images, nearest-neighbour interpolation) is made RGB by the dataset's own loader
(data/images.py), then cropped exactly as by timm. Large crops are decoded below the train size and scaled up, which
blurs them, so the path is off by default.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as nnf
from PIL import ExifTags, Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms
from torchvision.transforms import functional as F

from deit_ablate.data.images import to_rgb

KEEP = 0.5
ORIENTATION = ExifTags.Base.Orientation
_FACTORS = (8, 4, 2)
_TORCH_MODES = {F.InterpolationMode.BILINEAR: "bilinear", F.InterpolationMode.BICUBIC: "bicubic"}


def lazy_loader(path: str) -> Image.Image:
    """An ImageFolder `loader=`: upright RGB and greyscale JPEGs opened but not decoded (the crop decodes them),
    anything else as RGB pixels by the dataset's own rule (data/images.py: EXIF rotation, CMYK, ...)."""
    image = Image.open(path)
    if image.format == "JPEG" and image.mode in ("RGB", "L") and image.getexif().get(ORIENTATION, 1) == 1:
        return image
    with image:
        return to_rgb(image)


def is_undecoded_jpeg(image: Image.Image) -> bool:
    """Whether `image` is a JPEG whose pixels have not been decoded yet."""
    return image.format == "JPEG" and bool(getattr(image, "tile", None))


def dct_factor(crop_w: int, crop_h: int, out_w: int, out_h: int, keep: float = KEEP) -> int:
    """The largest f in 8, 4, 2 (else 1) with crop_w / f >= keep * out_w and crop_h / f >= keep * out_h."""
    for factor in _FACTORS:
        if crop_w / factor >= keep * out_w and crop_h / factor >= keep * out_h:
            return factor
    return 1


def decode_jpeg(image: Image.Image, factor: int = 1) -> np.ndarray:
    """Decode a lazily opened RGB or greyscale JPEG at 1/factor of its size as an HxWx3 uint8 array.

    Raises ValueError for a JPEG libjpeg-turbo cannot turn into RGB (CMYK). libjpeg-turbo's fast DCT and fast
    chroma upsampling are left off: about 5 % off the decode for 1-2 grey levels of error."""
    import simplejpeg  # only the fast path needs it

    if image.mode not in ("RGB", "L"):
        raise ValueError(f"a {image.mode} JPEG is not decoded by the fast path")
    image.fp.seek(0)  # the file PIL opened for the header
    data = image.fp.read()
    width, height = image.size
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=-(-width // factor),
                                  min_height=-(-height // factor))


def resize_uint8(pixels: np.ndarray, size: tuple[int, int], mode: str = "bicubic") -> Image.Image:
    """Resize an HxWx3 uint8 array to size=(height, width) with torch's antialiased filter (PIL's, in uint8)."""
    channels_last = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).unsqueeze(0)
    planes = nnf.interpolate(channels_last, size=size, mode=mode, antialias=True)[0].numpy()  # 3 x H x W
    height, width = size  # merging planes is 6x cheaper than Image.fromarray of the strided H x W x 3 view
    return Image.merge("RGB", [Image.frombuffer("L", (width, height), plane, "raw", "L", 0, 1) for plane in planes])


class FastRandomResizedCrop:
    """timm's random-resized crop (same parameter draw), decoding a lazily opened JPEG only as finely as needed.

    With hflip > 0 it is also the horizontal flip that follows the crop in timm's transform (the same torch draw,
    taken after the crop's): flipping the crop before it is resized costs nothing."""

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), interpolation=F.InterpolationMode.BICUBIC,
                 keep: float = KEEP, hflip: float = 0.0) -> None:
        self.size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        self.scale, self.ratio, self.interpolation = tuple(scale), tuple(ratio), interpolation
        self.keep, self.hflip = keep, hflip

    @classmethod
    def from_timm(cls, crop: RandomResizedCropAndInterpolation, keep: float = KEEP,
                  hflip: float = 0.0) -> FastRandomResizedCrop:
        """The fast crop with the settings of timm's crop (and the probability of the flip after it)."""
        return cls(crop.size, crop.scale, crop.ratio, crop.interpolation, keep, hflip)

    def __call__(self, image: Image.Image) -> Image.Image:
        """Crop and resize to `size`; an RGB or greyscale JPEG not yet decoded takes the fast path."""
        top, left, height, width = RandomResizedCropAndInterpolation.get_params(image, self.scale, self.ratio)
        interpolation = self.interpolation
        if isinstance(interpolation, (tuple, list)):
            interpolation = random.choice(interpolation)
        flip = self.hflip > 0 and bool(torch.rand(1) < self.hflip)  # torchvision's RandomHorizontalFlip draw
        if is_undecoded_jpeg(image) and interpolation in _TORCH_MODES:
            out_h, out_w = self.size
            factor = dct_factor(width, height, out_w, out_h, self.keep)
            try:
                pixels = decode_jpeg(image, factor)
            except ValueError:
                pass  # CMYK and the like: timm's path below
            else:
                image.close()
                crop = _crop(pixels, image.size, top, left, height, width)
                return resize_uint8(crop[:, ::-1] if flip else crop, self.size, _TORCH_MODES[interpolation])
        if image.mode != "RGB":
            image = image.convert("RGB")
        resized = F.resized_crop(image, top, left, height, width, list(self.size), interpolation)
        return F.hflip(resized) if flip else resized

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
                f"interpolation={self.interpolation}, keep={self.keep}, hflip={self.hflip})")


def _crop(pixels: np.ndarray, full_size: tuple[int, int], top: int, left: int, height: int,
          width: int) -> np.ndarray:
    """The crop box of the full-size image, taken from its reduced decode (rounded to decoded pixels)."""
    scale_x, scale_y = full_size[0] / pixels.shape[1], full_size[1] / pixels.shape[0]
    row, col = min(round(top / scale_y), pixels.shape[0] - 1), min(round(left / scale_x), pixels.shape[1] - 1)
    rows = max(1, min(round(height / scale_y), pixels.shape[0] - row))
    cols = max(1, min(round(width / scale_x), pixels.shape[1] - col))
    return pixels[row:row + rows, col:col + cols]


def fast_train_transform(per_image: transforms.Compose, keep: float = KEEP) -> transforms.Compose:
    """The per-image part of the training transform (data.batch.split_for_batches) with timm's crop and flip
    replaced by the fast crop; pair it with `lazy_loader`."""
    steps = list(per_image.transforms)
    index = next((i for i, step in enumerate(steps) if isinstance(step, RandomResizedCropAndInterpolation)), None)
    if index is None:
        raise ValueError("the fast JPEG path speeds up a random-resized crop, and this transform has none: "
                         f"{per_image}. Turn data.fast_jpeg off for it.")
    flip = steps[index + 1] if index + 1 < len(steps) else None
    if isinstance(flip, transforms.RandomHorizontalFlip):
        steps[index:index + 2] = [FastRandomResizedCrop.from_timm(steps[index], keep, hflip=flip.p)]
    else:
        steps[index] = FastRandomResizedCrop.from_timm(steps[index], keep)
    if index > 0:  # steps before the crop would need the pixels: decode the image first
        steps.insert(0, _decode_full)
    return transforms.Compose(steps)


def _decode_full(image: Image.Image) -> Image.Image:
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")
