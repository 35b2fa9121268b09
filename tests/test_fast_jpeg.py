"""The opt-in fast JPEG path: reduced decoding only for large crops of JPEGs, same output format as timm's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation

from deit_ablate.data.builtin import draw_image
from deit_ablate.data.fast_jpeg import (
    DraftRandomResizedCrop,
    dct_factor,
    decode_reduced,
    lazy_loader,
    with_draft_crop,
)
from deit_ablate.data.transforms import build_train_transform
from tests.conftest import compose_config


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A 500x375 JPEG (quality 90), the same picture as PNG, and a greyscale JPEG."""
    folder = tmp_path_factory.mktemp("fast_jpeg")
    picture = draw_image(3, 500, np.random.default_rng(0)).crop((0, 62, 500, 437))
    paths = {"jpeg": folder / "a.jpg", "png": folder / "a.png", "grey": folder / "g.jpg"}
    picture.save(paths["jpeg"], quality=90)
    picture.save(paths["png"])
    picture.convert("L").save(paths["grey"], quality=90)
    return paths


def test_a_full_crop_of_a_500x375_jpeg_is_decoded_at_half_size_for_224(images):
    factor = dct_factor(500, 375, 224, 224)
    assert factor == 2
    decoded, scale = decode_reduced(lazy_loader(str(images["jpeg"])), factor)
    assert decoded.size == (250, 188) and scale == 2.0 and decoded.mode == "RGB"


def _assert_crops_like_timm(path, timm_crop, seed: int) -> None:
    """The fast path, given the same random draws, yields timm's crop pixel for pixel."""
    random.seed(seed)
    expected = timm_crop(Image.open(path).convert("RGB"))
    random.seed(seed)
    got = DraftRandomResizedCrop.from_timm(timm_crop)(lazy_loader(str(path)))
    assert np.array_equal(np.asarray(expected), np.asarray(got))


def test_pngs_are_loaded_whole_and_cropped_exactly_as_by_timm(images):
    image = lazy_loader(str(images["png"]))
    assert image.size == (500, 375) and image.mode == "RGB"
    assert decode_reduced(image, 8)[0].size == (500, 375)  # no draft for a PNG
    _assert_crops_like_timm(images["png"], RandomResizedCropAndInterpolation(224, interpolation="bicubic"), seed=7)


def test_small_crops_of_a_jpeg_keep_full_resolution_and_timm_pixels(images):
    timm_crop = RandomResizedCropAndInterpolation(224, scale=(0.08, 0.1), interpolation="bicubic")
    _assert_crops_like_timm(images["jpeg"], timm_crop, seed=3)


def test_large_crops_are_decoded_reduced_and_still_come_out_at_train_size(images):
    crop = DraftRandomResizedCrop(224, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    out = crop(lazy_loader(str(images["jpeg"])))
    assert out.size == (224, 224) and out.mode == "RGB"
    reference = np.asarray(Image.open(images["jpeg"]).convert("RGB").resize((224, 224), Image.BICUBIC), dtype=float)
    assert np.abs(np.asarray(out, dtype=float) - reference).mean() < 12  # the same picture, other pixels


def test_greyscale_jpegs_come_out_rgb(images):
    out = DraftRandomResizedCrop(224, scale=(1.0, 1.0))(lazy_loader(str(images["grey"])))
    assert out.mode == "RGB" and out.size == (224, 224)


@pytest.mark.parametrize("reprob", [0.0, 1.0])
def test_the_full_deit_train_transform_with_the_fast_path(images, reprob):
    cfg = compose_config(["resolution=224px", f"augment.reprob={reprob}"])
    transform = with_draft_crop(build_train_transform(cfg))
    assert isinstance(transform.transforms[0], DraftRandomResizedCrop)
    mean, std = torch.tensor(cfg.data.mean), torch.tensor(cfg.data.std)
    low, high = float((-mean / std).min()), float(((1 - mean) / std).max())
    for seed in range(8):
        random.seed(seed)
        torch.manual_seed(seed)
        out = transform(lazy_loader(str(images["jpeg"])))
        assert out.shape == (3, 224, 224) and out.dtype == torch.float32 and torch.isfinite(out).all()
        if reprob == 0:
            assert low - 1e-5 <= out.min() and out.max() <= high + 1e-5
        else:  # erased pixels are N(0, 1) draws
            assert out.abs().max() < 10


def test_a_transform_without_a_random_resized_crop_is_refused():
    cfg = compose_config(["resolution=224px"])
    from deit_ablate.data.transforms import build_eval_transform

    with pytest.raises(ValueError, match="random-resized crop"):
        with_draft_crop(build_eval_transform(cfg))
