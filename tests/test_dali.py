"""data.backend=dali on the CPU: timm's RandAugment rebuilt in DALI against timm's own ops, the loader against the
project's sampler, exact resume, and the clear errors (DALI absent, a config it cannot run)."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

# DALI (installed by scripts/install.sh) is imported, not skipped: its absence fails this module.
from nvidia.dali import fn, pipeline_def
from PIL import Image
from timm.data import auto_augment as timm_aa

from deit_ablate.core.errors import ConfigError
from deit_ablate.data import dali_augment
from deit_ablate.data.builtin import draw_image
from deit_ablate.data.dali import DALI_PACKAGE, DaliTrainLoader, fill_value, require_dali
from deit_ablate.data.dali_augment import (
    LEVEL_TO_ARG,
    NEGATED,
    RAND_INCREASING_OPS,
    RandAugmentSpec,
    parse_rand_augment,
)
from deit_ablate.data.datasets import build_dataset, dataset_root
from deit_ablate.data.loader import SkipFirst, build_train_sampler
from deit_ablate.record.identity import experiment, experiment_digest
from deit_ablate.run.validate import validate_config
from tests.conftest import TINY, compose_config, train_straight_and_resumed, transform_spec

SIZE = 40
PICTURES = [np.asarray(draw_image(label, SIZE, np.random.default_rng(label))) for label in (0, 3, 6, 9)]


def _timm_arg(name: str, level: float, negate: bool):
    """timm's argument for op `name` at `level`, with its random negation forced."""
    hparams = {"translate_pct": 0.45}
    saved = random.random
    random.random = (lambda: 1.0) if negate else (lambda: 0.0)
    try:
        return timm_aa.LEVEL_TO_ARG[name](level, hparams)[0]
    finally:
        random.random = saved


def test_the_op_list_is_timms_increasing_list_in_order():
    assert list(RAND_INCREASING_OPS) == timm_aa._RAND_INCREASING_TRANSFORMS
    assert len(RAND_INCREASING_OPS) == 15 and "Invert" in RAND_INCREASING_OPS and "SolarizeAdd" in RAND_INCREASING_OPS


@pytest.mark.parametrize("level", [0.0, 2.5, 8.3, 9.0, 9.99, 10.0])
def test_level_to_argument_rules_and_their_signs_are_timms(level):
    for name, rule in LEVEL_TO_ARG.items():
        if rule is None:
            assert timm_aa.LEVEL_TO_ARG[name] is None, name
            continue
        assert rule(level) == pytest.approx(_timm_arg(name, level, negate=False)), name
        negated = _timm_arg(name, level, negate=True)
        if name in NEGATED:  # either way around the neutral value (0, or 1 for the enhance factors)
            neutral = 1.0 if "Increasing" in name else 0.0
            assert negated == pytest.approx(max(0.1, 2 * neutral - rule(level)) if neutral else -rule(level)), name
        else:
            assert negated == rule(level), name
    # the ranges at m=9 and at the top of timm's scale, written out
    assert LEVEL_TO_ARG["Rotate"](9.0) == pytest.approx(27.0) and LEVEL_TO_ARG["Rotate"](10.0) == 30.0
    assert LEVEL_TO_ARG["PosterizeIncreasing"](9.0) == 1 and LEVEL_TO_ARG["PosterizeIncreasing"](10.0) == 0
    assert LEVEL_TO_ARG["SolarizeIncreasing"](9.0) == 26 and LEVEL_TO_ARG["SolarizeAdd"](9.0) == 99
    assert LEVEL_TO_ARG["ColorIncreasing"](9.0) == pytest.approx(1.81)
    assert LEVEL_TO_ARG["ShearX"](9.0) == pytest.approx(0.27) and LEVEL_TO_ARG["TranslateXRel"](9.0) == 0.405


def _dali_op(name: str, level: float, sign: float) -> np.ndarray:
    """One op of the DALI graph applied at a fixed level and sign to PICTURES."""

    @pipeline_def(batch_size=len(PICTURES), num_threads=1, device_id=None)
    def one_op():
        images = fn.external_source(source=lambda: PICTURES, batch=True, layout="HWC")
        levels = fn.external_source(source=lambda: [np.float32(level)] * len(PICTURES), batch=True)
        signs = fn.external_source(source=lambda: [np.float32(sign)] * len(PICTURES), batch=True)
        return RAND_INCREASING_OPS[name](images, levels, signs, 128, (SIZE, SIZE))

    pipe = one_op()
    pipe.build()
    (out,) = pipe.run()
    return np.stack([np.array(out[i]) for i in range(len(PICTURES))]).astype(int)


def _timm_op(name: str, level: float, sign: float) -> np.ndarray:
    op = timm_aa.AugmentOp(name, prob=1.0, magnitude=level,
                           hparams={"img_mean": (128, 128, 128), "interpolation": Image.BILINEAR})
    saved = random.random
    random.random = (lambda: 0.0) if sign > 0 else (lambda: 1.0)
    try:
        return np.stack([np.asarray(op(Image.fromarray(p))) for p in PICTURES]).astype(int)
    finally:
        random.random = saved


