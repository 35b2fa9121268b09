"""Random streams across ranks: what several processes draw together, checked with several ranks.

Repeated augmentation puts the copies of an image on different ranks, at the same place in their batches; if the
ranks' loader workers share their seeds, the copies get the same crop, flip and RandAugment ops and the ingredient
(5.3 points in DeiT's Table 8) is silently weakened. Ranks are simulated in one process with the real sampler,
dataset, transform, loader and seeding (streams.py), and run for real under torchrun with Gloo.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import runpy
import sys
from collections import defaultdict
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from timm.data.auto_augment import AugmentOp
from timm.layers import DropPath
from torch.utils.data import DataLoader, Dataset

from deit_ablate.data.datasets import build_dataset
from deit_ablate.data.loader import build_train_loader, build_train_sampler, seed_epoch_data
from deit_ablate.data.transforms import build_train_pipeline
from deit_ablate.mixing import build_mixup
from deit_ablate.rundir import RESULT, RunDir, runs_root
from deit_ablate.streams import SHARED, STREAMS_VERSION, RunStreams, Stream, copies_augmented_alike
from deit_ablate.teacher import teacher_forward
from tests.conftest import REPO, compose_config, run_train

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


def rank_epoch(cfg, root: Path, rank: int, world: int, epoch: int = 0) -> list[tuple[int, torch.Tensor, str]]:
    """(image index, uint8 pixels, drawn ops) of each training image `rank` of `world` loads in `epoch`, seeded as
    run.py seeds an epoch."""
    per_image, _ = build_train_pipeline(cfg)
    dataset = build_dataset(cfg, "train", per_image, root)
    dali = cfg.data.backend == "dali"
    dataset = dataset if dali else Recorded(dataset)
    sampler = build_train_sampler(dataset, cfg.augment.repeated_aug, world, rank)
    loader = build_train_loader(dataset, sampler, 4, cfg, torch.device("cpu"))
    streams = RunStreams(cfg.seed, rank)
    streams.seed_epoch(epoch)
    seed_epoch_data(sampler, loader, streams, epoch)
    order, records = list(sampler), []
    for batch in loader:
        if dali:
            for pixels in batch[0]:
                records.append((order[len(records)], pixels, ""))
        else:
            records += list(zip(batch[2].tolist(), batch[0], batch[3], strict=True))
    assert [index for index, _, _ in records] == order[:len(records)]  # the loader follows the sampler
    return records


def copy_pairs(per_rank: list[list[tuple[int, torch.Tensor, str]]]) -> list[tuple[tuple, tuple]]:
    """Every pair of copies of one image, each copy as (rank, pixels, ops)."""
    copies = defaultdict(list)
    for rank, records in enumerate(per_rank):
        for index, pixels, ops in records:
            copies[index].append((rank, pixels, ops))
    return [pair for found in copies.values() for pair in combinations(found, 2)]


def chance_tail(pairs: int, same: int, p: float) -> float:
    """P(X >= same) for X ~ Binomial(pairs, p): how surprising `same` coinciding pairs are by chance alone."""
    return sum(math.comb(pairs, k) * p**k * (1 - p) ** (pairs - k) for k in range(same, pairs + 1))


@pytest.mark.parametrize("backend", ["pil", "fast_jpeg", "dali"])
def test_no_two_copies_of_an_image_share_their_augmentation_across_ranks(backend, jpeg_root, record_ops):
    world = 4 if backend == "dali" else 8
    extra = {"pil": [], "fast_jpeg": ["data.fast_jpeg=true"], "dali": ["data.backend=dali"]}[backend]
    cfg = _config(jpeg_root, *extra)
    per_rank = [rank_epoch(cfg, jpeg_root, rank, world) for rank in range(world)]
    pairs = copy_pairs(per_rank)
    assert len(pairs) == CLASSES * TRAIN_PER_CLASS  # each image of the epoch's third has 3 copies: 3 pairs
    assert all(a[0] != b[0] for a, b in pairs)  # every copy on another rank (DeiT's sampler)
    identical = sum(torch.equal(a[1], b[1]) for a, b in pairs)
    assert identical == 0, f"{identical} of {len(pairs)} copy pairs are pixel-identical"
    if backend != "dali":  # DALI draws its ops inside its graph; its pixels say it all
        assert all(len(a[2].split("+")) == 2 for a, _ in pairs)
        same_ops = sum(a[2] == b[2] for a, b in pairs)
        # chance: 1 in 15^2 ordered pairs; a tail probability below 1e-4 would be no chance
        tail = chance_tail(len(pairs), same_ops, 1 / RANDAUGMENT_OPS**2)
        assert tail > 1e-4, f"{same_ops} of {len(pairs)} copy pairs drew the same RandAugment ops (p = {tail:.1e})"


def test_an_epoch_boundary_resume_loads_the_same_augmented_images(jpeg_root, record_ops):
    cfg = _config(jpeg_root)
    first, again = rank_epoch(cfg, jpeg_root, 1, 4, epoch=2), rank_epoch(cfg, jpeg_root, 1, 4, epoch=2)
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(first, again, strict=True))
    later = rank_epoch(cfg, jpeg_root, 1, 4, epoch=3)
    assert [r[0] for r in later] != [r[0] for r in first]  # another epoch, another permutation


class RecordedWithWorker(Recorded):
    """Recorded, plus the process id of the loader worker that loaded the image."""

    def __getitem__(self, index: int):
        return (*super().__getitem__(index), os.getpid())


def fresh_worker_epoch(dataset: Dataset, sampler, streams: RunStreams, epoch: int) -> list[tuple]:
    """(index, pixels, ops) of `epoch` from a loader whose 2 workers start for this epoch alone, seeded by torch from
    the epoch's loader stream: what each epoch drew before the training workers lived through the run."""
    sampler.set_epoch(streams.seed_of(Stream.SAMPLER, epoch))
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, drop_last=True,
                        generator=streams.generator(Stream.LOADER, epoch))
    return [(int(i), pixels, ops) for batch in loader for i, pixels, ops in zip(batch[2], batch[0], batch[3],
                                                                                 strict=True)]


