"""The host's share of a training step (issue 53, point 2): everything the training process does around the model's
compute, with a stand-in model of negligible compute, on batches already decoded in memory.

Ours is Trainer.train_steps as a run calls it (the per-batch normalisation and erasing, Mixup/CutMix, the loss, its
bookkeeping and logging, the optimizer, the schedule, the progress bar) over a list of loader batches. timm's is what
timm's train.py does per step in its training process when its prefetcher is on, as it is by default: timm's
PrefetchLoader (uint8 to float, normalisation, random erasing), the forward, SoftTargetCrossEntropy, the backward,
timm's AdamW step, `loss.item()`, the scheduler's step_update. Its Mixup/CutMix runs in its loader workers
(FastCollateMixup), so it is drawn once outside the timing and reported on its own. Both sides train the same stand-in:
a narrow DeiT whose forward reads a 4 x 4 grid of pixels into its head, so what is timed is the host's work.

On a GPU the batch goes to the device once, outside the timing, both loops and models run there, and each timed run
starts and ends with the device drained (DeviceCalls.synchronize; nothing on the CPU), so the time is the training
process's host time per step with the batch arithmetic on the device.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import torch

from deit_ablate.bench.env import torch_threads
from deit_ablate.bench.report import Figure, Report, median
from deit_ablate.bench.step import StepSetup, build_trainer
from deit_ablate.core.streams import EpochStreams, RunStreams, Stream
from deit_ablate.data.batch import ErasingBoxes

STAND_IN = ["++model.kwargs.patch_size=16", "++model.kwargs.embed_dim=48", "++model.kwargs.depth=1",
            "++model.kwargs.num_heads=1"]


def stand_in_forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward of negligible compute for a DeiT of width 48: a 4 x 4 grid of the image's pixels into its head."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        step = images.shape[-1] // 4
        return self.head(images[:, :, ::step, ::step][:, :, :4, :4].flatten(1))

    return types.MethodType(forward, module)


def host_overrides(data_root: str, batch: int, size: int, device: str = "cpu") -> list[str]:
    """The run the host step is timed on: the demo's DeiT recipe at `size` px, one micro-batch of `batch` a step (the
    computation timm's train.py makes), the stand-in network, on `device` (fp32 on either)."""
    return ["model=deit_tiny", *STAND_IN, f"resolution.train_size={size}", f"resolution.eval_size={size}",
            f"train.global_batch={batch}", f"train.micro_batch={batch}", f"runtime.max_batch_per_device={batch}",
            "runtime.num_workers=0", f"data.root={data_root}", "data.builtin.train_per_class=30",
            "data.builtin.val_per_class=10", f"runtime.device={device}", "train.amp=fp32", "runtime.log_interval=50"]


def ours(overrides: list[str], device: torch.device | None = None) -> tuple[StepSetup, Callable[[int], float]]:
    """Our trainer on `device` (the CPU by default) with the stand-in forward, its batch there, and a function timing
    `steps` steps of train_steps (seconds; the device drained before and after)."""
    setup = build_trainer(overrides, device or torch.device("cpu"))
    module = setup.trainer.module
    module.forward = stand_in_forward(module)
    streams, epoch = RunStreams(0), [0]
    batch = (setup.pixels, setup.targets, *worker_boxes(setup, streams))

    def run(steps: int) -> float:
        batches = [batch] * steps  # the boxes stay on the CPU, as the loader hands them over
        setup.calls.synchronize()
        start = time.perf_counter()
        setup.trainer.train_steps(batches, epoch[0], streams=streams)
        setup.calls.synchronize()
        epoch[0] += 1
        return time.perf_counter() - start

    return setup, run


def worker_boxes(setup: StepSetup, streams: RunStreams) -> list[torch.Tensor]:
    """Where the random erasing erases each image of the batch, as the loader workers draw it (outside the timing,
    as timm's Mixup in its workers); none without erasing."""
    erasing = setup.trainer.batch_transform.erasing
    if erasing is None:
        return []
    epoch, (height, width) = EpochStreams(streams, 0), setup.pixels.shape[1:3]
    draw = ErasingBoxes(erasing)
    return [torch.stack([draw(epoch.sample_seed(Stream.ERASING, position), height, width)
                         for position in range(setup.batch)])]


class _Batches:
    """An in-memory loader as timm's fast_collate hands it to PrefetchLoader: uint8 N x 3 x H x W and targets."""

    def __init__(self, pixels: torch.Tensor, targets: torch.Tensor, steps: int) -> None:
        self.pixels, self.targets, self.steps = pixels, targets, steps
        self.sampler, self.batch_size, self.dataset = None, pixels.shape[0], None

    def __iter__(self):
        return iter([(self.pixels, self.targets)] * self.steps)

    def __len__(self) -> int:
        return self.steps


