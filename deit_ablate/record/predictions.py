"""Each eval image's predicted class, kept with a finished run for the disagreement matrix (DeiT Table 4).

The final evaluation (the weights the headline top-1 is of) collects, on each rank, the predicted class of every
image of its shard: `main` for a plain model; `cls`, `dist` and `fused` (the run's distill.fusion rule, the one
top-1 ranks by) for a model with a distillation token; and the true `labels`. `gather_in_order` puts the ranks'
shards back into dataset order on rank 0, each image once; RunDir.write_predictions keeps them in the run folder.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch

from deit_ablate.core.distributed import DistInfo, gather_objects

LABELS, INDEX = "labels", "index"  # the true classes; the dataset index of each kept image
HEADS = ("main", "cls", "dist", "fused")  # the heads a predictions file can hold, in this order
HEAD_NAMES = {"main": "", "cls": "class head", "dist": "dist head", "fused": "fused"}  # how a label names a head


@dataclass
class LocalPredictions:
    """This rank's predicted classes, per head, and true labels, batch by batch in its loader's order."""

    heads: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    labels: list[torch.Tensor] = field(default_factory=list)

    def add(self, scores: Mapping[str, torch.Tensor], top1: torch.Tensor, targets: torch.Tensor) -> None:
        """Keep a batch's predictions: `top1` is the ranked head's first choice (the one top-1 counts); the class
        and distillation heads' argmax when `scores` has them."""
        self.heads.setdefault("main" if "main" in scores else "fused", []).append(top1.detach())
        for head in ("cls", "dist"):
            if head in scores:
                self.heads.setdefault(head, []).append(scores[head].argmax(dim=1).detach())
        self.labels.append(targets.detach())

    def __len__(self) -> int:
        return sum(int(t.numel()) for t in self.labels)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every kept head and the labels as int64 arrays, in loader order (one host copy per head)."""
        out = {head: torch.cat(parts).cpu().numpy() for head, parts in self.heads.items()}
        out[LABELS] = torch.cat(self.labels).cpu().numpy() if self.labels else np.zeros(0, dtype=np.int64)
        return {name: values.astype(np.int64) for name, values in out.items()}


def loader_order(loader: Any, count: int) -> list[int]:
    """The dataset indices of the first `count` images `loader` yields: its sampler's order (an eval loader never
    shuffles), or 0..count-1 for a loader without one."""
    sampler = getattr(loader, "sampler", None)
    return list(islice(iter(sampler), count)) if sampler is not None else list(range(count))


def in_dataset_order(shards: Iterable[tuple[list[int], Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """The ranks' (indices, arrays) as one set of arrays sorted by dataset index, each image once (a sampler that
    pads repeats images: the repeat is dropped), with the kept indices under `index`."""
    shards = list(shards)
    indices = np.concatenate([np.asarray(order, dtype=np.int64) for order, _ in shards])
    names = list(shards[0][1])
    values = {name: np.concatenate([arrays[name] for _, arrays in shards]) for name in names}
    kept, first = np.unique(indices, return_index=True)  # sorted, the first sight of each image
    out = {name: values[name][first] for name in names}
    out[INDEX] = kept
    return out


def gather_in_order(local: LocalPredictions, loader: Any, info: DistInfo) -> dict[str, np.ndarray] | None:
    """Every rank's predictions in dataset order on rank 0 (None on the others); every rank must call it."""
    arrays = local.arrays()
    shards = gather_objects((loader_order(loader, len(local)), arrays), info)
    return in_dataset_order(shards) if info.is_main else None


def compact(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays in the smallest integer type that holds them (int16 for up to 32767 classes)."""
    out = {}
    for name, values in arrays.items():
        top = int(values.max()) if values.size else 0
        out[name] = values.astype(np.int16 if top < 2 ** 15 and name != INDEX else np.int32)
    return out
