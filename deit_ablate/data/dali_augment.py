"""DeiT's training augmentation as a DALI graph: random-resized crop, flip and timm's RandAugment.

timm's `rand-m9-mstd0.5-inc1` (the policy of DeiT's Table 9) applies 2 ops drawn with replacement from the 15 of
`_RAND_INCREASING_TRANSFORMS`, each with probability 0.5, each at a magnitude level drawn per application from
N(9, 0.5) clipped to [0, 10]. DALI's own `auto_aug.rand_augment` differs (14 other ops with `identity`, no Invert
or SolarizeAdd, no magnitude noise, every selected op applied), so the policy is rebuilt here from DALI's
augmentation primitives with timm's op list and timm's level-to-argument rules (`RAND_INCREASING_OPS`). What is
left different is listed in README.md ("The dali backend"): linear (not bicubic) warps, one grey fill value, the
crop's fallback, OpenCV's equalize and DALI's saturation for Color.

This module imports DALI; import it through `deit_ablate.data.dali`, which says how to install DALI if it is absent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from nvidia.dali import fn, math, types
from nvidia.dali.auto_aug import augmentations as dali_ops
from nvidia.dali.auto_aug.core import select

LEVEL_DENOM = 10.0  # timm's magnitude scale: level / 10 is the fraction of each op's range


def _fraction(level: float) -> float:
    return level / LEVEL_DENOM


# timm's level-to-argument rules (auto_augment.py, the "increasing" variants) on a plain level in [0, 10]; the graph
# below computes the same in DALI arithmetic per sample, and tests compare the two (None: the op takes no argument).
LEVEL_TO_ARG = {
    "AutoContrast": None,
    "Equalize": None,
    "Invert": None,
    "Rotate": lambda level: _fraction(level) * 30.0,  # degrees, either way
    "PosterizeIncreasing": lambda level: 4 - int(_fraction(level) * 4),  # bits kept, 4 down to 0 (black)
    "SolarizeIncreasing": lambda level: 256 - min(256, int(_fraction(level) * 256)),  # threshold, 256 down to 0
    "SolarizeAdd": lambda level: min(128, int(_fraction(level) * 110)),  # added below 128
    "ColorIncreasing": lambda level: max(0.1, 1.0 + _fraction(level) * 0.9),  # enhance factor, 1 +- 0.9
    "ContrastIncreasing": lambda level: max(0.1, 1.0 + _fraction(level) * 0.9),
    "BrightnessIncreasing": lambda level: max(0.1, 1.0 + _fraction(level) * 0.9),
    "SharpnessIncreasing": lambda level: max(0.1, 1.0 + _fraction(level) * 0.9),
    "ShearX": lambda level: _fraction(level) * 0.3,  # shear factor, either way
    "ShearY": lambda level: _fraction(level) * 0.3,
    "TranslateXRel": lambda level: _fraction(level) * 0.45,  # fraction of the width, either way
    "TranslateYRel": lambda level: _fraction(level) * 0.45,
}
NEGATED = ("Rotate", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
           "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")  # timm's _randomly_negate: either sign, 50/50


def _like(images, node):
    """`node` (computed on the CPU per sample) where `images` are, for arithmetic with them."""
    return node.gpu() if images.device == "gpu" else node


def _enhance(level, sign):
    return math.max(1.0 + sign * level * 0.09, 0.1)


def _u8(value: int):
    return types.Constant(value, dtype=types.UINT8)


def auto_contrast(images, level, sign, fill_value, shape):
    return dali_ops.auto_contrast.op(images, None)


def equalize(images, level, sign, fill_value, shape):
    return fn.equalize(images)


def invert(images, level, sign, fill_value, shape):
    return _u8(255) - images


def rotate(images, level, sign, fill_value, shape):
    return fn.rotate(images, angle=sign * level * 3.0, fill_value=fill_value, keep_size=True)


def posterize(images, level, sign, fill_value, shape):
    bits = 4 - fn.cast(math.floor(level * 0.4), dtype=types.INT32)
    mask = fn.cast(256 - fn.cast(math.pow(2.0, fn.cast(8 - bits, dtype=types.FLOAT)), dtype=types.INT32),
                   dtype=types.UINT8)
    return images & _like(images, mask)


def solarize(images, level, sign, fill_value, shape):
    threshold = 256 - math.min(fn.cast(math.floor(level * 25.6), dtype=types.INT32), 256)
    keep = images < _like(images, threshold)
    return fn.cast(keep * images + (keep ^ True) * (_u8(255) - images), dtype=types.UINT8)


def solarize_add(images, level, sign, fill_value, shape):
    shift = fn.cast(math.min(math.floor(level * 11.0), 128.0), dtype=types.UINT8)
    low = images < _u8(128)
    return fn.cast(low * (images + _like(images, shift)) + (low ^ True) * images, dtype=types.UINT8)


def color(images, level, sign, fill_value, shape):
    return fn.saturation(images, saturation=_enhance(level, sign))


def contrast(images, level, sign, fill_value, shape):
    return dali_ops.contrast.op(images, _like(images, _enhance(level, sign)))


def brightness(images, level, sign, fill_value, shape):
    return fn.brightness(images, brightness=_enhance(level, sign))


_IDENTITY_KERNEL = np.array([[0, 0, 0], [0, 1, 0], [0, 0, 0]], dtype=np.float32)
_SMOOTH_KERNEL = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=np.float32) / 13  # PIL's ImageFilter.SMOOTH


def sharpness(images, level, sign, fill_value, shape):
    """PIL's Sharpness: factor f blends the image with its smoothed self, the kernel f * identity + (1 - f) * smooth."""
    factor = _enhance(level, sign)
    kernel = types.Constant(_IDENTITY_KERNEL) * factor + types.Constant(_SMOOTH_KERNEL) * (1.0 - factor)
    return fn.filter(images, _like(images, kernel))


