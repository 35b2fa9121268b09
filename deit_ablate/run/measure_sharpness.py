"""A run's sharpness (train/sharpness.py measures it): its fixed training images, its model rebuilt at the
recorded weights, the figures; for `sharpness.at_end` and `python -m deit_ablate.sharpness`."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, Subset

from deit_ablate.data.datasets import dataset_root, training_split
from deit_ablate.data.loader import num_workers
from deit_ablate.data.transforms import TransformSpec, build_eval_transform
from deit_ablate.run.student import StudentSpec, build_stage_model, student_spec
from deit_ablate.train.sharpness import Batches, SharpnessSettings, measure


def fixed_images(spec: TransformSpec, on_bad_image: str, settings: SharpnessSettings, device: torch.device,
                 workers: int = 0) -> Batches:
    """The images every figure is measured on: the first `settings.images` of a permutation of the training split
    drawn from `settings.seed`, through the eval transform, in batches of `settings.batch_size` on `device`."""

    dataset = training_split(spec.data, build_eval_transform(spec), dataset_root(spec.data),  # as the run trained
                             on_bad_image=on_bad_image)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(settings.seed))
    chosen = Subset(dataset, order[: min(settings.images, len(dataset))].tolist())
    loader = DataLoader(chosen, batch_size=settings.batch_size, shuffle=False, num_workers=workers)
    return [(images.to(device), labels.to(device)) for images, labels in loader]


def rebuild_model(student: StudentSpec, weights: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A fresh eager float32 copy of the run's model (`student.build_stage_model`) holding `weights`, on `device`."""
    model = build_stage_model(student)
    model.load_state_dict(weights)
    return model.to(device=device, dtype=torch.float32)


def measure_weights(cfg: DictConfig, weights: dict[str, torch.Tensor], device: torch.device,
                    settings: SharpnessSettings | None = None, show_progress: bool = True) -> dict[str, Any]:
    """The figures of the run `cfg` describes at `weights`, on its fixed images (settings: `cfg.sharpness`)."""
    settings = settings or SharpnessSettings.from_config(cfg.sharpness)

    model = rebuild_model(student_spec(cfg), weights, device)
    spec = TransformSpec(cfg.data, cfg.augment, cfg.resolution)
    batches = fixed_images(spec, cfg.runtime.on_bad_image, settings, device, num_workers(cfg.runtime.num_workers))
    return measure(model, batches, settings, show_progress)
