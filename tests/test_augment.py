"""DeiT's augmentation through timm: RandAugment at magnitude 10 (the Pillow 13 pitfall), shapes, erasing."""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image
from timm.data.auto_augment import AugmentOp, RandAugment

from deit_ablate.data.builtin import draw_image
from deit_ablate.data.transforms import build_eval_transform, build_train_transform
from tests.conftest import compose_config, transform_spec


def test_posterize_at_magnitude_10_keeps_zero_bits_as_deit_trained():
    # timm's PosterizeIncreasing at magnitude 10 asks Pillow for 0 bits: a black image on Pillow < 13,
    # a ValueError on Pillow 13 (the reason pyproject pins pillow<13).
    image = Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8))
    out = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)(image)
    assert np.asarray(out).max() == 0


def test_deit_train_transform_survives_enough_images_to_draw_magnitude_10(monkeypatch):
    cfg = compose_config([])
    transform = build_train_transform(transform_spec(cfg))
    rand_augment = next(t for t in transform.transforms if isinstance(t, RandAugment))
    assert len(rand_augment.ops) == 15 and rand_augment.num_layers == 2
    assert all(op.magnitude == 9 and op.magnitude_std == 0.5 for op in rand_augment.ops)
    drawn = []
    gauss = random.gauss

    def recording_gauss(mu, sigma):
        value = gauss(mu, sigma)
        drawn.append(value)
        return value

    monkeypatch.setattr(random, "gauss", recording_gauss)
    random.seed(0)
    rng = np.random.default_rng(0)
    images = [draw_image(label % 10, 40, rng) for label in range(40)]
    for index in range(1500):
        tensor = transform(images[index % 40])
        assert tensor.shape == (3, 32, 32) and torch.isfinite(tensor).all()
    assert sum(value >= 10 for value in drawn) >= 5  # the clipped magnitude-10 case came up, and passed


def test_random_erasing_and_eval_transform_follow_the_config():
    cfg = compose_config([])
    names = [type(t).__name__ for t in build_train_transform(transform_spec(cfg)).transforms]
    assert names[0] == "RandomResizedCropAndInterpolation" and "RandomErasing" in names
    erasing = next(t for t in build_train_transform(transform_spec(cfg)).transforms
                   if type(t).__name__ == "RandomErasing")
    assert erasing.probability == 0.25 and erasing.mode == "pixel"
    no_erasing = [type(t).__name__
                  for t in build_train_transform(transform_spec(compose_config(["ablation=no_erasing"]))).transforms]
    assert "RandomErasing" not in no_erasing
    auto = build_train_transform(transform_spec(compose_config(["ablation=autoaugment"]))).transforms
    assert any(type(t).__name__ == "AutoAugment" for t in auto)
    no_randaugment = build_train_transform(transform_spec(compose_config(["ablation=no_randaugment"]))).transforms
    assert not any(type(t).__name__ in ("AutoAugment", "RandAugment") for t in no_randaugment)
    paper_eval = build_eval_transform(transform_spec(compose_config(["preset=paper"]))).transforms
    assert paper_eval[0].size == 256 and paper_eval[1].size == (224, 224)  # DeiT: resize 224 / 0.875, crop 224
