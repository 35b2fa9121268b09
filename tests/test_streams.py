"""Random streams keyed by what is computed: a sample's augmentation by its position in the epoch's dealt order,
a micro-batch's Mixup/CutMix and drop path by (epoch, step, slot), whichever process or worker computes it.

Repeated augmentation puts the copies of an image in different slots; if copies shared their draws, they would get
the same crop, flip and RandAugment ops and the ingredient (5.3 points in DeiT's Table 8) would be silently weakened.
Layouts are simulated in one process with the real sampler, dataset, transform, loader and seeding (streams.py);
tests/test_invariance.py trains them for real (one process, workers, torchrun ranks, a resume).
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from timm.data.auto_augment import AugmentOp
from timm.layers import DropPath
from torch.utils.data import Dataset

from deit_ablate.core.streams import (
    PER_RANK,
    STREAMS_VERSION,
    EpochStreams,
    RunStreams,
    Stream,
    seed_torch,
    slot_positions,
    trained_before,
)
from deit_ablate.data.datasets import build_dataset
from deit_ablate.data.loader import SeededSamples, SkipFirst, build_train_loader, build_train_sampler, seed_epoch_data
from deit_ablate.data.transforms import build_train_pipeline
from deit_ablate.record.rundir import RunDir
from deit_ablate.train.losses import build_mixup
from deit_ablate.train.teacher import teacher_forward
from tests.conftest import compose_config, run_train, transform_spec

CLASSES, TRAIN_PER_CLASS = 4, 24
RANDAUGMENT_OPS = 15  # timm's rand-m9-mstd0.5-inc1: 2 of 15 ops, drawn with replacement
STREAM_SEED = 0


def _draw_jpeg(rng: np.random.Generator, path: Path) -> None:
    """A JPEG of random size and content: a colour gradient, shapes and noise."""
    width, height = (int(v) for v in rng.integers(40, 161, size=2))
    ramp = np.linspace(0, 1, width)[None, :, None] * rng.uniform(0, 255, 3) + rng.uniform(0, 128, 3)
    pixels = np.clip(ramp + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
        box = (x0, y0, x0 + int(rng.integers(6, width // 2 + 8)), y0 + int(rng.integers(6, height // 2 + 8)))
        draw.ellipse(box, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    image.save(path, quality=int(rng.integers(70, 96)))


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory) -> Path:
    """An ImageFolder tree of JPEGs of varied size and content: 4 classes, 24 training and 2 held-out images each."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(1)
    for split, count in (("train", TRAIN_PER_CLASS), ("val", 2)):
        for label in range(CLASSES):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                _draw_jpeg(rng, folder / f"{index:03d}.jpg")
    return root


def _config(root: Path, *overrides: str):
    return compose_config(["data=imagefolder", f"data.root={root}", f"data.num_classes={CLASSES}",
                           "runtime.num_workers=2", f"seed={STREAM_SEED}", *overrides])


DRAWN: list[str] = []  # the RandAugment ops drawn for the image being loaded (one list per loader worker process)


@pytest.fixture
def record_ops(monkeypatch):
    """Record each RandAugment op drawn (before its own probability check) in DRAWN; forked workers inherit it."""
    call = AugmentOp.__call__

    def recording(self, img):
        DRAWN.append(self.name)
        return call(self, img)

    monkeypatch.setattr(AugmentOp, "__call__", recording)