@pytest.mark.parametrize("rank", [0, 1])
def test_training_workers_start_once_and_draw_each_epoch_what_fresh_workers_draw(jpeg_root, record_ops, rank):
    cfg = _config(jpeg_root)
    per_image, _ = build_train_pipeline(cfg)
    dataset = RecordedWithWorker(build_dataset(cfg, "train", per_image, jpeg_root))
    streams, world = RunStreams(cfg.seed, rank), 2
    sampler = build_train_sampler(dataset, cfg.augment.repeated_aug, world, rank)
    loader = build_train_loader(dataset, sampler, 4, cfg, torch.device("cpu"))
    workers, epochs = set(), []
    for epoch in range(3):
        seed_epoch_data(sampler, loader, streams, epoch)
        batches = list(loader)
        workers |= {pid for batch in batches for pid in batch[4].tolist()}
        epochs.append([(int(i), pixels, ops) for batch in batches
                       for i, pixels, ops in zip(batch[2], batch[0], batch[3], strict=True)])
    assert len(workers) == 2  # the same two worker processes served all three epochs
    reference = build_train_sampler(dataset, cfg.augment.repeated_aug, world, rank)
    for epoch, drawn in enumerate(epochs):
        fresh = fresh_worker_epoch(dataset, reference, streams, epoch)
        assert [i for i, _, _ in drawn] == [i for i, _, _ in fresh]
        assert all(torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(drawn, fresh, strict=True)), epoch
    assert not torch.equal(epochs[0][0][1], epochs[1][0][1])  # another epoch, other draws


def _step_draws(streams: RunStreams, epoch: int) -> tuple:
    """What the training process draws at the start of `epoch`: a Mixup/CutMix choice, erasing, a drop-path mask."""
    cfg = compose_config([])
    streams.seed_epoch(epoch)
    mixup = build_mixup(cfg.mix, cfg.data.num_classes)
    _, batch_step = build_train_pipeline(cfg)
    erased = batch_step(torch.full((32, 8, 8, 3), 128, dtype=torch.uint8))
    drop_path = DropPath(0.5).train()
    mask = drop_path(torch.ones(32, 1, 1)).flatten() > 0
    return mixup._params_per_batch(), erased, mask