@pytest.mark.parametrize("name", list(RAND_INCREASING_OPS))
def test_each_dali_op_gives_timms_pixels(name):
    """Same pixels within interpolation rounding (warps: both bilinear here), and the sign of each op is timm's."""
    # Equalize: DALI follows OpenCV's lookup table, PIL rounds its histogram steps differently (README).
    tolerance = 8.0 if name == "Equalize" else 1.5
    for level, sign in ((9.0, 1.0), (9.0, -1.0), (4.0, 1.0)):
        ours, theirs = _dali_op(name, level, sign), _timm_op(name, level, sign)
        assert ours.shape == theirs.shape == (len(PICTURES), SIZE, SIZE, 3)
        assert np.abs(ours - theirs).mean() <= tolerance, (name, level, sign)
        assert np.abs(ours - np.stack(PICTURES)).mean() > 2 * tolerance or level < 9, name  # it did something
        if name in NEGATED:
            assert np.abs(ours - _timm_op(name, level, -sign)).mean() > 4 * np.abs(ours - theirs).mean(), name
    if name in ("Invert", "PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd"):  # lookup tables: exact
        assert np.array_equal(_dali_op(name, 9.0, 1.0), _timm_op(name, 9.0, 1.0))


def test_policy_strings():
    assert parse_rand_augment("rand-m9-mstd0.5-inc1") == RandAugmentSpec(2, 9.0, 0.5, 0.5)
    assert parse_rand_augment("rand-m7-n3-mstd0-inc1") == RandAugmentSpec(3, 7.0, 0.0, 0.5)
    assert "inc1" in parse_rand_augment("rand-m9-mstd0.5")
    assert "not built for DALI" in parse_rand_augment("original-mstd0.5")
    assert fill_value((0.485, 0.456, 0.406)) == 115  # mean of timm's fill colour (124, 116, 104)


