"""DeiT III's 3-Augment and simple random crop, against their definitions (Touvron, Cord & Jégou 2022, Sec. 3)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from timm.data.auto_augment import AutoAugment
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms

from deit_ablate.core.errors import ConfigError
from deit_ablate.data.transforms import build_train_pipeline, build_train_transform
from deit_ablate.run.validate import validate_config
from tests.conftest import TINY, compose_config, run_train, transform_spec

SIZE = 32  # the demo preset's train size


def _noise(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _step(transform: transforms.Compose, kind: type):
    return next(step for step in transform.transforms if isinstance(step, kind))


def _grayscale(pixels: np.ndarray) -> np.ndarray:
    """ITU-R 601-2 luma, PIL's fixed-point rounding, on all three channels."""
    r, g, b = (pixels[..., c].astype(np.int64) for c in range(3))
    luma = (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16
    return np.repeat(luma[..., None], 3, axis=2).astype(np.uint8)


def _solarize(pixels: np.ndarray) -> np.ndarray:
    return np.where(pixels >= 128, 255 - pixels, pixels).astype(np.uint8)


def test_the_config_composes_with_deit_iii_values():
    cfg = compose_config(["augment=three_augment", "augment.crop=simple"])
    validate_config(cfg)
    aug = cfg.augment
    assert (aug.three_augment, aug.auto_augment, aug.color_jitter, aug.reprob, aug.crop) == (True, None, 0.3, 0.0,
                                                                                            "simple")
    names = [type(step).__name__ for step in build_train_transform(transform_spec(cfg)).transforms]
    assert names == ["Resize", "RandomCrop", "RandomHorizontalFlip", "AutoAugment", "ColorJitter", "MaybeToTensor",
                     "Normalize"]


def test_three_augment_keeps_the_random_resized_crop_and_adds_flip_and_jitter_03():
    transform = build_train_transform(transform_spec(compose_config(["augment=three_augment"])))
    crop = transform.transforms[0]
    assert isinstance(crop, RandomResizedCropAndInterpolation) and crop.scale == (0.08, 1.0)
    assert _step(transform, transforms.RandomHorizontalFlip).p == 0.5
    jitter = _step(transform, transforms.ColorJitter)
    assert (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue) == ((0.7, 1.3),) * 3 + (None,)
    names = [type(step).__name__ for step in transform.transforms]
    assert names.index("AutoAugment") < names.index("ColorJitter")
    assert "RandAugment" not in names and "RandomErasing" not in names


def test_exactly_one_of_grayscale_solarize_blur_per_image_chosen_uniformly(monkeypatch):
    ops = _step(build_train_transform(transform_spec(compose_config(["augment=three_augment"]))), AutoAugment)
    pixels = _noise(SIZE, SIZE)
    image = Image.fromarray(pixels)
    radii, uniform = [], random.uniform

    def recording_uniform(low, high):
        assert (low, high) == (0.1, 2.0)  # DeiT III's blur radius range
        radii.append(uniform(low, high))
        return radii[-1]

    monkeypatch.setattr(random, "uniform", recording_uniform)
    random.seed(0)
    counts = {"grayscale": 0, "solarize": 0, "blur": 0}
    for _ in range(900):
        before = len(radii)
        out = np.asarray(ops(image))
        if len(radii) > before:
            blurred = np.asarray(image.filter(ImageFilter.GaussianBlur(radius=radii[-1])))
            np.testing.assert_array_equal(out, blurred)
            assert out.astype(float).var() < pixels.astype(float).var()
            counts["blur"] += 1
        elif np.array_equal(out, _grayscale(pixels)):
            counts["grayscale"] += 1
        else:
            np.testing.assert_array_equal(out, _solarize(pixels))
            counts["solarize"] += 1
    assert all(240 <= n <= 360 for n in counts.values()), counts  # 300 each expected; sd 14


def test_grayscale_gives_equal_channels_and_solarize_inverts_from_128():
    ops = _step(build_train_transform(transform_spec(compose_config(["augment=three_augment"]))), AutoAugment)
    by_name = {sub[0].name: sub[0] for sub in ops.policy}
    grayscale, solarize = by_name["Desaturate"], by_name["Solarize"]
    ramp = np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 3, axis=2)
    np.testing.assert_array_equal(np.asarray(solarize(Image.fromarray(ramp)))[0, :, 0],
                                  [*range(128), *range(127, -1, -1)])
    out = np.asarray(grayscale(Image.fromarray(_noise(8, 8))))
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all()