def _warp(images, matrix, fill_value):
    return fn.warp_affine(images, matrix=matrix, fill_value=fill_value, inverse_map=True)  # as PIL: output to input


def shear_x(images, level, sign, fill_value, shape):
    return _warp(images, fn.transforms.shear(shear=fn.stack(sign * level * 0.03, level * 0.0)), fill_value)


def shear_y(images, level, sign, fill_value, shape):
    return _warp(images, fn.transforms.shear(shear=fn.stack(level * 0.0, sign * level * 0.03)), fill_value)


def translate_x(images, level, sign, fill_value, shape):
    offset = fn.stack(sign * level * (0.045 * shape[1]), level * 0.0)
    return _warp(images, fn.transforms.translation(offset=offset), fill_value)


def translate_y(images, level, sign, fill_value, shape):
    offset = fn.stack(level * 0.0, sign * level * (0.045 * shape[0]))
    return _warp(images, fn.transforms.translation(offset=offset), fill_value)


def identity(images, level, sign, fill_value, shape):
    return images


# timm's _RAND_INCREASING_TRANSFORMS, in its order, as DALI graph pieces.
RAND_INCREASING_OPS = {
    "AutoContrast": auto_contrast,
    "Equalize": equalize,
    "Invert": invert,
    "Rotate": rotate,
    "PosterizeIncreasing": posterize,
    "SolarizeIncreasing": solarize,
    "SolarizeAdd": solarize_add,
    "ColorIncreasing": color,
    "ContrastIncreasing": contrast,
    "BrightnessIncreasing": brightness,
    "SharpnessIncreasing": sharpness,
    "ShearX": shear_x,
    "ShearY": shear_y,
    "TranslateXRel": translate_x,
    "TranslateYRel": translate_y,
}


