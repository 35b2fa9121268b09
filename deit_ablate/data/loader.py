"""Samplers and loaders: repeated augmentation across ranks for training, an exact shard for eval."""

from __future__ import annotations

import functools
import itertools
import os

import torch
from omegaconf import DictConfig
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from deit_ablate.config import DataBackend
from deit_ablate.streams import RunStreams, Stream, seed_loader_worker


def build_train_sampler(dataset: Dataset, repeats: int, world_size: int, rank: int) -> Sampler:
    """DeiT's sampler: each image `repeats` times per epoch, copies on different ranks, epoch cut to |data|.
    Its permutation is seeded per epoch by `seed_epoch_data` (seed 0 here: the run's seed comes in with the epoch)."""
    if repeats > 1:
        # Explicit replicas and rank, so one process runs the same recipe as many (timm's train.py refuses).
        return RepeatAugSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, num_repeats=repeats)
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)


def seed_epoch_data(sampler: Sampler, loader, streams: RunStreams, epoch: int) -> None:
    """Seed one epoch's data: the permutation every rank shares, and this rank's augmentation stream (the loader
    workers', or DALI's pipeline seed), both functions of the epoch (exact resume at an epoch boundary)."""
    sampler.set_epoch(streams.seed_of(Stream.SAMPLER, epoch))  # both samplers seed their permutation with it
    loader.generator = streams.generator(Stream.LOADER, epoch)  # DALI draws its pipeline seed from it
    if isinstance(getattr(loader, "sampler", None), EpochSeededIndices):
        loader.sampler.base_seed = streams.loader_base_seed(epoch)


class EpochSeededIndices(Sampler):
    """`sampler`'s indices, each paired with the base seed of the epoch's loader workers (set by `seed_epoch_data`),
    for `EpochSeededItems` to read in the worker."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler, self.base_seed = sampler, 0

    def __iter__(self):
        base_seed = self.base_seed
        return ((index, base_seed) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class EpochSeededItems(Dataset):
    """`dataset` for loader workers that live through the run: at the first image of each epoch a worker reseeds
    itself as torch seeds a fresh worker from that epoch's base seed, so its augmentations are those of workers
    started anew each epoch (streams.py) without the start. (Two epochs of one 63-bit base seed are not told apart.)"""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self.seeded_with = dataset, None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, base_seed = key
        if base_seed != self.seeded_with:
            seed_loader_worker(base_seed)
            self.seeded_with = base_seed
        return self.dataset[index]


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


def num_workers(cfg: DictConfig) -> int:
    """runtime.num_workers, or the cores this process may use when it is unset."""
    return cfg.runtime.num_workers if cfg.runtime.num_workers is not None else default_num_workers()


def lower_worker_priority(niceness: int, worker_id: int) -> None:
    """A DataLoader worker_init_fn: add `niceness` to this worker's CPU niceness (0 leaves it as it is)."""
    if niceness and hasattr(os, "nice"):  # POSIX only
        os.nice(niceness)


def build_loader(dataset: Dataset, sampler: Sampler, batch_size: int, cfg: DictConfig, train: bool) -> DataLoader:
    """A DataLoader with workers that live through the run (a training one's reseeded each epoch), pinned memory on
    GPU and prefetch.

    The workers run at runtime.worker_nice below the training process's CPU priority: where cores are short they
    fill the time the training step leaves idle instead of preempting its threads (docs/PERFORMANCE.md, section 8).
    """
    workers = num_workers(cfg)
    if train and workers > 0:
        dataset, sampler = EpochSeededItems(dataset), EpochSeededIndices(sampler)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=train,
        # Workers start once: a fork per worker per epoch costs the training process copy-on-write page faults
        # (docs/PERFORMANCE.md); training workers reseed each epoch themselves (EpochSeededItems).
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=functools.partial(lower_worker_priority, cfg.runtime.worker_nice) if workers > 0 else None,
    )


def build_train_loader(dataset: Dataset, sampler: Sampler, batch_size: int, cfg: DictConfig,
                       device: torch.device | None = None):
    """The training loader of data.backend: a DataLoader over the PIL transform, or DALI's (on `device`)."""
    if cfg.data.backend == DataBackend.dali:
        from deit_ablate.data.dali import DaliTrainLoader

        return DaliTrainLoader(dataset, sampler, batch_size, cfg, device, threads=max(1, num_workers(cfg)))
    return build_loader(dataset, sampler, batch_size, cfg, train=True)
