"""The training transform split into uint8 pixels per image and float work per batch (data.batch)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.random_erasing import RandomErasing
from torchvision import transforms

from deit_ablate.data.batch import BatchNormalize, ErasingBoxes, split_for_batches, to_uint8_hwc
from deit_ablate.data.builtin import draw_image
from deit_ablate.data.transforms import build_eval_transform, build_train_pipeline, build_train_transform
from tests.conftest import compose_config, transform_spec


@pytest.fixture(scope="module")
def pictures() -> list[Image.Image]:
    """Built-in images at 40 px (the demo) and one at 500x375 (ImageNet-like), as the loader opens them."""
    rng = np.random.default_rng(0)
    return [draw_image(label, 40, rng) for label in range(6)] + [draw_image(3, 500, rng).crop((0, 62, 500, 437))]


def _seeded(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # RandAugment picks its ops with numpy
    torch.manual_seed(seed)


@pytest.mark.parametrize("overrides", [[], ["resolution=224px"], ["augment.no_aug=true"]])
def test_split_transform_gives_timms_pixels_without_erasing(pictures, overrides):
    cfg = compose_config([*overrides, "augment.reprob=0"])
    timm_transform = build_train_transform(transform_spec(cfg))
    per_image, per_batch = build_train_pipeline(transform_spec(cfg))
    assert per_batch.erasing is None
    for seed, picture in enumerate(pictures):
        _seeded(seed)
        expected = timm_transform(picture)
        _seeded(seed)
        pixels = per_image(picture)
        assert pixels.dtype == torch.uint8 and pixels.shape == (*expected.shape[1:], 3)
        got = per_batch(pixels[None])[0]
        assert got.is_contiguous() and torch.allclose(got, expected, atol=1e-5), seed  # float rounding only


def test_batch_erasing_is_timms_erasing_applied_to_each_image_in_turn():
    erasing = RandomErasing(0.5, mode="pixel", device="cpu")
    step = BatchNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), erasing)
    plain = BatchNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    batch = torch.randint(0, 256, (16, 12, 12, 3), dtype=torch.uint8)
    _seeded(3)
    got = step(batch)
    normalized = plain(batch)
    _seeded(3)
    expected = torch.stack([erasing(image.clone()) for image in normalized])
    assert torch.equal(got, expected)
    erased = (got != normalized).flatten(1).any(dim=1)
    assert 0 < erased.sum() < 16  # p=0.5: some images erased, some not


@pytest.mark.parametrize("mode,max_count", [("pixel", None), ("rand", 3), ("const", 2)])
def test_boxes_drawn_in_the_workers_erase_as_timms_erasing_seeded_per_image(mode, max_count):
    erasing = RandomErasing(0.5, mode=mode, max_count=max_count, device="cpu")
    step = BatchNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), erasing)
    batch = torch.randint(0, 256, (24, 12, 20, 3), dtype=torch.uint8)  # H != W: rows and columns kept apart
    seeds = [random.Random(i).getrandbits(63) for i in range(24)]
    plain = BatchNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))(batch)
    expected = plain.clone()
    for image, seed in zip(expected, seeds, strict=True):  # the definition: timm's erasing of each image, seeded
        random.seed(seed)
        torch.default_generator.manual_seed(seed)
        erasing(image)
    boxes = torch.stack([ErasingBoxes(erasing)(seed, 12, 20) for seed in seeds])
    random.seed(0)  # whatever the training process's generators hold: the boxes and seeds decide
    torch.manual_seed(0)
    got = step(batch, boxes=boxes)
    assert torch.equal(got, expected)
    erased = (got != plain).flatten(1).any(dim=1)
    assert 0 < erased.sum() < 24 and boxes[:, 0].tolist() == seeds
    assert erased.tolist() == (boxes[:, 1] > 0).tolist() or mode == "const"  # a const box may equal its pixels
    assert torch.equal(step(batch, seeds=seeds), expected)  # the seeded path (DALI's batches) computes the same


def test_batch_erasing_hits_reprob_of_the_images():
    step = BatchNormalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), RandomErasing(0.25, mode="pixel", device="cpu"))
    batch = torch.full((4000, 8, 8, 3), 128, dtype=torch.uint8)
    _seeded(0)
    untouched = BatchNormalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))(batch)
    erased = (step(batch) != untouched).flatten(1).any(dim=1).float().mean().item()
    assert 0.22 < erased < 0.28  # Table 9: random erasing with probability 0.25


def test_uint8_layout_and_greyscale_input():
    rgb = Image.fromarray(np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3))
    assert torch.equal(to_uint8_hwc(rgb), torch.from_numpy(np.array(rgb)))
    grey = to_uint8_hwc(Image.fromarray(np.full((4, 5), 7, dtype=np.uint8)))
    assert grey.shape == (4, 5, 3) and (grey == 7).all()


def test_normalizing_into_a_reused_tensor_gives_the_same_batch():
    step = BatchNormalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    first, second = (torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8) for _ in range(2))
    reused = step(first)
    again = step(second, out=reused)
    assert again.data_ptr() == reused.data_ptr() and torch.equal(again, step(second))
    assert step(second[:1], out=reused).data_ptr() != reused.data_ptr()  # another shape: a new tensor


def test_the_pipeline_follows_the_erasing_config():
    per_image, per_batch = build_train_pipeline(transform_spec(compose_config([])))
    assert per_batch.erasing.probability == 0.25 and per_batch.erasing.mode == "pixel"
    assert per_image.transforms[-1] is to_uint8_hwc
    assert build_train_pipeline(transform_spec(compose_config(["ablation=no_erasing"])))[1].erasing is None


def test_a_transform_that_does_more_after_normalizing_is_refused():
    transform = build_eval_transform(transform_spec(compose_config([])))
    with pytest.raises(ValueError, match="ending in to-tensor, normalize"):
        split_for_batches(transforms.Compose([*transform.transforms, transforms.RandomHorizontalFlip()]))