class Recorded(Dataset):
    """The run's training set, also returning each image's index and the names of the RandAugment ops it drew."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self.samples = dataset, dataset.samples

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        DRAWN.clear()
        pixels, label = self.dataset[index]
        return pixels, label, index, "+".join(DRAWN)


SLOTS, MICRO = 8, 4  # 96 images (under 256: ceil(96 / 8) = 12 positions per slot): 3 steps of 8 x 4


def layout_epoch(cfg, root: Path, world: int, rank: int, epoch: int = 0, skip_steps: int = 0) -> dict[int, tuple]:
    """position -> (image index, uint8 pixels, drawn ops) of each training sample process `rank` of `world` loads in
    `epoch` (its share of the 8 slots), seeded as run.py seeds an epoch; after `skip_steps` steps when resumed."""
    spec = transform_spec(cfg)
    per_image, _ = build_train_pipeline(spec)
    dataset = build_dataset(cfg.data, "train", per_image, root, on_bad_image=cfg.runtime.on_bad_image)
    dali = cfg.data.backend == "dali"
    dataset = dataset if dali else Recorded(dataset)
    per_process = SLOTS // world
    own = tuple(range(rank * per_process, (rank + 1) * per_process))
    slots = build_train_sampler(len(dataset), cfg.augment.repeated_aug, SLOTS, own, MICRO)
    sampler = SeededSamples(slots, RunStreams(cfg.seed, rank))
    seed_epoch_data(sampler, build_train_loader(dataset, sampler, 4, spec, cfg.runtime, torch.device("cpu")),
                    RunStreams(cfg.seed, rank), epoch)
    skipped = skip_steps * per_process * MICRO
    loader = build_train_loader(dataset, SkipFirst(sampler, skipped) if skipped else sampler, per_process * MICRO,
                                spec, cfg.runtime, torch.device("cpu"))
    seed_epoch_data(sampler, loader, RunStreams(cfg.seed, rank), epoch)
    positions, order = slots.positions()[skipped:], list(slots)[skipped:]
    records = []
    for batch in loader:
        if dali:
            records += [(order[len(records) + i], pixels, "") for i, pixels in enumerate(batch[0])]
        else:
            records += list(zip(batch[2].tolist(), batch[0], batch[3], strict=True))
    assert [index for index, _, _ in records] == order[:len(records)]  # the loader follows the sampler
    return dict(zip(positions, records, strict=False))


def chance_tail(pairs: int, same: int, p: float) -> float:
    """P(X >= same) for X ~ Binomial(pairs, p): how surprising `same` coinciding pairs are by chance alone."""
    return sum(math.comb(pairs, k) * p**k * (1 - p) ** (pairs - k) for k in range(same, pairs + 1))


@pytest.mark.parametrize("backend", ["pil", "fast_jpeg", "dali"])
def test_no_two_copies_of_an_image_share_their_augmentation(backend, jpeg_root, record_ops):
    extra = {"pil": [], "fast_jpeg": ["data.fast_jpeg=true"], "dali": ["data.backend=dali"]}[backend]
    cfg = _config(jpeg_root, *extra)
    copies = defaultdict(list)
    for position, (index, pixels, ops) in layout_epoch(cfg, jpeg_root, world=1, rank=0).items():
        copies[index].append((position % SLOTS, pixels, ops))
    pairs = [pair for found in copies.values() for pair in combinations(found, 2)]
    assert len(pairs) > CLASSES * TRAIN_PER_CLASS * 0.8
    assert all(a[0] != b[0] for a, b in pairs)  # every copy in another slot (DeiT's sampler over 8 GPUs)
    identical = sum(torch.equal(a[1], b[1]) for a, b in pairs)
    assert identical == 0, f"{identical} of {len(pairs)} copy pairs are pixel-identical"
    if backend != "dali":  # DALI draws its ops inside its graph; its pixels say it all
        assert all(len(a[2].split("+")) == 2 for a, _ in pairs)
        same_ops = sum(a[2] == b[2] for a, b in pairs)
        # chance: 1 in 15^2 ordered pairs; a tail probability below 1e-4 would be no chance
        tail = chance_tail(len(pairs), same_ops, 1 / RANDAUGMENT_OPS**2)
        assert tail > 1e-4, f"{same_ops} of {len(pairs)} copy pairs drew the same RandAugment ops (p = {tail:.1e})"


@pytest.mark.parametrize("extra", [[], ["data.fast_jpeg=true"]], ids=["pil", "fast_jpeg"])
def test_a_sample_draws_the_same_on_every_layout_and_worker_count(jpeg_root, record_ops, extra):
    reference = layout_epoch(_config(jpeg_root, "runtime.num_workers=0", *extra), jpeg_root, world=1, rank=0,
                             epoch=1)
    for world, workers in ((1, 2), (2, 0), (4, 2)):
        cfg = _config(jpeg_root, f"runtime.num_workers={workers}", *extra)
        drawn = {}
        for rank in range(world):
            drawn.update(layout_epoch(cfg, jpeg_root, world, rank, epoch=1))
        assert drawn.keys() == reference.keys()
        for position, (index, pixels, ops) in drawn.items():
            expected = reference[position]
            assert index == expected[0] and torch.equal(pixels, expected[1]) and ops == expected[2], (world, workers)


def test_a_resume_mid_epoch_draws_the_rest_of_the_epoch_exactly(jpeg_root, record_ops):
    cfg = _config(jpeg_root)
    whole = layout_epoch(cfg, jpeg_root, world=2, rank=1, epoch=2)
    rest = layout_epoch(cfg, jpeg_root, world=2, rank=1, epoch=2, skip_steps=1)
    assert rest and set(rest) < set(whole)
    assert all(torch.equal(pixels, whole[p][1]) and ops == whole[p][2] for p, (_, pixels, ops) in rest.items())
    later = layout_epoch(cfg, jpeg_root, world=2, rank=1, epoch=3)
    assert [r[0] for r in later.values()] != [r[0] for r in whole.values()]  # another epoch, another permutation


def _chunk_draws(epoch: int, step: int, slot: int) -> tuple:
    """What one micro-batch draws in the training process: a Mixup/CutMix choice and a drop-path mask."""
    cfg = compose_config([])
    EpochStreams(RunStreams(STREAM_SEED), epoch).seed_chunk(step, slot)
    mixup = build_mixup(cfg.mix, cfg.data.num_classes)
    mask = DropPath(0.5).train()(torch.ones(32, 1, 1)).flatten() > 0
    return mixup._params_per_batch(), mask


def test_a_micro_batch_draws_by_epoch_step_and_slot_alone():
    draws = {(epoch, step, slot): _chunk_draws(epoch, step, slot) for epoch in (0, 1) for step in (0, 1)
             for slot in range(4)}
    lambdas = [mix[0] for mix, _ in draws.values()]
    assert len(set(lambdas)) == len(draws)  # each micro-batch its own lambda
    masks = [tuple(mask.tolist()) for _, mask in draws.values()]
    assert len(set(masks)) == len(draws)  # and its own drop-path mask
    torch.manual_seed(123)  # whatever ran before (another slot, another process): the same draws again
    again = _chunk_draws(1, 1, 3)
    assert again[0] == draws[1, 1, 3][0] and torch.equal(again[1], draws[1, 1, 3][1])


def test_seed_torch_draws_what_torch_manual_seed_draws():
    torch.manual_seed(7)
    expected = torch.rand(4)
    seed_torch(7)
    assert torch.equal(torch.rand(4), expected)


def test_a_micro_batch_seeds_no_gpu_while_cuda_is_not_in_use(monkeypatch):
    seeded_gpus = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded_gpus.append)
    EpochStreams(RunStreams(STREAM_SEED), 0).seed_chunk(0, 0)
    assert not torch.cuda.is_initialized()
    # torch.manual_seed would queue a lazy seeding of every GPU, a formatted stack each micro-batch
    assert seeded_gpus == []


@pytest.mark.parametrize("world,rank,workers", [(1, 0, 0), (2, 1, 2)])
def test_the_workers_erasing_boxes_erase_as_the_trainer_seeds_each_position(jpeg_root, world, rank, workers):
    cfg = _config(jpeg_root, "augment.reprob=0.5", f"runtime.num_workers={workers}")
    spec = transform_spec(cfg)
    per_image, batch_step = build_train_pipeline(spec)
    dataset = build_dataset(cfg.data, "train", per_image, jpeg_root, on_bad_image=cfg.runtime.on_bad_image)
    own = tuple(range(rank * SLOTS // world, (rank + 1) * SLOTS // world))
    sampler = SeededSamples(build_train_sampler(len(dataset), 1, SLOTS, own, MICRO), RunStreams(STREAM_SEED, rank))
    loader = build_train_loader(dataset, sampler, len(own) * MICRO, spec, cfg.runtime, torch.device("cpu"),
                                erasing=batch_step.erasing)
    seed_epoch_data(sampler, loader, RunStreams(STREAM_SEED, rank), 1)
    epoch, erased = EpochStreams(RunStreams(STREAM_SEED, rank), 1), 0
    for step, (images, _, boxes) in enumerate(loader):
        seeds = [epoch.sample_seed(Stream.ERASING, p) for p in slot_positions(SLOTS, own, MICRO, step)]
        assert boxes[:, 0].tolist() == seeds  # the trainer's seeds for these positions, in batch order
        assert torch.equal(batch_step(images, boxes=boxes), batch_step(images, seeds=seeds))
        erased += int((boxes[:, 1] > 0).sum())
    assert erased > 0


def test_random_erasing_draws_per_sample_whatever_the_batch():
    _, batch_step = build_train_pipeline(transform_spec(compose_config(["augment.reprob=1.0"])))
    images = torch.randint(0, 256, (6, 8, 8, 3), dtype=torch.uint8)
    seeds = [EpochStreams(RunStreams(STREAM_SEED), 0).sample_seed(Stream.ERASING, position) for position in range(6)]
    whole = batch_step(images, seeds=seeds)
    halves = torch.cat([batch_step(images[:3], seeds=seeds[:3]), batch_step(images[3:], seeds=seeds[3:])])
    assert torch.equal(whole, halves)  # an image's erasing depends on its seed only
    assert not torch.equal(whole[0], batch_step(images[:1], seeds=seeds[1:2])[0])  # another position, another draw


def test_every_stream_seed_is_distinct_and_only_dalis_depends_on_the_rank():
    for stream in Stream:
        seeds = {RunStreams(STREAM_SEED, rank).seed_of(stream, 0) for rank in range(8)}
        assert len(seeds) == (8 if stream in PER_RANK else 1), stream
    # no two purposes, epochs or positions share a seed (seed + rank would: seed 1 rank 0 = seed 0 rank 1)
    epochs = [EpochStreams(RunStreams(seed), epoch) for seed in (0, 1) for epoch in range(3)]
    every = [seeds.sample_seed(stream, position) for seeds in epochs for position in range(64)
             for stream in (Stream.AUGMENT, Stream.ERASING)]
    every += [seeds.chunk_seed(stream, step, slot) for seeds in epochs for step in range(8) for slot in range(8)
              for stream in (Stream.MIX, Stream.DROP)]
    assert len(set(every)) == len(every)


def test_every_rank_builds_the_same_initial_weights():
    import timm

    weights = []
    for rank in (0, 5):
        RunStreams(STREAM_SEED, rank).seed_init()
        weights.append(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1).state_dict())
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_the_teacher_draws_nothing():
    import timm

    teacher = timm.create_model("resnet10t", num_classes=4, drop_path_rate=0.1, drop_rate=0.2)
    images = torch.randn(4, 3, 32, 32)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    first, second = teacher_forward(teacher, images), teacher_forward(teacher, images)
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    assert torch.equal(first, second)  # eval mode: no dropout, no drop path
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]


def test_a_result_from_before_the_keyed_streams_is_named_when_skipped(tmp_path, data_cache):
    old = {"status": "finished", "top1": 50.0, "streams": 2, "nodes": {"cpu": [0]}}
    assert "version 2" in trained_before(old) and "before per-rank" in trained_before({**old, "streams": None})
    assert trained_before({**old, "streams": STREAMS_VERSION}) is None
    folder = tmp_path / "old_run"
    folder.mkdir()
    RunDir(folder).result.write_text(json.dumps(old))
    proc = run_train(["data.builtin.train_per_class=30", "data.builtin.val_per_class=10", f"hydra.run.dir={folder}"],
                     tmp_path, data_cache)
    assert "already finished (top-1 50.00); skipping" in proc.stdout
    assert "random streams of version 2" in proc.stdout + proc.stderr
