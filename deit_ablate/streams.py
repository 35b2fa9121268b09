"""Every random stream of a run, derived in one place from (seed, purpose, epoch, rank).

| stream     | what draws from it                                                  | shared / per rank |
|------------|---------------------------------------------------------------------|-------------------|
| `init`     | the model's initial weights (DDP then broadcasts rank 0's anyway)   | shared            |
| `sampler`  | the epoch's permutation, which the ranks split between them         | shared            |
| `loader`   | the loader workers' augmentation: worker w is seeded with base + w  | per rank, epoch   |
|            | (torch's DataLoader rule; Python, NumPy and torch in the worker),   |                   |
|            | base drawn from this stream; DALI's pipeline seed likewise          |                   |
| `mix`      | NumPy's global generator of the training process: timm's Mixup/CutMix | per rank, epoch |
| `erasing`  | Python's `random` of the training process: timm's batch-level random | per rank, epoch  |
|            | erasing (which images, where)                                       |                   |
| `torch`    | torch's generators of the training process: drop path, the erased   | per rank, epoch   |
|            | pixels' noise                                                       |                   |

The teacher draws nothing (eval mode, frozen). With `runtime.num_workers=0` the images are augmented in the training
process, from its `erasing`/`mix`/`torch` streams. Every per-epoch stream is a function of the epoch, so a run resumed
at an epoch boundary draws exactly what it would have drawn; a resume mid-epoch keeps the sampler's order (the
images left of the epoch) but not the augmentation draws of the rest of that epoch.

The released DeiT code seeds each process with `seed + rank` (main.py). Deriving each stream by hashing instead keeps
streams of neighbouring seeds, epochs and ranks apart (seed 1 rank 0 is not seed 0 rank 1).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch


class Stream(str, Enum):
    """What a random stream is for (the README's table of streams)."""

    INIT = "init"
    SAMPLER = "sampler"
    LOADER = "loader"
    MIX = "mix"
    ERASING = "erasing"
    TORCH = "torch"


# 2: the streams of this module. Results without it were trained when every rank's loader workers drew alike.
STREAMS_VERSION = 2
SHARED = frozenset({Stream.INIT, Stream.SAMPLER})  # the same on every rank: the ranks must agree on these
_SEED_BITS = 63  # torch.Generator.manual_seed takes a signed 64-bit integer


def derive_seed(seed: int, stream: Stream, epoch: int | None = None, rank: int | None = None) -> int:
    """A 63-bit seed for `stream` of run `seed` at `epoch` on `rank` (None: not a function of it)."""
    words = [seed % 2**64, zlib.crc32(stream.value.encode()),
             0 if epoch is None else epoch + 1, 0 if rank is None else rank + 1]
    low, high = np.random.SeedSequence(words).generate_state(2, np.uint32)
    return (int(high) << 32 | int(low)) % 2**_SEED_BITS


@dataclass(frozen=True)
class RunStreams:
    """The random streams of one process (global `rank`) of a run with seed `seed`."""

    seed: int
    rank: int = 0

    def seed_of(self, stream: Stream, epoch: int | None = None) -> int:
        """The seed of `stream` at `epoch` for this process (shared streams ignore the rank)."""
        return derive_seed(self.seed, stream, epoch, None if stream in SHARED else self.rank)

    def generator(self, stream: Stream, epoch: int | None = None) -> torch.Generator:
        """A torch CPU generator seeded for `stream` at `epoch`."""
        return torch.Generator().manual_seed(self.seed_of(stream, epoch))

    def loader_base_seed(self, epoch: int) -> int:
        """The base seed of `epoch`'s loader workers: the first draw of the loader stream, as torch's DataLoader
        draws it from its `generator` when it starts workers."""
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator(Stream.LOADER, epoch)).item())

    def seed_init(self) -> None:
        """Seed the process for building the model: every rank builds the same initial weights."""
        _seed_globals(*(self.seed_of(Stream.INIT),) * 3)

    def seed_epoch(self, epoch: int) -> None:
        """Seed the training process's global generators for `epoch`: Mixup/CutMix, erasing, drop path."""
        _seed_globals(self.seed_of(Stream.ERASING, epoch), self.seed_of(Stream.MIX, epoch),
                      self.seed_of(Stream.TORCH, epoch))


def _seed_globals(python: int, numpy: int, torch_seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (the CPU and every GPU)."""
    random.seed(python)
    np.random.seed(numpy % 2**32)
    torch.manual_seed(torch_seed)


def seed_loader_worker(base_seed: int) -> None:
    """Seed this loader worker's Python, NumPy and torch generators from `base_seed` exactly as torch's DataLoader
    seeds a worker it starts (torch/utils/data/_utils/worker.py)."""
    from torch.utils.data import get_worker_info
    from torch.utils.data._utils.worker import _generate_state

    worker = get_worker_info()
    if worker is None:
        raise RuntimeError("seed_loader_worker runs in a DataLoader worker process only")
    seed = base_seed + worker.id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, worker.id))


def copies_augmented_alike(result: dict, repeats: int) -> bool:
    """Whether a run's result comes from before STREAMS_VERSION 2 with repeated augmentation over several ranks,
    whose copies of an image were augmented alike (their loader workers shared one stream)."""
    ranks = sum(len(on_host) for on_host in (result.get("nodes") or {}).values())
    return result.get("streams") is None and repeats > 1 and ranks > 1
