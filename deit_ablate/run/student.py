"""The network a stage trains, built in one place: the stage's model block (stage_config), the run's model name
(the distilled twin where a distillation token trains), the data's classes, at the stage's training size."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from deit_ablate.config.stage_config import stage_config
from deit_ablate.train.models import build_model, student_name


def student_model_name(cfg: DictConfig) -> str:
    """The timm model this run trains (train.models.student_name of its model and distillation blocks)."""
    return student_name(cfg.model.name, cfg.model.distilled_name, cfg.distill.type)


def build_stage_model(cfg: DictConfig, img_size: int | None = None) -> nn.Module:
    """The student this stage trains, freshly initialised (at `img_size`, else the stage's training size); under
    `torch.device("meta")` the architecture alone."""
    cfg = stage_config(cfg)
    return build_model(cfg.model, cfg.data.num_classes, img_size or cfg.resolution.train_size,
                       name=student_model_name(cfg))
