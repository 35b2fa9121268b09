"""The network a stage trains, built in one place: the stage's model block (stage_config), the run's model name
(the distilled twin where a distillation token trains), the data's classes, at the stage's training size."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig
from torch import nn

from deit_ablate.config.schema import DistillConfig, ModelConfig
from deit_ablate.config.stage_config import stage_config
from deit_ablate.train.models import build_model, student_name


@dataclass(frozen=True)
class StudentSpec:
    """What builds a stage's student: its model block, timm name, classes and training size."""

    model: ModelConfig
    name: str
    num_classes: int
    img_size: int


def student_model_name(model: ModelConfig, distill: DistillConfig) -> str:
    """The timm model a run trains (train.models.student_name of its model and distillation blocks)."""
    return student_name(model.name, model.distilled_name, distill.type)


def student_spec(cfg: DictConfig) -> StudentSpec:
    """The student of the stage `cfg` runs (its stage's config: stage_config)."""
    applied = stage_config(cfg)
    return StudentSpec(applied.model, student_model_name(applied.model, applied.distill), applied.data.num_classes,
                       applied.resolution.train_size)


def build_stage_model(spec: StudentSpec, img_size: int | None = None) -> nn.Module:
    """The student `spec` describes, freshly initialised (at `img_size`, else its training size); under
    `torch.device("meta")` the architecture alone."""
    return build_model(spec.model, spec.num_classes, img_size or spec.img_size, name=spec.name)