def _window_of(out: np.ndarray, padded: np.ndarray) -> tuple[int, int]:
    """The (top, left) of the window of `padded` that `out` is, exactly; fails if there is none."""
    height, width = out.shape[:2]
    hits = [(top, left) for top in range(padded.shape[0] - height + 1) for left in range(padded.shape[1] - width + 1)
            if np.array_equal(padded[top:top + height, left:left + width], out)]
    assert len(hits) == 1, f"{len(hits)} windows match"
    return hits[0]


@pytest.mark.parametrize("shape", [(SIZE, 48), (64, 96), (80, 40)])
def test_simple_crop_is_a_window_of_the_resized_reflect_padded_image(shape):
    transform = build_train_transform(transform_spec(compose_config(["augment.crop=simple"])))
    crop = transforms.Compose(transform.transforms[:2])
    image = Image.fromarray(_noise(*shape))
    scale = SIZE / min(shape)  # the smaller side to the train size, the aspect kept
    resized = image.resize((round(shape[1] * scale), round(shape[0] * scale)), Image.BICUBIC)
    padded = np.pad(np.asarray(resized), ((4, 4), (4, 4), (0, 0)), mode="reflect")
    offsets = set()
    for seed in range(150):
        torch.manual_seed(seed)  # torchvision's RandomCrop draws from torch
        out = np.asarray(crop(image))
        assert out.shape == (SIZE, SIZE, 3)
        offsets.add(_window_of(out, padded))
    tops, lefts = {top for top, _ in offsets}, {left for _, left in offsets}
    assert min(tops) == 0 and max(tops) == padded.shape[0] - SIZE  # reaches into the padding on both sides
    assert min(lefts) == 0 and max(lefts) == padded.shape[1] - SIZE


@pytest.mark.parametrize("augment", ["randaugment", "three_augment"])
def test_simple_crop_works_with_either_policy_and_the_batch_split(augment):
    cfg = compose_config([f"augment={augment}", "augment.crop=simple"])
    validate_config(cfg)
    per_image, per_batch = build_train_pipeline(transform_spec(cfg))
    image = Image.fromarray(_noise(40, 56))
    random.seed(0)
    pixels = per_image(image)
    assert pixels.shape == (SIZE, SIZE, 3) and pixels.dtype == torch.uint8
    assert per_batch(pixels[None]).shape == (1, 3, SIZE, SIZE)


def test_defaults_keep_the_random_resized_crop_and_no_three_augment():
    default = build_train_transform(transform_spec(compose_config([])))
    explicit = build_train_transform(transform_spec(compose_config(["augment.crop=rrc",
                                                                    "augment.three_augment=false"])))
    assert repr(default) == repr(explicit)
    assert isinstance(default.transforms[0], RandomResizedCropAndInterpolation)
    assert not any(isinstance(step, (AutoAugment, transforms.ColorJitter)) for step in default.transforms)


@pytest.mark.parametrize("overrides, message", [
    (["augment=three_augment", "data.backend=dali"],
     "data.backend=dali: augment.three_augment=true (DeiT III) is built for the pil backend only; set "
     "data.backend=pil."),
    (["augment.crop=simple", "data.backend=dali"],
     "data.backend=dali: augment.crop=simple (DeiT III) is built for the pil backend only; set data.backend=pil."),
    (["augment=three_augment", "augment.auto_augment=rand-m9-mstd0.5-inc1"], "set augment.auto_augment=null"),
    (["augment.crop=simple", "data.fast_jpeg=true"], "Set data.fast_jpeg=false."),
    (["augment.crop=simple", "augment.no_aug=true"], "set augment.no_aug=false."),
    (["augment.crop=simple", "augment.interpolation=random"], "set augment.interpolation to bicubic"),
])
def test_what_the_options_cannot_run_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config(overrides))
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_demo_run_with_three_augment_and_simple_crop_trains(tmp_path, data_cache):
    run_train(TINY + ["augment=three_augment", "augment.crop=simple", "train.max_steps=2"], tmp_path, data_cache)
    logged = [path.read_text() for path in tmp_path.rglob("config.yaml")]
    assert logged and all("three_augment: true" in text and "crop: simple" in text for text in logged)
