"""Resolve once, then run: a launch turns its composed config into a frozen `RunPlan` before it writes anything.

Everything a run needs to know about itself is settled here, once, and on rank 0 only where it reads files (the
data's fingerprint, the teacher's weights): its identity (with the data and the teacher), its folder, the batch
split, the stage's recipe, the run it starts from, the teacher it loads and the LayerScale run it takes a diagonal
from. The modules that execute the run take the plan's typed pieces; none of them resolves the config again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from deit_ablate.config.schema import Stage
from deit_ablate.config.stage_config import stage_config
from deit_ablate.core.distributed import DistInfo, agree
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.datasets import data_fingerprint, describe_data
from deit_ablate.data.transforms import TransformSpec
from deit_ablate.record.identity import (
    RunIdentity,
    composed_choices,
    current_run_dir,
    task_choices,
    task_overrides,
    with_data,
)
from deit_ablate.record.resolvers import folder_identity
from deit_ablate.record.rundir import RunDir
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.stages import (
    StageRecipe,
    check_layer_scale_run,
    layer_scale_run_dir,
    stage_distils,
    stage_recipe,
    teacher_run_dir,
    upstream_run_dir,
)
from deit_ablate.run.student import StudentSpec, student_spec
from deit_ablate.run.teacher import TeacherSource, run_teacher, with_run_teacher
from deit_ablate.run.transfer import with_transfer_source
from deit_ablate.run.validate import BatchPlan, plan_batch


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved: what it is (identity, data), where it lives (its folder) and how it trains."""

    settings: DictConfig  # the config the stage runs (stage_config.py), checked against the schema, read-only
    declared: DictConfig  # the composed config, which names the run (its identity) and is what wandb logs
    lineage: Lineage  # the launch's overrides and the keys that name the runs it starts from
    identity: RunIdentity  # folder name, wandb id and group, experiment digest, teacher weights
    run_dir: RunDir
    data: dict[str, Any]  # the data's fingerprint (data/fingerprint.py)
    batch: BatchPlan
    recipe: StageRecipe
    student: StudentSpec  # the network the stage trains (its timm name: the distilled twin under a token kind)
    upstream: RunDir | None  # the run this stage starts from: a fine-tune's pre-training, a transfer's source
    teacher_run: RunDir | None  # the teacher run a chained student distils from (distill.teacher.chain)
    teacher: TeacherSource | None  # the teacher to load (None: no distillation, or a dry run awaiting its teacher)
    layer_scale_source: RunDir | None  # the LayerScale run whose learned diagonal this run fixes (CaiT appendix A)

    @property
    def overrides(self) -> tuple[str, ...]:
        """The launch's task overrides, which name the run and the runs it starts from."""
        return self.lineage.overrides

    @property
    def transforms(self) -> TransformSpec:
        """What the stage's image transforms read: its data, augment and resolution blocks."""
        return TransformSpec(self.settings.data, self.settings.augment, self.settings.resolution)

    @property
    def model_name(self) -> str:
        return self.student.name

    @property
    def is_finetune(self) -> bool:
        return self.settings.stage == Stage.finetune

    @property
    def is_transfer(self) -> bool:
        return self.settings.stage == Stage.transfer


def data_identity(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    """The data's fingerprint, checked against the one the run folder recorded: another dataset under the same
    settings is refused, never resumed or skipped with the other data's result."""
    current = data_fingerprint(cfg.data)
    recorded = run_dir.recorded_data()
    if recorded is not None and recorded.get("digest") != current.get("digest"):
        raise ConfigError(
            f"{run_dir.path} holds this experiment trained on other data ({describe_data(recorded)}), but "
            f"data.root={cfg.data.root} now holds {describe_data(current)}. The data is part of a run's identity: "
            f"train this data under another output folder (runtime.output_root=...), or delete {run_dir.path} "
            "to train it here.")
    return current


def pending_id(lineage: Lineage, identity: RunIdentity, teacher: TeacherSource | None,
               upstream: RunDir | None) -> str | None:
    """What the wandb id of a dry run's `identity` still waits for (None: it is the id the run will have): the
    weights of a chained teacher run not trained yet, or a transfer's source run not started yet."""
    if stage_distils(lineage) and teacher is None:
        return "its teacher run's weights digest"
    source_unstarted = upstream is not None and identity.source is None and not upstream.result.exists()
    if lineage.stage == Stage.transfer and source_unstarted:
        return "its source run's data and teacher weights"
    return None


def make_plan(cfg: DictConfig, info: DistInfo, run_dir: RunDir | None = None,
              overrides: list[str] | None = None) -> RunPlan:
    """The plan of the run `cfg` describes (the running Hydra job's folder and overrides unless given); a problem
    is a ConfigError, raised the same on every rank. The config was checked before Hydra made the
    run's folder (preflight.py, the sweeper), once per launch; this checks what only the run sees: the data there,
    the teacher's weights, the world size's split of the batch."""
    declared = cfg
    OmegaConf.set_readonly(declared, True)
    cfg = stage_config(declared)  # composed once: every piece below reads the stage's config
    run_dir = run_dir or RunDir(current_run_dir())
    overrides = task_overrides() if overrides is None else overrides
    choices = composed_choices(cfg) if "hydra" in cfg else task_choices()
    named = folder_identity(declared, run_dir.name, overrides, choices)  # the folder Hydra made, or found
    data = agree(info, lambda: data_identity(cfg, run_dir))  # one scan of the data, not one per rank
    lineage = Lineage.of(cfg, overrides)
    teacher_run = teacher_run_dir(lineage)  # composes the chained teacher run's config: once
    teacher = agree(info, lambda: run_teacher(lineage, cfg.distill.teacher, teacher_run, cfg.runtime.dry_run))
    upstream = upstream_run_dir(lineage)
    source = upstream if cfg.stage == Stage.transfer else None
    # the teacher's weights and a transfer's source, refused when they are not those the run folder records
    identity = agree(info, lambda: with_transfer_source(with_run_teacher(with_data(named, data), teacher, run_dir),
                                                        source, run_dir))
    identity = replace(identity, pending=pending_id(lineage, identity, teacher, upstream))
    layer_scale = layer_scale_run_dir(lineage)
    if layer_scale is not None and not cfg.runtime.dry_run:  # the dry run says it waits for it (launch_plan)
        check_layer_scale_run(lineage, layer_scale, data.get("digest"))
    return RunPlan(settings=cfg, declared=declared, lineage=lineage, identity=identity, run_dir=run_dir,
                   data=data,
                   batch=plan_batch(cfg, info.world_size), recipe=stage_recipe(cfg, upstream),
                   student=student_spec(cfg), upstream=upstream, teacher_run=teacher_run, teacher=teacher,
                   layer_scale_source=layer_scale)
