"""The training transform split as timm's prefetcher splits it: uint8 pixels per image, float work per batch.

timm's `create_transform` ends every image with to-tensor, normalize and (in training) random erasing: three passes
of small torch ops per image in the loader workers, then a float32 batch four times the size of the pixels. Here
the workers stop at the uint8 pixels (`to_uint8_hwc`) and `BatchNormalize` does the float conversion, the
normalization and timm's random erasing once per batch on the device (the trainer applies it). The pixels are
timm's to float rounding; the erasing draws are the same, taken in the main process instead of the workers, as in
timm's own train.py. Measured in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from timm.data.random_erasing import RandomErasing, _get_pixels
from timm.data.transforms import MaybeToTensor
from torchvision import transforms

from deit_ablate.core.distributed import device_generator

_BATCH_STEPS = (MaybeToTensor, transforms.ToTensor, transforms.Normalize, RandomErasing)


def seed_erasing(seed: int, device: torch.device) -> None:
    """Seed what timm's random erasing draws from for one image: Python's `random` (which, where) and the device's
    generator (pixel-mode noise)."""
    random.seed(seed)
    device_generator(device).manual_seed(seed)


class _BoxRecorder:
    """Stands in for one C x H x W image in timm's RandomErasing: keeps where it erases, holds no pixels."""

    dtype = torch.float32

    def __init__(self, height: int, width: int) -> None:
        self.shape, self.boxes = torch.Size((3, height, width)), []

    def size(self) -> torch.Size:
        return self.shape

    def __setitem__(self, index: tuple[slice, slice, slice], pixels: torch.Tensor) -> None:
        _, rows, cols = index
        self.boxes += [rows.start, cols.start, rows.stop - rows.start, cols.stop - cols.start]


class ErasingBoxes:
    """Where timm's random erasing erases one image, from the image's erasing seed: its Python draws (whether, how
    many boxes, where), taken in a loader worker; the pixels are drawn per batch on the device (`BatchNormalize`)."""

    def __init__(self, erasing: RandomErasing) -> None:
        self.erasing = copy.copy(erasing)
        # its fill made a 3 x 1 x 1 zero on the CPU: the mode decides the pixels alone, never the Python draws
        self.erasing.per_pixel = self.erasing.rand_color = False
        self.erasing.device = "cpu"
        self.length = 2 + 4 * erasing.max_count

    def __call__(self, seed: int, height: int, width: int) -> torch.Tensor:
        """int64 [seed, boxes, top, left, h, w, ...] of an image of `height` x `width`, padded with -1."""
        image = _BoxRecorder(height, width)
        random.seed(seed)
        self.erasing(image)
        padding = [-1] * (self.length - 2 - len(image.boxes))
        return torch.tensor([seed, len(image.boxes) // 4, *image.boxes, *padding], dtype=torch.int64)


def to_uint8_hwc(image: Image.Image) -> torch.Tensor:
    """A PIL image as an H x W x 3 uint8 tensor (the cheapest layout to make and to collate)."""
    return torch.from_numpy(np.array(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8))


class BatchNormalize:
    """The end of timm's training transform, once per batch on the device: float, normalize, random erasing."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], erasing: RandomErasing | None = None) -> None:
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255
        self.inv_std = 1 / (torch.as_tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255)
        self.erasing = copy.copy(erasing)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """mean and 1/std on `device`, copied there once (a copy per batch would wait for the GPU)."""
        if self.mean.device != device:
            self.mean, self.inv_std = self.mean.to(device), self.inv_std.to(device)
        return self.mean, self.inv_std

    def __call__(self, images: torch.Tensor, out: torch.Tensor | None = None,
                 seeds: Sequence[int] | None = None, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """A B x H x W x 3 uint8 batch as a normalized (and erased) B x 3 x H x W float batch.

        `out`, a float tensor of the result's shape on the same device, is overwritten and returned. With `seeds`
        (one per image: streams.py's erasing stream), each image's erasing draws from its own seed; with `boxes`
        (`ErasingBoxes` of each image, from the loader workers), only the erased images' pixels are drawn here,
        from the same seeds: the same result."""
        pixels = images.permute(0, 3, 1, 2)
        if out is None or out.shape != pixels.shape or out.device != images.device:
            out = torch.empty(pixels.shape, dtype=torch.float32, device=images.device)
        mean, inv_std = self._constants(images.device)
        out.copy_(pixels).sub_(mean).mul_(inv_std)
        if self.erasing is not None:
            self.erasing.device = images.device
            if boxes is not None:
                self._fill_boxes(out, boxes)
            elif seeds is None:
                out = self.erasing(out)
            else:
                for image, seed in zip(out, seeds, strict=True):
                    seed_erasing(seed, images.device)
                    self.erasing(image)  # timm erases a 3-D tensor in place
        return out

    def _fill_boxes(self, out: torch.Tensor, boxes: torch.Tensor) -> None:
        """Draw the erased boxes' pixels as timm's erasing draws them, each image's from its seed."""
        generator = device_generator(out.device)
        erasing, chan = self.erasing, out.shape[1]
        erased = (boxes[:, 1] > 0).nonzero().flatten().tolist()
        for index, (seed, count, *box) in zip(erased, boxes[erased].tolist(), strict=True):
            generator.manual_seed(seed)
            for first in range(0, 4 * count, 4):
                top, left, height, width = box[first:first + 4]
                out[index, :, top:top + height, left:left + width] = _get_pixels(
                    erasing.per_pixel, erasing.rand_color, (chan, height, width), dtype=out.dtype, device=out.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={(self.mean / 255).flatten().tolist()}, erasing={self.erasing})"


def split_for_batches(transform: transforms.Compose) -> tuple[transforms.Compose, BatchNormalize]:
    """timm's Compose as the per-image part (up to `to_uint8_hwc`) and the per-batch `BatchNormalize`."""
    steps = list(transform.transforms)
    first = next((i for i, step in enumerate(steps) if isinstance(step, _BATCH_STEPS)), len(steps))
    normalize = next((step for step in steps if isinstance(step, transforms.Normalize)), None)
    if normalize is None or not all(isinstance(step, _BATCH_STEPS) for step in steps[first:]):
        raise ValueError(f"expected a transform ending in to-tensor, normalize (and random erasing): {transform}")
    erasing = next((step for step in steps if isinstance(step, RandomErasing)), None)
    return transforms.Compose([*steps[:first], to_uint8_hwc]), BatchNormalize(normalize.mean, normalize.std, erasing)