@pytest.fixture(scope="module")
def tiny_train_set(data_cache, monkeypatch_module):
    monkeypatch_module.setenv("DEIT_ABLATE_CACHE", str(data_cache))
    cfg = compose_config(TINY + ["data.backend=dali", "resolution=32px"])
    dataset = build_dataset(cfg.data, "train", None, dataset_root(cfg.data), on_bad_image=cfg.runtime.on_bad_image)
    return cfg, dataset


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _epoch(loader: DaliTrainLoader, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.generator = torch.Generator().manual_seed(seed)  # as data.loader.seed_epoch_data seeds it
    return [(images.clone(), labels.clone()) for images, labels in loader]


def test_loader_follows_each_ranks_sampler_and_hands_uint8_hwc_batches(tiny_train_set):
    cfg, dataset = tiny_train_set
    batch = 16
    for rank in range(2):
        sampler = build_train_sampler(len(dataset), 3, 2, (rank,), batch)  # 2 slots of 16, one per rank
        sampler.set_epoch(1)
        loader = DaliTrainLoader(dataset, sampler, batch, transform_spec(cfg), torch.device("cpu"), threads=1)
        expected = [dataset.targets[i] for i in sampler]
        batches = _epoch(loader, seed=5)
        # timm cuts the epoch to whole 256s of the dataset (300 -> 256) split over 2 ranks: 128 each, 8 batches
        assert len(batches) == len(loader) == len(sampler) // batch == 8
        for index, (images, labels) in enumerate(batches):
            assert images.shape == (batch, 32, 32, 3) and images.dtype == torch.uint8
            assert labels.dtype == torch.int64 and labels.tolist() == expected[index * batch:(index + 1) * batch]
        pixels = torch.cat([images for images, _ in batches]).float()
        assert pixels.min() >= 0 and pixels.max() <= 255 and pixels.std() > 20  # real images, not a constant


def test_same_seed_same_batches_other_seed_other_augmentation(tiny_train_set):
    cfg, dataset = tiny_train_set
    sampler = build_train_sampler(len(dataset), 3, 1, (0,), 32)
    spec = transform_spec(cfg)
    loader = DaliTrainLoader(dataset, sampler, 32, spec, torch.device("cpu"), threads=2)
    first, again, other = _epoch(loader, 7), _epoch(loader, 7), _epoch(loader, 8)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert all(torch.equal(a[1], c[1]) for a, c in zip(first, other, strict=True))  # the sampler decides the order
    assert not torch.equal(first[0][0], other[0][0])
    rest = _epoch(DaliTrainLoader(dataset, SkipFirst(sampler, 64), 32, spec, torch.device("cpu"), threads=2), 7)
    assert len(rest) == len(first) - 2 and torch.equal(rest[0][1], first[2][1])


def test_missing_dali_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as if not installed: the import fails
    with pytest.raises(ConfigError, match=f"pip install {DALI_PACKAGE}") as error:
        require_dali()
    assert "bash scripts/install.sh" in str(error.value) and "data.backend=pil" in str(error.value)
    with pytest.raises(ConfigError, match=DALI_PACKAGE):
        validate_config(compose_config(["data.backend=dali"]))
    validate_config(compose_config(["data.backend=pil"]))  # the default path never needs it


@pytest.mark.parametrize("overrides, message", [
    (["augment=none"], "colour jitter"),
    (["data.fast_jpeg=true"], "data.fast_jpeg"),
    (["data=cifar100"], "CIFAR-100"),
    (["augment.auto_augment=original-mstd0.5"], "'original' policies"),
])
def test_what_dali_cannot_run_is_refused_before_running(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(["data.backend=dali", *overrides]))


def test_backend_is_part_of_the_identity_only_when_not_the_default():
    pil, dali_cfg = compose_config([]), compose_config(["data.backend=dali"])
    assert "backend" not in experiment(pil)["data"]  # runs from before data.backend keep their folder and wandb id
    assert experiment(dali_cfg)["data"]["backend"] == "dali"
    assert experiment_digest(pil) != experiment_digest(dali_cfg)


@pytest.mark.slow
def test_train_with_dali_resumes_exactly_at_an_epoch_boundary(tmp_path, data_cache):
    two = TINY + ["data.backend=dali", "train.epochs=2", "runtime.num_workers=1"]
    train_straight_and_resumed(two, tmp_path, data_cache)  # equal weights after 16 steps, checked there


def test_an_unreadable_image_stops_with_its_name(tmp_path):
    cfg = compose_config(TINY + ["data.backend=dali", "resolution=32px"])
    for label in ("a", "b"):
        folder = tmp_path / "train" / label
        folder.mkdir(parents=True)
        for index in range(8):
            Image.fromarray(PICTURES[index % 4]).save(folder / f"{index}.png")
    (tmp_path / "train" / "b" / "3.png").write_bytes(b"not an image at all")
    cfg.data.num_classes = 2
    dataset = build_dataset(cfg.data, "train", None, tmp_path, on_bad_image=cfg.runtime.on_bad_image)
    loader = DaliTrainLoader(dataset, list(range(16)), 8, transform_spec(cfg), torch.device("cpu"), threads=1)
    with pytest.raises(ConfigError, match=r"b/3.png cannot be read as an image .*data.backend=pil"):
        _epoch(loader, 0)


# The GPU's side of the DALI backend, run on the CPU (docs/testing.md, "Code paths a GPU takes, run on the CPU"):
# DALI's GPU words never say `cuda`, so the table found them only after issue 53, point 4.


class _Node:
    """Stands in for a DALI DataNode: where it is, and what `.gpu()` makes of it."""

    def __init__(self, device: str) -> None:
        self.device = device

    def gpu(self) -> _Node:
        return _Node("gpu")


def test_per_sample_arguments_follow_the_images_onto_the_gpu():
    on_gpu, on_cpu, argument = _Node("gpu"), _Node("cpu"), _Node("cpu")
    assert dali_augment._like(on_gpu, argument).device == "gpu"  # moved, as DALI's GPU operators need it
    assert dali_augment._like(on_cpu, argument) is argument


def test_the_mixed_decoder_on_a_gpu_and_the_cpus_elsewhere():
    assert dali_augment.decoder_device(True) == "mixed" and dali_augment.decoder_device(False) == "cpu"


def test_a_gpu_loader_builds_the_gpu_graph_and_runs_it_with_the_decoder_stood_in(tiny_train_set, monkeypatch):
    """A loader for cuda:1 asks for the mixed decoder and DALI's device 1; the two stood in by the CPU's (no GPU
    here), its epoch is the CPU loader's, pixel for pixel: nothing else of the graph depends on the device."""
    cfg, dataset = tiny_train_set
    sampler = build_train_sampler(len(dataset), 3, 1, (0,), 16)
    spec = transform_spec(cfg)
    on_gpu = DaliTrainLoader(dataset, sampler, 16, spec, torch.device("cuda", 1), threads=1)  # no CUDA call
    assert on_gpu.device_id == 1 and on_gpu.graph["gpu"] is True
    asked: list[bool] = []
    real = dali_augment.decoder_device
    monkeypatch.setattr(dali_augment, "decoder_device", lambda gpu: asked.append(gpu) or real(False))
    on_gpu.device_id = None  # stands in for DALI's GPU device 1
    gpu_epoch = _epoch(on_gpu, seed=3)
    assert asked == [True]
    cpu_epoch = _epoch(DaliTrainLoader(dataset, sampler, 16, spec, torch.device("cpu"), threads=1), seed=3)
    assert asked == [True, False] and len(gpu_epoch) == len(cpu_epoch) > 0
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(gpu_epoch, cpu_epoch, strict=True))