@dataclass(frozen=True)
class RandAugmentSpec:
    """timm's RandAugment settings: ops per image, magnitude level, its noise, each op's probability."""

    num_ops: int = 2
    magnitude: float = 9.0
    magnitude_std: float = 0.5
    prob: float = 0.5


_RAND_SECTION = re.compile(r"(m|n|mstd|p|inc)([\d.]+)")


def parse_rand_augment(policy: str) -> RandAugmentSpec | str:
    """A `rand-...` policy string as a RandAugmentSpec, or what the DALI backend cannot run of it."""
    kind, *sections = policy.split("-")
    if kind != "rand":
        return f"'{kind}' policies are not built for DALI (only timm's RandAugment, rand-...-inc1)"
    values, increasing = {}, False
    for section in sections:
        match = _RAND_SECTION.fullmatch(section)
        if match is None:
            return f"section '{section}' is not built for DALI (m, n, mstd, p and inc1 are)"
        if match[1] == "inc":
            increasing = bool(int(float(match[2])))
        else:
            values[match[1]] = float(match[2])
    if not increasing:
        return "only timm's 'increasing' op list (inc1) is built for DALI"
    if values.get("mstd", 0.5) == float("inf") or values.get("mstd", 0.0) > 100:
        return "uniform magnitude sampling (mstd inf / > 100) is not built for DALI"
    return RandAugmentSpec(num_ops=int(values.get("n", 2)), magnitude=values.get("m", 9.0),
                           magnitude_std=values.get("mstd", 0.0), prob=values.get("p", 0.5))


def rand_augment(images, spec: RandAugmentSpec, fill_value: int, shape):
    """timm's RandAugment on a batch of uint8 HWC images (a pipeline with enable_conditionals=True): per layer an op
    drawn with replacement, applied with probability spec.prob at a level drawn from N(m, mstd) clipped to [0, 10]."""
    ops = [*RAND_INCREASING_OPS.values(), identity]
    skip = len(ops) - 1
    for _ in range(spec.num_ops):
        op = fn.random.uniform(values=list(range(skip)), dtype=types.INT32)
        if spec.prob < 1.0:
            applied = fn.random.coin_flip(probability=spec.prob, dtype=types.INT32)
            op = op * applied + skip * (1 - applied)
        level = fn.random.normal(mean=spec.magnitude, stddev=spec.magnitude_std) if spec.magnitude_std > 0 else (
            fn.random.uniform(range=[spec.magnitude, spec.magnitude]))
        level = math.clamp(level, 0.0, LEVEL_DENOM)
        sign = 1.0 - 2.0 * fn.cast(fn.random.coin_flip(probability=0.5, dtype=types.INT32), dtype=types.FLOAT)
        images = select(ops, op, images, level=level, sign=sign, fill_value=fill_value, shape=shape)
    return images


def decoder_device(gpu: bool) -> str:
    """DALI's decoder placement: "mixed" (nvJPEG: host bytes in, GPU images out) on a GPU, "cpu" otherwise."""
    return "mixed" if gpu else "cpu"


def deit_train_images(encoded, *, size: int, scale: tuple[float, float], ratio: tuple[float, float], hflip: float,
                      rand_spec: RandAugmentSpec | None, fill_value: int, gpu: bool, interpolation: str = "bicubic"):
    """Decoded, random-resized-cropped (to `size`), flipped and RandAugmented uint8 HWC images."""
    images = fn.decoders.image_random_crop(encoded, device=decoder_device(gpu), output_type=types.RGB,
                                           random_area=list(scale), random_aspect_ratio=list(ratio),
                                           num_attempts=10)
    interp = types.INTERP_CUBIC if interpolation == "bicubic" else types.INTERP_LINEAR
    images = fn.resize(images, size=[size, size], interp_type=interp, antialias=True)
    if hflip > 0:
        images = fn.flip(images, horizontal=fn.random.coin_flip(probability=hflip))
    if rand_spec is not None:
        images = rand_augment(images, rand_spec, fill_value, shape=(size, size))
    return images