def timms(setup: StepSetup) -> tuple[dict[str, float], Callable[[int], float]]:
    """timm's training-process loop on the same stand-in, recipe and batch, on the setup's device (a function timing
    `steps` steps, the device drained before and after), and the seconds its FastCollateMixup takes per batch in a
    loader worker."""
    import numpy as np
    from timm.data import FastCollateMixup
    from timm.data.loader import PrefetchLoader
    from timm.loss import SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    device = setup.device
    model = type(setup.trainer.module)(**_module_kwargs(setup.trainer.module)).to(device)
    model.forward = stand_in_forward(model)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=300, warmup_epochs=5, step_on_epochs=False,
                                       updates_per_epoch=1251)
    mixup = FastCollateMixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1,
                             num_classes=setup.trainer.module.num_classes)
    samples = [(np.ascontiguousarray(image.permute(2, 0, 1).cpu().numpy()), int(target))
               for image, target in zip(setup.pixels, setup.targets, strict=True)]
    start = time.perf_counter()
    pixels, targets = mixup(samples)
    collate_s = time.perf_counter() - start
    pixels, targets = pixels.to(device), targets.to(device)  # on the device once, outside the timing
    loss_fn = SoftTargetCrossEntropy()
    updates = [0]

    def run(steps: int) -> float:
        loader = PrefetchLoader(_Batches(pixels, targets, steps), device=device, re_prob=0.25, re_mode="pixel",
                                re_count=1)
        model.train()
        setup.calls.synchronize()
        start = time.perf_counter()
        for images, soft in loader:
            loss = loss_fn(model(images), soft)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()  # timm's losses_m.update(loss.item() ...) each step
            updates[0] += 1
            scheduler.step_update(num_updates=updates[0])
        setup.calls.synchronize()
        return time.perf_counter() - start

    return {"mixup_collate_s_per_batch_in_a_worker": collate_s}, run


def _module_kwargs(module: torch.nn.Module) -> dict[str, Any]:
    """The constructor arguments of the stand-in DeiT: the same network on timm's side."""
    return {"img_size": module.patch_embed.img_size, "patch_size": module.patch_embed.patch_size,
            "embed_dim": module.embed_dim, "depth": len(module.blocks), "num_heads": module.blocks[0].attn.num_heads,
            "num_classes": module.num_classes}


def alternate(runs: dict[str, Callable[[int], float]], steps: int, pairs: int, warmup: int = 2) -> dict[str, list]:
    """Milliseconds per step of each side, measured in turn (a, b, a, b, ...) so the machine's noise hits both."""
    for run in runs.values():
        run(warmup)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(pairs):
        for name, run in runs.items():
            ms[name].append(1000 * run(steps) / steps)
    return ms


def host_step_figures(report: Report, command: str, measurement: str, overrides: list[str], device: torch.device,
                      steps: int, pairs: int) -> None:
    """Ours and timm's ms per step on the run `overrides` describe, in alternating pairs, into `report`."""
    setup, run_ours = ours(overrides, device)
    extra, run_timm = timms(setup)
    with torch_threads(1):
        ms = alternate({"ours": run_ours, "timm": run_timm}, steps, pairs)
    settings = {"batch": setup.batch, "train_size": setup.pixels.shape[1], "steps_per_sample": steps,
                "torch_threads": 1, "model": "stand-in: deit_tiny of width 48, forward = a 4 x 4 pixel grid into the "
                "head", "overrides": overrides}
    notes = {"ours": "Trainer.train_steps over in-memory uint8 B x H x W x 3 batches: normalise + erasing (its "
                     "boxes drawn in the workers, once outside the timing), Mixup/CutMix, loss, loss sums, logging "
                     "every 50 steps, AdamW, schedule, progress bar",
             "timm": "timm's train.py loop with its prefetcher: PrefetchLoader (float, normalise, erasing), forward, "
                     "SoftTargetCrossEntropy, backward, AdamW, loss.item(), step_update; its Mixup/CutMix is in "
                     "the workers (FastCollateMixup, drawn once outside the timing)"}
    for name, samples in ms.items():
        report.add(Figure(measurement, name, median(samples), "ms/step", report.device["summary"],
                          f"{command}  (in-process, alternating pairs)", {**settings, "loop": notes[name]}, samples,
                          extra if name == "timm" else {}))
    report.compare(measurement, "ours", "timm", target=1.0, lower_is_better=True)


def section(report: Report, command: str, device: torch.device, quick: bool, repeats: int, data_root: str,
            loader_note: Callable[[str], str], log: Callable[[str], None]) -> None:
    """The host's share of a step at batch 256 on `device` (the batch and both loops there, so on a GPU the batch
    arithmetic runs on it), at 224 px and at 32 px (what is left where that arithmetic is small): ours against timm's
    training-process loop on a stand-in of negligible compute, ms per step in alternating pairs; then the loader
    alone, one process held to one thread (a worker core), ours against timm's create_transform on JPEGs."""
    from deit_ablate.bench import pipeline

    batch = 16 if quick else 256
    steps, pairs = (2, 1) if quick else (10, max(repeats, 5))
    for size, measurement in ((224, "host_step"), (32, "host_step_32px")):
        host_step_figures(report, command, measurement, host_overrides(data_root, batch, size, device.type), device,
                          steps if size == 224 else 2 * steps, pairs)

    count = 48 if quick else 256
    root = pipeline.ensure_jpeg_set(count)
    loader_overrides = ["resolution=224px", "runtime.num_workers=0", f"data.root={data_root}"]
    loaders = {}
    for name in ("ours", "timm_transform"):
        setup_ = pipeline.loader_setup(loader_overrides)
        dataset, batch_step = pipeline.jpeg_dataset(root, setup_, whole_timm_transform=name == "timm_transform")
        loaders[name] = pipeline.our_loader(setup_, dataset, 16 if quick else 32, batch_step, device).one_thread()
    results = pipeline.alternate_loaders(loaders, 1 if quick else max(repeats, 4), log=log)
    for name, rows in results.items():
        samples = [row["images_per_s"] for row in rows]
        report.add(Figure("loader_per_core", name, median(samples), "images/s", report.device["summary"],
                          f"{command}  (in-process: one process, one thread, over {count} JPEGs)",
                          {"images": str(root), "image_size": f"{pipeline.JPEG_WIDTH}x{pipeline.JPEG_HEIGHT} JPEG q90",
                           "train_size": 224, "loader": loader_note(name)}, samples))
    report.compare("loader_per_core", "ours", "timm_transform", target=1.0)
