"""The fixed teacher of Beyer et al. 2022 (arXiv:2106.05237): one view per training image, its outputs cached.

`distill.teacher_view=fixed` is the control of their "consistent teaching" experiments: the teacher's outputs are
computed once, on one fixed view of each training image, and the student, trained on its own random views, is
distilled towards those. The fixed view here is their central crop ("fix/cc"): the evaluation transform (resize the
shorter side to train_size / crop_pct, centre-crop train_size, normalize) at the student's training size.

The table is held in memory on the run's device, float32, one row per training image (N x K: 5.1 GB for ImageNet-1k);
it is computed at every launch, so a resumed run recomputes it from the same images and teacher weights (exactly on
CPU; on GPU up to the teacher kernels' own nondeterminism). Under DDP each rank computes every world_size-th image
and the ranks sum their tables, so every rank holds all of it: the training sampler hands a rank other images each
epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from deit_ablate.config.schema import RuntimeConfig
from deit_ablate.core.distributed import DistInfo, all_reduce_sum
from deit_ablate.core.logs import log
from deit_ablate.data.datasets import dataset_root, training_split
from deit_ablate.data.loader import ShardSampler, build_loader
from deit_ablate.data.transforms import TransformSpec, build_eval_transform
from deit_ablate.train.teacher import teacher_forward


class WithIndex(Dataset):
    """`dataset` whose target is `[label, index]`: the image's index travels with its label to the loss."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, label = self.dataset[index]
        return image, torch.tensor([label, index])


@dataclass(frozen=True)
class FixedView:
    """What the fixed teacher's table is computed from: the stage's transform pieces and how the run reads data."""

    spec: TransformSpec
    runtime: RuntimeConfig


def fixed_view_transform(spec: TransformSpec):
    """The teacher's fixed view: the evaluation transform at the training size (resize to train_size / crop_pct,
    centre-crop train_size, normalize)."""
    return build_eval_transform(spec, size=spec.resolution.train_size)


def fixed_view_dataset(view: FixedView) -> Dataset:
    """The training images, each in its fixed view (same files and order as the training set)."""
    data = view.spec.data
    return training_split(data, fixed_view_transform(view.spec), dataset_root(data),
                          on_bad_image=view.runtime.on_bad_image)


def teacher_table(teacher: nn.Module, dataset: Dataset, batch_size: int, runtime: RuntimeConfig, num_classes: int,
                  info: DistInfo) -> torch.Tensor:
    """The teacher's float32 logits of every image of `dataset`, row i for image i, on `info.device`."""
    sampler = ShardSampler(len(dataset), info.world_size, info.rank)
    table = None
    done = 0
    for images, _ in build_loader(dataset, sampler, batch_size, runtime, train=False):
        logits = teacher_forward(teacher, images.to(info.device, non_blocking=True))
        if table is None:
            table = torch.zeros(len(dataset), logits.shape[1], device=info.device)
        rows = torch.tensor(sampler.indices[done:done + len(logits)], device=info.device)
        table[rows] = logits
        done += len(logits)
    if table is None:  # a rank with no image (more ranks than images) still joins the sum
        table = torch.zeros(len(dataset), num_classes, device=info.device)
    return all_reduce_sum(table, info)  # each row was filled on exactly one rank


def build_fixed_teacher_table(teacher: nn.Module, view: FixedView, info: DistInfo) -> torch.Tensor:
    """The run's cached fixed-view teacher outputs, computed now (logged with their size and time)."""
    start = time.perf_counter()
    table = teacher_table(teacher, fixed_view_dataset(view), view.runtime.eval_batch, view.runtime,
                          view.spec.data.num_classes, info)
    if info.is_main:
        log.info(f"[run] fixed teacher (Beyer et al. 2022): outputs of {table.shape[0]} training images on their "
                 f"centre crop cached in {time.perf_counter() - start:.1f} s "
                 f"({table.numel() * 4 / 2**20:.1f} MiB on {table.device})")
    return table
