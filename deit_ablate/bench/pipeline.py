"""Input-pipeline throughput: our training transform and DataLoader on ImageNet-sized JPEGs, and worker startup."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from deit_ablate.bench.env import synchronize, torch_threads
from deit_ablate.config.schema import RuntimeConfig
from deit_ablate.config.stage_config import stage_config
from deit_ablate.core.atomic import atomic_folder
from deit_ablate.core.streams import RunStreams
from deit_ablate.data.builtin import CLASSES, CLASSES_B, draw_image
from deit_ablate.data.datasets import build_dataset
from deit_ablate.data.fast_jpeg import lazy_loader
from deit_ablate.data.loader import (
    IndicesOnly,
    SeededItems,
    SeededSamples,
    build_loader,
    build_train_loader,
    build_train_sampler,
    seed_epoch_data,
)
from deit_ablate.data.transforms import TransformSpec, build_train_pipeline, build_train_transform

JPEG_WIDTH, JPEG_HEIGHT, JPEG_QUALITY = 500, 375, 90  # about the mean ImageNet training image


@dataclass(frozen=True)
class LoaderSetup:
    """What the input-pipeline benchmarks read of one run config: the transforms' groups, how loading runs, the
    seed."""

    spec: TransformSpec
    runtime: RuntimeConfig
    seed: int


def loader_setup(overrides: list[str]) -> LoaderSetup:
    """The loader pieces of the config `python train.py <overrides>` runs (its stage's, stage_config.py)."""
    from deit_ablate.bench.compose import compose_run

    cfg = stage_config(compose_run(overrides))
    return LoaderSetup(TransformSpec(cfg.data, cfg.augment, cfg.resolution), cfg.runtime, cfg.seed)


def cache_root() -> Path:
    """$DEIT_ABLATE_CACHE, else the repository's .cache folder."""
    from deit_ablate.bench.compose import REPO

    return Path(os.environ.get("DEIT_ABLATE_CACHE") or REPO / ".cache").expanduser().resolve()


SHAPES = CLASSES + CLASSES_B  # the classes a drawn JPEG set can have: both built-in shape sets


def _draw_jpegs(folder: Path, indices: range, key: tuple[int, ...], classes: int) -> None:
    """Draw images `indices` of a JPEG set into folder/<class>/, each from its own seed key + (index,)."""
    side = max(JPEG_WIDTH, JPEG_HEIGHT)
    top = (side - JPEG_HEIGHT) // 2
    shapes = SHAPES[:classes]
    for index in indices:
        label = index % classes
        (folder / shapes[label]).mkdir(parents=True, exist_ok=True)
        image = draw_image(label, side, np.random.default_rng([*key, index]), shapes)
        image.crop((0, top, JPEG_WIDTH, top + JPEG_HEIGHT)).save(folder / shapes[label] / f"{index:06d}.jpg",
                                                                  quality=JPEG_QUALITY)


def ensure_jpeg_set(count: int, root: Path | None = None, seed: int = 0, val_count: int = 0,
                    classes: int = len(CLASSES)) -> Path:
    """An ImageFolder tree of built-in images drawn at 500x375, JPEG quality 90: `count` in train/<class>/ and
    `val_count` in val/<class>/, over `classes` classes (at most len(SHAPES)), dealt round-robin; drawn once into
    the cache, by as many processes as this one has cores (an image takes about 0.1 s)."""
    if not 1 <= classes <= len(SHAPES):
        raise ValueError(f"a drawn JPEG set has 1 to {len(SHAPES)} classes, not {classes}")
    spec: dict[str, Any] = {"count": count, "width": JPEG_WIDTH, "height": JPEG_HEIGHT, "quality": JPEG_QUALITY,
                            "seed": seed}
    name = f"jpeg-{JPEG_WIDTH}x{JPEG_HEIGHT}-q{JPEG_QUALITY}-n{count}-seed{seed}"
    if val_count or classes != len(CLASSES):  # the pipeline section's train-only set keeps its name
        spec.update(val_count=val_count, classes=classes)
        name += f"-val{val_count}-c{classes}"
    target = (root or cache_root() / "bench") / name
    marker = target / "COMPLETE.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return target

    def fill(staging: Path) -> None:
        processes = max(1, min(len(os.sched_getaffinity(0)), (count + val_count) // 64))
        jobs = [(staging / "train", range(start, count, processes), (seed,)) for start in range(processes)]
        jobs += [(staging / "val", range(start, val_count, processes), (seed, 1)) for start in range(processes)]
        if processes == 1:
            for folder, indices, key in jobs:
                _draw_jpegs(folder, indices, key, classes)
        else:
            with ProcessPoolExecutor(processes) as pool:
                for done in [pool.submit(_draw_jpegs, folder, indices, key, classes) for folder, indices, key in jobs]:
                    done.result()
        (staging / "COMPLETE.json").write_text(json.dumps(spec))

    atomic_folder(target, fill, complete=lambda: marker.exists() and json.loads(marker.read_text()) == spec)
    return target


def jpeg_dataset(root: Path, setup: LoaderSetup, whole_timm_transform: bool = False) -> tuple[Dataset, Callable | None]:
    """The JPEG set as run.py builds a training set for `setup` (data.fast_jpeg on or off), and the per-batch step
    the trainer adds; with `whole_timm_transform`, timm's transform whole in the workers (DeiT's main.py), no step."""
    spec, on_bad_image = setup.spec, setup.runtime.on_bad_image
    if whole_timm_transform:
        return build_dataset(spec.data, "train", build_train_transform(spec), root, on_bad_image=on_bad_image), None
    per_image, per_batch = build_train_pipeline(spec)
    return build_dataset(spec.data, "train", per_image, root, on_bad_image=on_bad_image), per_batch


def timm_loader(root: Path, spec: TransformSpec, batch: int, workers: int) -> DataLoader:
    """timm's create_loader as timm's train.py sets it up on this device (prefetcher on, DeiT flags)."""
    from timm.data import create_dataset, create_loader

    aug, size = spec.augment, spec.resolution.train_size
    dataset = create_dataset("", root=str(root), split="train", is_training=True)
    return create_loader(dataset, input_size=(3, size, size),
                         batch_size=batch, is_training=True, use_prefetcher=True, re_prob=aug.reprob,
                         re_mode=aug.remode, re_count=aug.recount, scale=tuple(aug.scale), hflip=aug.hflip,
                         color_jitter=aug.color_jitter, auto_augment=aug.auto_augment, interpolation=aug.interpolation,
                         mean=tuple(spec.data.mean), std=tuple(spec.data.std), num_workers=workers,
                         device=torch.device("cpu"), pin_memory=False, persistent_workers=True)


def our_loader(setup: LoaderSetup, dataset: Dataset, batch: int, batch_step: Callable | None = None,
               device: torch.device | None = None) -> Loader:
    """Our training loader (data.loader.build_train_loader: a DataLoader, or DALI's with data.backend=dali) over our
    training sampler, as run.py builds it; each batch is moved to `device` and given the trainer's per-batch step,
    as train_steps does (this counts as pipeline time)."""
    sampler = one_process_sampler(setup, dataset, batch)
    device = device or torch.device("cpu")
    erasing = getattr(batch_step, "erasing", None)
    loader = build_train_loader(dataset, sampler, batch, setup.spec, setup.runtime, device, erasing=erasing)
    seed_epoch_data(sampler, loader, RunStreams(setup.seed), 0)
    return Loader(loader, batch_step, device)


def one_process_sampler(setup: LoaderSetup, dataset: Dataset, batch: int) -> SeededSamples:
    """Our training sampler for one process computing one slot of `batch` images per step (as run.py seeds it)."""
    slots = build_train_sampler(len(dataset), setup.spec.augment.repeated_aug, 1, (0,), batch)
    return SeededSamples(slots, RunStreams(setup.seed))


class Loader:
    """A DataLoader, the copy to the device and the per-batch step, iterated with `threads` torch threads if set."""

    def __init__(self, loader: Any, batch_step: Callable | None, device: torch.device,
                 threads: int | None = None) -> None:
        self.loader, self.batch_step, self.device, self.threads = loader, batch_step, device, threads

    def one_thread(self) -> Loader:
        """The same loader, iterated with one torch thread, as inside a DataLoader worker."""
        return Loader(self.loader, self.batch_step, self.device, threads=1)

    def __iter__(self):
        with torch_threads(self.threads):
            reused = None  # as Trainer.train_steps does on CPU
            for images, targets, *erasing in self.loader:  # the workers' erasing boxes, where they draw them
                images = images.to(self.device, non_blocking=True)
                if self.batch_step is not None:
                    images = self.batch_step(images, out=reused, boxes=erasing[0] if erasing else None)
                    reused = images if images.device.type == "cpu" else None
                yield images, targets
                synchronize(self.device)


def epoch_rate(loader, max_batches: int | None = None) -> dict[str, float]:
    """Iterate one epoch: seconds to the first batch, then images/s over the remaining batches."""
    start = time.perf_counter()
    first = None
    images = 0
    for index, (batch, _) in enumerate(loader):
        if first is None:
            first = time.perf_counter()
        else:
            images += batch.shape[0]
        if max_batches is not None and index + 1 >= max_batches:
            break
    end = time.perf_counter()
    return {"first_batch_s": first - start, "images_per_s": images / max(end - first, 1e-9),
            "epoch_s": end - start}


def alternate_loaders(loaders: dict[str, Any], repeats: int, max_batches: int | None = None,
                      log: Callable[[str], None] = print) -> dict[str, list[dict[str, float]]]:
    """Epoch rates of each loader, in turn (a, b, c, a, b, c, ...); the first epoch of each is a warm-up."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in loaders}
    for loader in loaders.values():
        epoch_rate(loader, max_batches)
    for repeat in range(repeats):
        for name, loader in loaders.items():
            results[name].append(epoch_rate(loader, max_batches))
            log(f"[bench] pipeline {name} repeat {repeat}: {results[name][-1]['images_per_s']:.0f} images/s")
    return results


def worker_startup(setup: LoaderSetup, dataset: Dataset, batch: int, epochs: int,
                   workers: str) -> list[dict[str, float]]:
    """Per-epoch first-batch latency and epoch time, reseeding like run.py, with loader workers that are `ours`
    (started once, reseeded per epoch: data/loader.py), `persistent` (torch's, started once) or `per_epoch`."""
    sampler = one_process_sampler(setup, dataset, batch)
    loader = build_loader(dataset, sampler, batch, setup.runtime, train=True)
    if workers != "ours":
        loader = DataLoader(dataset, batch_size=batch, sampler=IndicesOnly(sampler), num_workers=loader.num_workers,
                            drop_last=True, persistent_workers=workers == "persistent" and loader.num_workers > 0,
                            pin_memory=loader.pin_memory, prefetch_factor=loader.prefetch_factor)
    rows = []
    for epoch in range(epochs):
        seed_epoch_data(sampler, loader, RunStreams(setup.seed), epoch)  # as run.py does
        rows.append(epoch_rate(loader))
    return rows


def resume_exact_with_workers(workers: str, count: int = 2) -> bool:
    """Whether epoch 1's worker-side random draws after a restart equal those of an uninterrupted run, with loader
    workers as `worker_startup` names them."""

    class Noise(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(1)

    def epoch_values(loader: DataLoader, sampler: SeededSamples, epoch: int) -> list[float]:
        seed_epoch_data(sampler, loader, RunStreams(0), epoch)  # run.py's per-epoch reseeding
        return torch.cat(list(loader)).flatten().tolist()

    def make() -> tuple[DataLoader, SeededSamples]:
        sampler = SeededSamples(build_train_sampler(8, 1, 1, (0,), 4), RunStreams(0))
        if workers == "ours":
            return DataLoader(SeededItems(Noise()), batch_size=4, sampler=sampler, num_workers=count,
                              persistent_workers=True), sampler
        return DataLoader(Noise(), batch_size=4, sampler=IndicesOnly(sampler), num_workers=count,
                          persistent_workers=workers == "persistent"), sampler

    straight, sampler = make()
    epoch_values(straight, sampler, 0)
    return epoch_values(straight, sampler, 1) == epoch_values(*make(), 1)


def stage_costs(root: Path, transform: Callable, count: int, repeats: int = 2,
                batch_step: Callable | None = None) -> dict[str, float]:
    """Milliseconds per image of each step of a training transform, one thread, best of `repeats`.

    `decode` is what ImageFolder's default loader does (open, decode, convert to RGB); the other keys are the
    transform's steps by name, in order, then `batch_step` (if given) run on the stacked outputs, per image."""
    from PIL import Image

    files = sorted((root / "train").glob("*/*.jpg"))[:count]
    steps = list(getattr(transform, "transforms", [transform]))
    names = ["decode", *(getattr(step, "__name__", type(step).__name__) for step in steps)]
    if batch_step is not None:
        names.append(type(batch_step).__name__)
    best = dict.fromkeys(names, float("inf"))
    with torch_threads(1):
        for _ in range(repeats):
            totals, outputs = dict.fromkeys(names, 0.0), []
            for path in files:
                start = time.perf_counter()
                with Image.open(path) as image:
                    value = image.convert("RGB")
                totals["decode"] += time.perf_counter() - start
                for name, step in zip(names[1:len(steps) + 1], steps, strict=True):
                    start = time.perf_counter()
                    value = step(value)
                    totals[name] += time.perf_counter() - start
                outputs.append(value)
            if batch_step is not None:  # into the float batch of a previous call, as Trainer.train_steps does
                batch = torch.stack(outputs)
                reused = batch_step(batch)
                start = time.perf_counter()
                batch_step(batch, out=reused)
                totals[names[-1]] = time.perf_counter() - start
            best = {name: min(best[name], 1e3 * totals[name] / len(files)) for name in names}
    return best


def crop_difference(root: Path, count: int, size: int = 224, seed: int = 0) -> dict[str, float]:
    """How far the fast crop's pixels lie from timm's for the same random draws: mean |difference| in grey levels,
    over crops decoded at full scale and over crops decoded reduced, and the share decoded reduced."""
    import random

    from PIL import Image
    from timm.data.transforms import RandomResizedCropAndInterpolation

    from deit_ablate.data.fast_jpeg import FastRandomResizedCrop, dct_factor

    timm_crop = RandomResizedCropAndInterpolation(size, interpolation="bicubic")
    fast_crop = FastRandomResizedCrop.from_timm(timm_crop)
    differences: dict[bool, list[float]] = {False: [], True: []}
    for index, path in enumerate(sorted((root / "train").glob("*/*.jpg"))[:count]):
        with Image.open(path) as image:
            random.seed(seed + index)
            _, _, height, width = RandomResizedCropAndInterpolation.get_params(image, timm_crop.scale, timm_crop.ratio)
            random.seed(seed + index)
            expected = np.asarray(timm_crop(image.convert("RGB")), dtype=np.float32)
        random.seed(seed + index)
        got = np.asarray(fast_crop(lazy_loader(str(path))), dtype=np.float32)
        differences[dct_factor(width, height, size, size) > 1].append(float(np.abs(got - expected).mean()))
    total = len(differences[False]) + len(differences[True])
    return {"full_scale": float(np.mean(differences[False])) if differences[False] else 0.0,
            "reduced_scale": float(np.mean(differences[True])) if differences[True] else 0.0,
            "reduced_share": len(differences[True]) / max(total, 1)}


def speedup_bound(costs: dict[str, float], free: tuple[str, ...]) -> float:
    """Amdahl: how much faster the whole transform gets if the `free` stages cost nothing."""
    total = sum(costs.values())
    return total / max(total - sum(costs[name] for name in free if name in costs), 1e-12)