def test_each_per_rank_stream_differs_across_ranks_and_the_shared_ones_agree():
    ranks = [RunStreams(STREAM_SEED, rank) for rank in range(8)]
    for stream in Stream:
        for epoch in (0, 1):
            seeds = {streams.seed_of(stream, epoch) for streams in ranks}
            assert len(seeds) == (1 if stream in SHARED else 8), stream
    # no two purposes, epochs or ranks share a seed (seed + rank would: seed 1 rank 0 = seed 0 rank 1)
    every = [RunStreams(seed, rank).seed_of(stream, epoch) for seed in (0, 1) for rank in range(8)
             for epoch in range(3) for stream in Stream if stream not in SHARED]
    assert len(set(every)) == len(every)

    draws = [_step_draws(streams, epoch=0) for streams in ranks]
    lambdas = [mix[0] for mix, _, _ in draws]
    assert len(set(lambdas)) == 8  # Mixup/CutMix: each rank its own lambda
    for (_, erased_a, mask_a), (_, erased_b, mask_b) in combinations(draws, 2):
        assert not torch.equal(erased_a, erased_b)  # random erasing
        assert not torch.equal(mask_a, mask_b)  # drop path
    # each of them is a function of (seed, epoch, rank): the same again (exact resume), another at the next epoch
    again, next_epoch = _step_draws(ranks[3], epoch=0), _step_draws(ranks[3], epoch=1)
    assert again[0] == draws[3][0] and torch.equal(again[1], draws[3][1]) and torch.equal(again[2], draws[3][2])
    assert next_epoch[0] != draws[3][0] and not torch.equal(next_epoch[2], draws[3][2])


