"""Every random stream of a run, derived in one place and keyed by what is computed, never by who computes it.

A run's global batch is `G = global_batch / micro_batch` virtual slots (the recipe's "8 GPUs x 128"). Each epoch's
repeated, permuted order is dealt to the slots as the released RASampler deals it to G GPUs (data/loader.py), and
the k-th position of that order is one sample wherever it is computed. So every draw is keyed by the experiment:

| stream     | what draws from it                                                  | keyed by                      |
|------------|---------------------------------------------------------------------|-------------------------------|
| `init`     | the model's initial weights (DDP then broadcasts rank 0's anyway)   | seed                          |
| `sampler`  | the epoch's permutation, dealt to the G slots                       | seed, epoch                   |
| `augment`  | one sample's crop, flip, RandAugment/AutoAugment/3-Augment ops and  | seed, epoch, position k       |
|            | `data.fast_jpeg`'s crop (Python, NumPy and torch seeded per sample) |                               |
| `erasing`  | one sample's random erasing (which, where, the noise)               | seed, epoch, position k       |
| `mix`      | one micro-batch's Mixup/CutMix (lambda, box, which of the two)      | seed, epoch, step, slot       |
| `drop`     | one micro-batch's drop path and dropout masks                       | seed, epoch, step, slot       |
| `loader`   | `data.backend=dali`'s pipeline seed (per pipeline, not per sample)  | seed, epoch, rank             |

Worker count, world size, accumulation and the resume point therefore change no draw (only DALI's pipeline,
whose draws are per rank: statistically, not exactly, the same). The teacher draws nothing (eval mode, frozen).

The released DeiT code seeds each process with `seed + rank` (main.py), so its draws follow the hardware. Deriving
each stream by hashing keeps streams of neighbouring seeds, epochs and positions apart (seed 1 position 0 is not
seed 0 position 1).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch


class Stream(str, Enum):
    """What a random stream is for (the README's table of streams)."""

    INIT = "init"
    SAMPLER = "sampler"
    AUGMENT = "augment"
    ERASING = "erasing"
    MIX = "mix"
    DROP = "drop"
    LOADER = "loader"


# 3: draws keyed by sample position and (step, slot), the global batch dealt to virtual slots. 2: per-rank loader
# streams (results without a version were trained when every rank's loader workers drew alike).
STREAMS_VERSION = 3
PER_RANK = frozenset({Stream.LOADER})  # the one stream a function of the process: DALI's pipeline seed
_SEED_BITS = 63  # torch.Generator.manual_seed takes a signed 64-bit integer
_MASK64 = 2**64 - 1


def derive_seed(seed: int, stream: Stream, epoch: int | None = None, rank: int | None = None) -> int:
    """A 63-bit seed for `stream` of run `seed` at `epoch` on `rank` (None: not a function of it)."""
    words = [seed % 2**64, zlib.crc32(stream.value.encode()),
             0 if epoch is None else epoch + 1, 0 if rank is None else rank + 1]
    low, high = np.random.SeedSequence(words).generate_state(2, np.uint32)
    return (int(high) << 32 | int(low)) % 2**_SEED_BITS


def mix_seed(base: int, key: int) -> int:
    """A 63-bit seed for item `key` of a stream whose seed is `base` (splitmix64's finalizer of base + key):
    about a microsecond, so every sample of an epoch can have its own."""
    z = (base + 0x9E3779B97F4A7C15 * (key + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % 2**_SEED_BITS


def slot_positions(slots: int, own: Sequence[int], micro_batch: int, step: int) -> list[int]:
    """The epoch positions of slots `own`'s micro-batches at `step`, in batch order: slot j's i-th image of a step is
    position j + slots * (step * micro_batch + i), as the released RASampler deals an epoch to `slots` GPUs."""
    first = step * micro_batch
    return [slot + slots * (first + i) for slot in own for i in range(micro_batch)]


def seed_sample(sample_seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch's CPU generator for one sample's augmentation
    (what timm's and torchvision's transforms draw from); the CPU generator alone, which costs a microsecond where
    torch.manual_seed costs a hundred."""
    random.seed(sample_seed)
    np.random.seed(sample_seed % 2**32)
    torch.default_generator.manual_seed(sample_seed)


def seed_torch(seed: int) -> None:
    """Seed what torch.manual_seed seeds where it is drawn from: the CPU's generator, and every GPU's once CUDA is in
    use. Without CUDA in use, torch.manual_seed queues a lazy seeding of the GPUs with a formatted stack each call
    (about half a millisecond a step, docs/host-step.md)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


@dataclass(frozen=True)
class RunStreams:
    """The random streams of one process (global `rank`) of a run with seed `seed`."""

    seed: int
    rank: int = 0

    def seed_of(self, stream: Stream, epoch: int | None = None) -> int:
        """The seed of `stream` at `epoch` (only per-rank streams depend on this process's rank)."""
        return derive_seed(self.seed, stream, epoch, self.rank if stream in PER_RANK else None)

    def generator(self, stream: Stream, epoch: int | None = None) -> torch.Generator:
        """A torch CPU generator seeded for `stream` at `epoch`."""
        return torch.Generator().manual_seed(self.seed_of(stream, epoch))

    def seed_init(self) -> None:
        """Seed the process for building the model: every rank builds the same initial weights."""
        seed = self.seed_of(Stream.INIT)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)


class EpochStreams:
    """The streams of one epoch, their per-epoch seeds derived once: per-sample and per-micro-batch seeds then
    cost a microsecond each."""

    def __init__(self, streams: RunStreams, epoch: int) -> None:
        self.epoch = epoch
        self.bases = {stream: streams.seed_of(stream, epoch)
                      for stream in (Stream.AUGMENT, Stream.ERASING, Stream.MIX, Stream.DROP)}

    def sample_seed(self, stream: Stream, position: int) -> int:
        """The seed of the sample at `position` of the epoch's dealt order, for `stream` (augment or erasing)."""
        return mix_seed(self.bases[stream], position)

    def chunk_seed(self, stream: Stream, step: int, slot: int) -> int:
        """The seed of slot `slot`'s micro-batch at `step` of the epoch, for `stream` (mix or drop)."""
        return mix_seed(mix_seed(self.bases[stream], step), slot)

    def seed_chunk(self, step: int, slot: int) -> None:
        """Seed what one micro-batch draws in the training process: timm's Mixup/CutMix (NumPy's global generator)
        and drop path and dropout (torch's generators, the GPU's too)."""
        np.random.seed(self.chunk_seed(Stream.MIX, step, slot) % 2**32)
        seed_torch(self.chunk_seed(Stream.DROP, step, slot))


def trained_before(result: dict) -> str | None:
    """What a finished result from before STREAMS_VERSION 3 was trained with that the recipe no longer means, in a
    phrase; None for a result of this version."""
    version = result.get("streams")
    if version == STREAMS_VERSION:
        return None
    if version is None:
        return "before per-rank random streams (copies of an image on several ranks were augmented alike)"
    return (f"with random streams of version {version}: draws and the micro-batch followed the hardware (world "
            "size, workers, runtime.max_batch_per_device), not the recipe's virtual slots")
