"""A run's lineage: the few settings that name the runs it starts from, taken from its config once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from deit_ablate.config.schema import DistillKind, Stage
from deit_ablate.record.identity import task_overrides


@dataclass(frozen=True)
class Lineage:
    """What names the runs a run starts from (its pre-training, a transfer's source, its chained teacher run, the
    LayerScale run whose diagonal it fixes): its stage, the overrides it was launched with, its output root and the
    keys that point at another run."""

    stage: Stage
    overrides: tuple[str, ...]
    output_root: str
    finetune_init: str | None = None  # finetune.init_checkpoint: a fine-tune from a file, not from a run
    transfer_init: str | None = None  # transfer.init_checkpoint
    transfer_source_stage: str = "finetune"
    layer_scale_from: str | None = None  # model.kwargs.layer_scale_from: a cait row
    teacher_chain: str | None = None  # distill.teacher.chain: a model option trained first as the teacher
    teacher_kwargs: dict[str, Any] = field(default_factory=dict)  # distill.teacher.kwargs, resolved
    distills: bool = False  # a distillation kind is set (distill.type != none)

    @classmethod
    def of(cls, cfg: DictConfig, overrides: Sequence[str] | None = None) -> Lineage:
        """The lineage of the run `cfg` describes, launched with `overrides` (the running Hydra job's if None)."""
        kwargs = cfg.distill.teacher.kwargs  # an interpolation (a row's ${at_scale:...}) resolves to a plain dict
        kwargs = OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs)
        return cls(
            stage=Stage(str(cfg.stage)),
            overrides=tuple(task_overrides() if overrides is None else overrides),
            output_root=str(cfg.runtime.output_root),
            finetune_init=cfg.finetune.init_checkpoint or None,
            transfer_init=cfg.transfer.init_checkpoint or None,
            transfer_source_stage=str(cfg.transfer.source_stage),
            layer_scale_from=cfg.model.kwargs.get("layer_scale_from"),
            teacher_chain=cfg.distill.teacher.get("chain"),
            teacher_kwargs=kwargs,
            distills=cfg.distill.type != DistillKind.none,
        )

    @property
    def init_checkpoint(self) -> str | None:
        """The checkpoint a later stage starts from instead of a run (its block's init_checkpoint)."""
        return self.transfer_init if self.stage == Stage.transfer else self.finetune_init
