"""Samplers and loaders: the epoch dealt to the recipe's virtual slots for training, an exact shard for eval."""

from __future__ import annotations

import atexit
import functools
import itertools
import math
import os
import signal
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from deit_ablate.config.schema import DataBackend, RuntimeConfig
from deit_ablate.core.streams import EpochStreams, RunStreams, Stream, seed_sample, slot_positions
from deit_ablate.data.batch import ErasingBoxes

if TYPE_CHECKING:
    from timm.data.random_erasing import RandomErasing

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
    """`sampler`'s indices, each with its sample's augmentation and erasing seeds: functions of the run's seed, the
    epoch and the sample's position in the epoch's order (streams.py), whoever computes them."""

    def __init__(self, sampler: SlotSampler, streams: RunStreams) -> None:
        self.sampler, self.streams = sampler, streams
        self.epoch_streams = EpochStreams(streams, 0)

    def set_epoch(self, epoch: int) -> None:
        """Seed the permutation and the samples' augmentations of `epoch`."""
        self.sampler.set_epoch(self.streams.seed_of(Stream.SAMPLER, epoch))
        self.epoch_streams = EpochStreams(self.streams, epoch)

    def __iter__(self):
        seeds = self.epoch_streams
        return ((index, seeds.sample_seed(Stream.AUGMENT, position), seeds.sample_seed(Stream.ERASING, position))
                for index, position in self.sampler.dealt())

    def __len__(self) -> int:
        return len(self.sampler)


class SeededItems(Dataset):
    """`dataset` whose items are augmented from their own seed (`SeededSamples`), in a loader worker or the training
    process alike: the worker count changes no draw. With `erasing`, each item also carries where timm's random
    erasing erases it (`ErasingBoxes`: its Python draws, made here rather than in the training process)."""

    def __init__(self, dataset: Dataset, erasing: RandomErasing | None = None) -> None:
        self.dataset = dataset
        self.boxes = ErasingBoxes(erasing) if erasing is not None else None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]):
        index, sample_seed, erasing_seed = key
        seed_sample(sample_seed)
        item = self.dataset[index]
        if self.boxes is None:
            return item
        image, target = item
        return image, target, self.boxes(erasing_seed, image.shape[0], image.shape[1])


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


