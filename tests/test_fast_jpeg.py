"""The opt-in fast JPEG path: reduced decoding for large crops, the flip folded in, torch's resize."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms
from torchvision.transforms import functional as F

from deit_ablate.core.errors import ConfigError
from deit_ablate.data.batch import split_for_batches
from deit_ablate.data.builtin import draw_image
from deit_ablate.data.datasets import build_dataset
from deit_ablate.data.fast_jpeg import (
    FastRandomResizedCrop,
    dct_factor,
    decode_jpeg,
    fast_train_transform,
    lazy_loader,
    resize_uint8,
)
from deit_ablate.data.transforms import build_eval_transform, build_train_pipeline
from deit_ablate.record.rundir import RESULT, runs_root
from deit_ablate.run.validate import validate_config
from tests.conftest import TINY, compose_config, run_train, transform_spec


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A 500x375 JPEG (quality 90), the same picture as PNG, and greyscale and CMYK JPEGs of it."""
    folder = tmp_path_factory.mktemp("fast_jpeg")
    picture = draw_image(3, 500, np.random.default_rng(0)).crop((0, 62, 500, 437))
    paths = {"jpeg": folder / "a.jpg", "png": folder / "a.png", "grey": folder / "g.jpg", "cmyk": folder / "c.jpg"}
    picture.save(paths["jpeg"], quality=90)
    picture.save(paths["png"])
    picture.convert("L").save(paths["grey"], quality=90)
    picture.convert("CMYK").save(paths["cmyk"], quality=90)
    return paths


def _pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def test_dct_factor_keeps_the_crop_at_least_keep_times_the_train_size():
    assert dct_factor(500, 375, 224, 224) == 2  # 250 x 188 >= 112 x 112; 1/4 would give 125 x 94
    assert dct_factor(500, 375, 224, 224, keep=1.0) == 1
    assert dct_factor(1000, 900, 224, 224, keep=1.0) == 4
    assert dct_factor(100, 100, 224, 224) == 1  # a small crop is never decoded coarser


def test_a_reduced_decode_is_the_picture_at_half_size(images):
    half = decode_jpeg(lazy_loader(str(images["jpeg"])), 2)
    assert half.shape == (188, 250, 3) and half.dtype == np.uint8
    reference = _pixels(Image.open(images["jpeg"]).convert("RGB").resize((250, 188), Image.BICUBIC))
    assert np.abs(half.astype(np.int16) - reference).mean() < 8  # 4.7 here; another picture gives about 94


def test_a_full_decode_is_pils_decode(images):
    exact = decode_jpeg(lazy_loader(str(images["jpeg"])), 1)
    assert np.abs(exact.astype(np.int16) - _pixels(Image.open(images["jpeg"]).convert("RGB"))).max() <= 1


def test_torch_resize_is_pils_bicubic_within_one_level(images):
    picture = Image.open(images["png"]).convert("RGB")
    ours = resize_uint8(np.asarray(picture)[40:340, 100:420], (224, 224), "bicubic")
    theirs = picture.crop((100, 40, 420, 340)).resize((224, 224), Image.BICUBIC)
    assert ours.size == (224, 224) and np.abs(_pixels(ours) - _pixels(theirs)).max() <= 1


def _assert_crops_like_timm(path, timm_crop, seed: int, max_level: int) -> None:
    """Given the same random draws, the fast crop is timm's crop within `max_level` grey levels."""
    random.seed(seed)
    expected = timm_crop(Image.open(path).convert("RGB"))
    random.seed(seed)
    got = FastRandomResizedCrop.from_timm(timm_crop)(lazy_loader(str(path)))
    assert got.size == expected.size and got.mode == "RGB"
    assert np.abs(_pixels(got) - _pixels(expected)).max() <= max_level


@pytest.mark.parametrize("kind", ["png", "cmyk"])
def test_pngs_and_cmyk_jpegs_are_cropped_exactly_as_by_timm(images, kind):
    _assert_crops_like_timm(images[kind], RandomResizedCropAndInterpolation(224, interpolation="bicubic"), 7, 0)


def test_nearest_interpolation_is_left_to_timm(images):
    _assert_crops_like_timm(images["jpeg"], RandomResizedCropAndInterpolation(224, interpolation="nearest"), 5, 0)


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_small_crops_of_a_jpeg_keep_full_resolution_and_timms_pixels(images, interpolation):
    timm_crop = RandomResizedCropAndInterpolation(224, scale=(0.08, 0.1), interpolation=interpolation)
    _assert_crops_like_timm(images["jpeg"], timm_crop, 3, 2)  # torch's resize: within a level or two of PIL's


