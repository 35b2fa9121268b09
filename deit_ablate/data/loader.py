"""Samplers and loaders: the epoch dealt to the recipe's virtual slots for training, an exact shard for eval."""

from __future__ import annotations

import atexit
import functools
import itertools
import math
import os
import signal
import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from deit_ablate.config.schema import DataBackend, RuntimeConfig
from deit_ablate.core.streams import EpochStreams, RunStreams, Stream, seed_sample, slot_positions

if TYPE_CHECKING:
    from deit_ablate.data.transforms import TransformSpec

# The released RASampler keeps floor(|data| / 256) * 256 images of each epoch (timm's selected_round).
SELECTED_ROUND = 256


class SlotSampler(Sampler):
    """The epoch's order dealt to `slots` virtual slots as DeiT's RASampler deals it to that many GPUs, for the
    slots `own` this process computes: step by step, each of its slots' next `micro_batch` images in turn.

    The epoch's order is a permutation (seeded by `set_epoch`) with each image `repeats` times in a row; slot j
    takes positions j, j + slots, j + 2 slots, ... (so the copies of an image fall in different slots), up to
    floor(|data| / 256) * 256 / slots of them, exactly as timm's RepeatAugSampler with num_replicas=slots, rank=j
    (without repeats: torch's DistributedSampler with drop_last). Only whole steps are dealt."""

    def __init__(self, length: int, repeats: int, slots: int, own: tuple[int, ...], micro_batch: int) -> None:
        self.length, self.repeats, self.slots, self.own, self.micro_batch = length, repeats, slots, own, micro_batch
        if repeats > 1:
            padded = math.ceil(length * repeats / slots)
            per_slot = length // SELECTED_ROUND * SELECTED_ROUND // slots if length >= SELECTED_ROUND else \
                math.ceil(length / slots)
            per_slot = min(per_slot, padded)
        else:
            per_slot = length // slots
        self.steps = per_slot // micro_batch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Seed the epoch's permutation (a function of the run's seed and the epoch: streams.py)."""
        self.epoch = epoch

    def positions(self) -> list[int]:
        """The epoch positions this process takes, in the order it takes them."""
        return [position for step in range(self.steps)
                for position in slot_positions(self.slots, self.own, self.micro_batch, step)]

    def order(self) -> list[int]:
        """The epoch's order: the permutation, each image `repeats` times in a row."""
        generator = torch.Generator().manual_seed(self.epoch)
        permutation = torch.randperm(self.length, generator=generator)
        if self.repeats > 1:
            permutation = torch.repeat_interleave(permutation, self.repeats)
        return permutation.tolist()

    def dealt(self) -> list[tuple[int, int]]:
        """(image index, epoch position) of each sample this process takes, in order (the order wraps around to pad,
        as timm's does)."""
        order = self.order()
        n = len(order)
        return [(order[position % n], position) for position in self.positions()]

    def __iter__(self):
        return (index for index, _ in self.dealt())

    def __len__(self) -> int:
        return self.steps * len(self.own) * self.micro_batch


def build_train_sampler(length: int, repeats: int, slots: int, own: tuple[int, ...], micro_batch: int
                        ) -> SlotSampler:
    """DeiT's sampler over the recipe's virtual slots: each image `repeats` times per epoch, copies in different
    slots, epoch cut to |data|. One process runs the same recipe as many (timm's train.py refuses RA in one)."""
    return SlotSampler(length, repeats, slots, own, micro_batch)


class SeededSamples(Sampler):
    """`sampler`'s indices, each paired with its sample's augmentation seed: a function of the run's seed, the epoch
    and the sample's position in the epoch's order (streams.py), whoever computes it."""

    def __init__(self, sampler: SlotSampler, streams: RunStreams) -> None:
        self.sampler, self.streams = sampler, streams
        self.epoch_streams = EpochStreams(streams, 0)

    def set_epoch(self, epoch: int) -> None:
        """Seed the permutation and the samples' augmentations of `epoch`."""
        self.sampler.set_epoch(self.streams.seed_of(Stream.SAMPLER, epoch))
        self.epoch_streams = EpochStreams(self.streams, epoch)

    def __iter__(self):
        seeds = self.epoch_streams
        return ((index, seeds.sample_seed(Stream.AUGMENT, position)) for index, position in self.sampler.dealt())

    def __len__(self) -> int:
        return len(self.sampler)