def test_the_sampler_permutation_agrees_across_ranks():
    dataset = list(range(96))
    per_rank = []
    for rank in range(8):
        sampler = build_train_sampler(dataset, 3, 8, rank)
        sampler.set_epoch(RunStreams(STREAM_SEED, rank).seed_of(Stream.SAMPLER, 0))
        per_rank.append(list(sampler))
    merged = [per_rank[i % 8][i // 8] for i in range(96)]  # position i of rank r: element 8i + r of one list
    assert all(merged[i] == merged[i + 1] == merged[i + 2] for i in range(0, 96, 3))  # one permutation, repeated
    assert len(set(merged)) == 32


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


def test_a_multi_rank_result_from_before_the_per_rank_streams_is_named_when_skipped(tmp_path, data_cache):
    old = {"status": "finished", "top1": 50.0, "nodes": {"gpu1": list(range(8))}}
    assert copies_augmented_alike(old, repeats=3)
    assert not copies_augmented_alike({**old, "streams": STREAMS_VERSION}, repeats=3)
    assert not copies_augmented_alike(old, repeats=1)  # no copies to share anything
    assert not copies_augmented_alike({**old, "nodes": {"cpu": [0]}}, repeats=3)  # one rank: never affected
    folder = tmp_path / "old_run"
    folder.mkdir()
    RunDir(folder).result.write_text(json.dumps(old))
    proc = run_train(["data.builtin.train_per_class=30", "data.builtin.val_per_class=10", f"hydra.run.dir={folder}"],
                     tmp_path, data_cache)
    assert "already finished (top-1 50.00); skipping" in proc.stdout
    assert "its repeated-augmentation copies were augmented alike" in proc.stdout + proc.stderr


# --- for real: train.py under torchrun, 4 Gloo ranks, each recording what it drew -----------------------------


def audited_main() -> None:
    """Run train.py with its draws recorded (one JSON line per image, Mixup/CutMix choice, erased batch, drop-path
    mask and sampler epoch) under $DEIT_STREAM_AUDIT; torchrun starts this file in each rank."""
    import os

    import timm.data.distributed_sampler as samplers
    import timm.data.mixup as mixup
    import timm.layers.drop as drop

    from deit_ablate.data import batch as batch_module
    from deit_ablate.data.bad_images import SkippingImageFolder

    folder, rank = Path(os.environ["DEIT_STREAM_AUDIT"]), int(os.environ.get("RANK", "0"))

    def write(kind: str, **fields) -> None:
        with open(folder / f"{rank}-{os.getpid()}.jsonl", "a") as handle:
            handle.write(json.dumps({"kind": kind, "rank": rank, **fields}) + "\n")

    def wrap(owner, name, after):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            after(out, *args)
            return out

        setattr(owner, name, wrapper)

    def image_drawn(out, dataset, index):
        write("image", split=Path(dataset.root).name, index=int(index), ops="+".join(DRAWN),
              sha=hashlib.sha1(out[0].numpy().tobytes()).hexdigest())

    get_item = SkippingImageFolder.__getitem__

    def clearing(self, index):
        DRAWN.clear()
        return get_item(self, index)

    SkippingImageFolder.__getitem__ = clearing
    op_call = AugmentOp.__call__
    AugmentOp.__call__ = lambda self, img: (DRAWN.append(self.name), op_call(self, img))[1]
    wrap(SkippingImageFolder, "__getitem__", image_drawn)
    wrap(mixup.Mixup, "_params_per_batch", lambda out, self: write("mix", lam=out[0], cutmix=out[1]))
    wrap(batch_module.BatchNormalize, "__call__",
         lambda out, self, images, **_: write("erased", sha=hashlib.sha1(out.numpy().tobytes()).hexdigest()))
    wrap(drop, "drop_path", lambda out, x, prob=0.0, training=False, *_: prob > 0 and training and write(
        "drop_path", mask=(out.flatten(1) != 0).any(1).int().tolist()))
    wrap(samplers.RepeatAugSampler, "__iter__", lambda out, self: write("sampler", epoch_seed=self.epoch))
    sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


def _audit_records(folder: Path) -> dict[str, list[dict]]:
    records = defaultdict(list)
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["kind"]].append(record)
    return records


@pytest.mark.slow
def test_four_torchrun_ranks_augment_each_copy_differently_and_share_one_permutation(tmp_path, jpeg_root,
                                                                                      data_cache):
    audit = tmp_path / "audit"
    audit.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--master_port=29541",
                str(Path(__file__))]
    overrides = ["data=imagefolder", f"data.root={jpeg_root}", f"data.num_classes={CLASSES}", "model.kwargs.depth=2",
                 "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2", "train.global_batch=16", "train.epochs=1",
                 "runtime.num_workers=1", "runtime.eval_batch=8", "runtime.log_interval=2"]
    run_train(overrides, tmp_path, data_cache, module=torchrun,
              extra_env={"DEIT_STREAM_AUDIT": str(audit), "PYTHONPATH": str(REPO)})
    (result,) = [json.loads(p.read_text()) for p in (runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}")]
    assert result["streams"] == STREAMS_VERSION and not copies_augmented_alike(result, repeats=3)
    records = _audit_records(audit)
    images = [(r["index"], (r["rank"], r["sha"], r["ops"])) for r in records["image"] if r["split"] == "train"]
    copies = defaultdict(list)
    for index, copy in images:
        copies[index].append(copy)
    pairs = [pair for found in copies.values() for pair in combinations(found, 2)]
    assert len(pairs) == CLASSES * TRAIN_PER_CLASS and all(a[0] != b[0] for a, b in pairs)
    assert sum(a[1] == b[1] for a, b in pairs) == 0  # no pixel-identical copies
    same_ops = sum(a[2] == b[2] for a, b in pairs)
    assert chance_tail(len(pairs), same_ops, 1 / RANDAUGMENT_OPS**2) > 1e-4, same_ops

    by_rank = defaultdict(lambda: defaultdict(list))
    for kind in ("mix", "erased", "drop_path", "sampler"):
        for record in records[kind]:
            by_rank[kind][record["rank"]].append({k: v for k, v in record.items() if k not in ("kind", "rank")})
    assert len({json.dumps(by_rank["sampler"][rank]) for rank in range(4)}) == 1  # one permutation
    for kind in ("mix", "erased", "drop_path"):  # each rank its own Mixup/CutMix, erasing, drop path
        streams = [json.dumps(by_rank[kind][rank]) for rank in range(4)]
        assert all(by_rank[kind][rank] for rank in range(4)) and len(set(streams)) == 4, kind


if __name__ == "__main__":
    audited_main()