def processes_sharing_cores() -> int:
    """Training processes that share this process's cores: torchrun's LOCAL_WORLD_SIZE (its ranks of a node start in
    one task, one affinity mask); 1 otherwise (a SLURM task per rank has its own cpus-per-task)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return 1


def num_workers(configured: int | None) -> int:
    """`configured` (runtime.num_workers), or the cores this process may use when it is unset (None)."""
    return configured if configured is not None else default_num_workers()


@dataclass(frozen=True)
class LoaderSettings:
    """How one rank spends its cores: loader workers (each with one torch thread, as torch's DataLoader sets them),
    pinned memory, batches prefetched per worker, and the training process's torch threads."""

    workers: int
    pin_memory: bool
    prefetch_factor: int | None  # batches each worker keeps ready (None without workers)
    persistent_workers: bool
    main_threads: int | None  # torch intra-op threads of the training process; None: torch's default (one per core)


def loader_settings(runtime: RuntimeConfig, device_type: str, cores: int, sharing: int = 1) -> LoaderSettings:
    """The loader and thread settings of a rank on `device_type` with `cores` cores shared by `sharing` training
    processes, where runtime.num_workers and runtime.cpu_threads are left unset (None); what they set wins.

    On a GPU a rank's cores decode and augment: all but two become workers (one core for the training process,
    which launches kernels and copies batches, one for the pin-memory thread), the training process keeps the
    cores the workers leave, and each worker prefetches 2 batches (timm's default: 14 workers keep 28 batches
    ready; 4 would hold over 2 GB of 256-image batches in shared memory per rank). On a CPU the training step
    itself needs the cores: workers default to every core of the process (at low priority where the step limits
    the run: `worker_niceness`) and torch keeps its own thread default."""
    gpu = device_type == "cuda"
    per_rank = max(cores // max(sharing, 1), 1) if gpu else cores
    if runtime.num_workers is not None:
        workers = runtime.num_workers
    else:
        workers = max(per_rank - 2, 1) if gpu else per_rank
    threads = runtime.cpu_threads
    if threads is None and gpu:
        threads = max(per_rank - workers, 1)
    return LoaderSettings(workers=workers, pin_memory=gpu, prefetch_factor=(2 if gpu else 4) if workers else None,
                          persistent_workers=workers > 0, main_threads=threads)


def device_type_of(runtime: RuntimeConfig) -> str:
    """The kind of device a run of `runtime` trains on (runtime.device=auto: a GPU where there is one)."""
    requested = runtime.device
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested).type


def rank_loader_settings(runtime: RuntimeConfig, device_type: str | None = None) -> LoaderSettings:
    """`loader_settings` for this process: its device (runtime.device unless given), its cores and the processes it
    shares them with."""
    return loader_settings(runtime, device_type or device_type_of(runtime), default_num_workers(),
                           processes_sharing_cores())


# At most this many pixels a side, a CPU's training step costs more than decoding and augmenting its images: the
# demo at 32 px (docs/PERFORMANCE.md). Above it, on a CPU at 224 px, the loader is the limit.
STEP_BOUND_SIZE = 64


def worker_niceness(configured: int | None, device_type: str | None, image_size: int | None) -> int:
    """runtime.worker_nice, or where it is unset (None): 19 on a CPU training images of at most STEP_BOUND_SIZE px,
    where the step's threads should have the cores first, and 0 elsewhere, where the workers limit the run."""
    if configured is not None:
        return configured
    on_cpu = device_type in (None, "cpu")
    return 19 if on_cpu and image_size is not None and image_size <= STEP_BOUND_SIZE else 0


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


def lost_worker(error: BaseException) -> bool:
    """Whether `error` is how a loader worker's death reaches the training process: torch's `DataLoader worker ...
    exited unexpectedly`, or, when the worker died while handing over a batch's shared memory, the EOFError or
    connection error of multiprocessing's resource sharer."""
    return isinstance(error, (EOFError, ConnectionError)) or "DataLoader worker" in str(error)


def dead_workers() -> list[tuple[int, str]]:
    """(pid, how it ended: a signal's name or an exit status) of every loader worker of this process that has died
    (the workers of the loaders built here that keep theirs: persistent workers)."""
    dead = []
    for loader in list(_WORKER_LOADERS):
        for worker in getattr(getattr(loader, "_iterator", None), "_workers", ()):
            code = worker.exitcode  # polls: None while it runs
            if code is not None and code != 0:
                dead.append((worker.pid, signal.Signals(-code).name if code < 0 else f"exit status {code}"))
    return dead


def describe_lost_worker(error: BaseException, wait_s: float = 2.0) -> str | None:
    """`a loader worker (pid N) was killed by SIGKILL` for a worker's death that `error` (lost_worker) carries, from
    the workers themselves, else torch's message; None when no worker died (another connection error). A killed
    worker's sockets close before it can be reaped, so its death is awaited for up to `wait_s`."""
    dead, deadline = dead_workers(), time.monotonic() + wait_s
    while not dead and time.monotonic() < deadline:
        time.sleep(0.02)
        dead = dead_workers()
    if dead:
        ends = [f"(pid {pid}) was killed by {how}" if how.startswith("SIG") else f"(pid {pid}) ended with {how}"
                for pid, how in dead]
        return f"a loader worker {'; another '.join(ends)}"
    return f"a loader worker died ({str(error).strip()})" if "DataLoader worker" in str(error) else None


@atexit.register
def end_all_workers() -> None:
    """Stop the workers of every loader built here that still has them (persistent workers outlive their epochs): at
    a run's end (a sweep's next run starts without them) and at exit."""
    end_workers(*list(_WORKER_LOADERS))


def build_loader(dataset: Dataset, sampler: Sampler, batch_size: int, runtime: RuntimeConfig,
                 train: bool, device_type: str | None = None, niceness: int | None = None,
                 erasing: RandomErasing | None = None) -> DataLoader:
    """A DataLoader as `rank_loader_settings` resolves it (workers that live through the run, pinned memory on a
    GPU, prefetch); a training one's keys are (index, seeds) (`SeededSamples`), each item augmented from its own
    seeds, its batches (images, targets), or (images, targets, erasing boxes) with the stage's `erasing`.

    The workers run `niceness` (`worker_niceness`; runtime.worker_nice, 0 when unset) below the training process's
    CPU priority: where cores are short they fill the time the training step leaves idle instead of preempting its
    threads (docs/PERFORMANCE.md).
    """
    settings = rank_loader_settings(runtime, device_type)
    workers = settings.workers
    niceness = worker_niceness(runtime.worker_nice, device_type, None) if niceness is None else niceness
    if train:
        dataset = SeededItems(dataset, erasing)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=settings.pin_memory,
        drop_last=train,
        # Workers start once: a fork per worker per epoch costs the training process copy-on-write page faults
        # (docs/PERFORMANCE.md); every training item carries its own seed.
        persistent_workers=settings.persistent_workers,
        prefetch_factor=settings.prefetch_factor,
        worker_init_fn=functools.partial(start_worker, niceness) if workers > 0 else None,
    )
    if workers > 0:
        _WORKER_LOADERS.add(loader)
    return loader


def end_workers(*loaders: object) -> None:
    """Stop the workers of `loaders` now, as torch stops them when a loader's iterator is freed. Left to the
    garbage collector (a run's loaders sit in reference cycles), the iterator's queues are finalized before it, its
    stop signal never reaches the workers, and each worker is waited on for 5 s, then killed."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)  # torch's DataLoader keeps its persistent workers' iterator
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def build_train_loader(dataset: Dataset, sampler: SeededSamples | SkipFirst, batch_size: int, spec: TransformSpec,
                       runtime: RuntimeConfig, device: torch.device | None = None,
                       erasing: RandomErasing | None = None):
    """The training loader of data.backend: a DataLoader over the PIL transform, whose workers also draw where
    `erasing` (the per-batch step's) erases each image, or DALI's (on `device`, augmenting as `spec` says), which
    takes the plain indices and draws per pipeline (its erasing drawn per batch from the samples' seeds)."""
    if spec.data.backend == DataBackend.dali:
        from deit_ablate.data.dali import DaliTrainLoader

        threads = rank_loader_settings(runtime, device.type if device is not None else None).workers
        return DaliTrainLoader(dataset, IndicesOnly(sampler), batch_size, spec, device, threads=max(1, threads))
    device_type = device.type if device is not None else None
    niceness = worker_niceness(runtime.worker_nice, device_type, spec.resolution.train_size)
    return build_loader(dataset, sampler, batch_size, runtime, train=True, device_type=device_type, niceness=niceness,
                        erasing=erasing)


class IndicesOnly(Sampler):
    """The image indices of a sampler of (index, seeds) keys."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return (item[0] for item in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