class SeededItems(Dataset):
    """`dataset` whose items are augmented from their own seed (`SeededSamples`), in a loader worker or the training
    process alike: the worker count changes no draw."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, sample_seed = key
        seed_sample(sample_seed)
        return self.dataset[index]


def seed_epoch_data(sampler: SeededSamples, loader, streams: RunStreams, epoch: int) -> None:
    """Seed one epoch's data: the permutation and every sample's augmentation (functions of the epoch, so a resume
    anywhere draws what the interrupted run would have), and DALI's pipeline seed (per rank)."""
    sampler.set_epoch(epoch)
    loader.generator = streams.generator(Stream.LOADER, epoch)  # DALI draws its pipeline seed from it


class ShardSampler(Sampler):
    """Every `world_size`-th index from `rank`: ranks together see each eval image exactly once."""

    def __init__(self, length: int, world_size: int, rank: int) -> None:
        self.indices = list(range(rank, length, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class SkipFirst(Sampler):
    """`sampler` without its first `count` indices: the rest of an epoch that was interrupted."""

    def __init__(self, sampler: Sampler, count: int) -> None:
        self.sampler, self.count = sampler, count

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.count, 0)


def default_num_workers() -> int:
    """The cores this process may use (SLURM's cpus-per-task or the affinity mask)."""
    if "SLURM_CPUS_PER_TASK" in os.environ:
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    return len(os.sched_getaffinity(0))


def num_workers(configured: int | None) -> int:
    """`configured` (runtime.num_workers), or the cores this process may use when it is unset (None)."""
    return configured if configured is not None else default_num_workers()


def lower_worker_priority(niceness: int, worker_id: int) -> None:
    """A DataLoader worker_init_fn: add `niceness` to this worker's CPU niceness (0 leaves it as it is)."""
    if niceness and hasattr(os, "nice"):  # POSIX only
        os.nice(niceness)


def start_worker(niceness: int, worker_id: int) -> None:
    """A DataLoader worker_init_fn: SIGTERM and SIGINT ignored, the CPU niceness lowered (`lower_worker_priority`).

    A scheduler's SIGTERM and a terminal's Ctrl-C reach the whole process group; a worker they ended would turn the
    training process's orderly stop (core/stopping.py) into torch's `DataLoader worker ... is killed by signal`
    error. The training process stops its workers itself, and a worker whose parent is gone exits on its own."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    lower_worker_priority(niceness, worker_id)


# Loaders whose workers `start_worker` started: they ignore SIGTERM, which is how multiprocessing's exit stops daemonic
# children before it joins them, so they are stopped at exit the way torch stops them (before multiprocessing's exit
# handler: atexit runs the later registration first).
_WORKER_LOADERS: weakref.WeakSet[DataLoader] = weakref.WeakSet()


@atexit.register
def stop_workers_at_exit() -> None:
    """Stop the workers of every loader built here that still has them (persistent workers outlive their epochs)."""
    for loader in list(_WORKER_LOADERS):
        iterator = getattr(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def build_loader(dataset: Dataset, sampler: Sampler, batch_size: int, runtime: RuntimeConfig,
                 train: bool) -> DataLoader:
    """A DataLoader with workers that live through the run, pinned memory on GPU and prefetch; a training one's
    items are (index, seed) pairs (`SeededSamples`), each augmented from its own seed.

    The workers run at runtime.worker_nice below the training process's CPU priority: where cores are short they
    fill the time the training step leaves idle instead of preempting its threads (docs/PERFORMANCE.md, section 8).
    """
    workers = num_workers(runtime.num_workers)
    if train:
        dataset = SeededItems(dataset)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=train,
        # Workers start once: a fork per worker per epoch costs the training process copy-on-write page faults
        # (docs/PERFORMANCE.md); every training item carries its own seed.
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=functools.partial(start_worker, runtime.worker_nice) if workers > 0 else None,
    )
    if workers > 0:
        _WORKER_LOADERS.add(loader)
    return loader


def build_train_loader(dataset: Dataset, sampler: SeededSamples | SkipFirst, batch_size: int, spec: TransformSpec,
                       runtime: RuntimeConfig, device: torch.device | None = None):
    """The training loader of data.backend: a DataLoader over the PIL transform, or DALI's (on `device`, augmenting
    as `spec` says), which takes the plain indices and draws per pipeline."""
    if spec.data.backend == DataBackend.dali:
        from deit_ablate.data.dali import DaliTrainLoader

        return DaliTrainLoader(dataset, IndicesOnly(sampler), batch_size, spec, device,
                               threads=max(1, num_workers(runtime.num_workers)))
    return build_loader(dataset, sampler, batch_size, runtime, train=True)


class IndicesOnly(Sampler):
    """The image indices of a sampler of (index, seed) pairs."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return (index for index, _ in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