def test_the_flip_folded_into_the_crop_draws_and_flips_like_timms_flip(images):
    timm_steps = transforms.Compose([RandomResizedCropAndInterpolation(224, scale=(0.08, 0.1)),
                                     transforms.RandomHorizontalFlip(0.5)])
    fast = FastRandomResizedCrop(224, scale=(0.08, 0.1), interpolation=F.InterpolationMode.BILINEAR, hflip=0.5)
    flipped = 0
    for seed in range(6):
        random.seed(seed)
        torch.manual_seed(seed)
        expected = _pixels(timm_steps(Image.open(images["jpeg"]).convert("RGB")))
        random.seed(seed)
        torch.manual_seed(seed)
        got = _pixels(fast(lazy_loader(str(images["jpeg"]))))
        assert np.abs(got - expected).max() <= 2
        random.seed(seed)
        unflipped = _pixels(timm_steps.transforms[0](Image.open(images["jpeg"]).convert("RGB")))
        flipped += int(np.abs(got - unflipped).max() > 2)
    assert 0 < flipped < 6  # both outcomes of the draw were seen


def test_large_crops_are_decoded_reduced_and_still_come_out_at_train_size(images):
    out = FastRandomResizedCrop(224, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))(lazy_loader(str(images["jpeg"])))
    assert out.size == (224, 224) and out.mode == "RGB"
    reference = _pixels(Image.open(images["jpeg"]).convert("RGB").resize((224, 224), Image.BICUBIC))
    assert np.abs(_pixels(out) - reference).mean() < 12  # the same picture, other pixels


def test_greyscale_jpegs_come_out_rgb(images):
    out = FastRandomResizedCrop(224, scale=(1.0, 1.0))(lazy_loader(str(images["grey"])))
    assert out.mode == "RGB" and out.size == (224, 224)
    channels = _pixels(out)
    assert (channels[..., 0] == channels[..., 1]).all() and (channels[..., 1] == channels[..., 2]).all()


@pytest.mark.parametrize("reprob", [0.0, 1.0])
def test_the_full_deit_train_transform_with_the_fast_path(images, reprob):
    cfg = compose_config(["resolution=224px", f"augment.reprob={reprob}", "data.fast_jpeg=true"])
    transform, batch_step = build_train_pipeline(transform_spec(cfg))
    kinds = [type(step).__name__ for step in transform.transforms]
    assert kinds[0] == "FastRandomResizedCrop" and transform.transforms[0].hflip == 0.5
    assert not {"RandomHorizontalFlip", "MaybeToTensor", "Normalize", "RandomErasing"} & set(kinds)
    assert (batch_step.erasing is not None) == (reprob > 0)
    mean, std = torch.tensor(cfg.data.mean), torch.tensor(cfg.data.std)
    low, high = float((-mean / std).min()), float(((1 - mean) / std).max())
    random.seed(0)
    torch.manual_seed(0)
    per_image = [transform(lazy_loader(str(images["jpeg"]))) for _ in range(8)]
    assert all(image.shape == (224, 224, 3) and image.dtype == torch.uint8 for image in per_image)
    out = batch_step(torch.stack(per_image))
    assert out.shape == (8, 3, 224, 224) and out.dtype == torch.float32 and torch.isfinite(out).all()
    if reprob == 0:
        assert low - 1e-5 <= out.min() and out.max() <= high + 1e-5
    else:  # erased pixels are N(0, 1) draws
        assert out.abs().max() < 10
    default = build_train_pipeline(transform_spec(compose_config(["resolution=224px"])))[0].transforms  # off by default
    assert not any(isinstance(step, FastRandomResizedCrop) for step in default)


def test_a_transform_without_a_random_resized_crop_is_refused():
    per_image, _ = split_for_batches(build_eval_transform(transform_spec(compose_config(["resolution=224px"]))))
    with pytest.raises(ValueError, match="speeds up a random-resized crop, and this transform has none"):
        fast_train_transform(per_image)


def test_train_py_trains_on_jpegs_with_the_fast_path_and_workers(tmp_path, data_cache):
    for split, count in (("train", 16), ("val", 4)):
        for label in range(2):
            folder = tmp_path / "jpegs" / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                draw_image(label, 64, np.random.default_rng([label, index])).crop((0, 8, 64, 56)).save(
                    folder / f"{index}.jpg", quality=90)
    args = [a for a in TINY if not a.startswith("data.")] + [
        "data=imagefolder", f"data.root={tmp_path / 'jpegs'}", "data.num_classes=2", "data.fast_jpeg=true",
        "runtime.num_workers=2", "train.global_batch=8", "train.max_steps=3"]
    cfg = compose_config(args)
    spec, on_bad_image = transform_spec(cfg), cfg.runtime.on_bad_image
    dataset = build_dataset(cfg.data, "train", build_train_pipeline(spec)[0], on_bad_image=on_bad_image)
    assert dataset.loader is lazy_loader and isinstance(dataset.transform.transforms[0], FastRandomResizedCrop)
    val = build_dataset(cfg.data, "val", build_eval_transform(spec), on_bad_image=on_bad_image)
    assert val.loader is not lazy_loader
    run_train(args, tmp_path, data_cache)
    result = json.loads(next((runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}")).read_text())
    assert result["status"] == "finished" and result["steps_done"] == 3


def test_fast_jpeg_with_augmentation_off_is_a_config_error():
    with pytest.raises(ConfigError, match="augment.no_aug=true"):
        validate_config(compose_config(["data.fast_jpeg=true", "augment.no_aug=true"]))
