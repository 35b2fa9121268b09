"""Checks that a run can start, made before any data is read, anything is written or any job is queued."""

from __future__ import annotations

import difflib
import functools
import math
import re

import timm
from omegaconf import DictConfig, ListConfig, OmegaConf
from timm.optim import list_optimizers

from deit_ablate.config.keys import CAIT_LR_DIVISOR
from deit_ablate.config.schema import (
    AugmentConfig,
    Config,
    Criterion,
    CropMode,
    DataBackend,
    DataConfig,
    DataName,
    DistillConfig,
    DistillKind,
    MixConfig,
    MixMode,
    Stage,
    TeacherView,
    TrackingConfig,
    TrackingMode,
    schema_ranges,
)
from deit_ablate.config.stage_config import STAGE_BLOCKS, check_stage_overrides, stage_changes, stage_config
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.dali import check_dali_config
from deit_ablate.data.datasets import check_cifar_data, check_data_root
from deit_ablate.record.rundir import check_output_root
from deit_ablate.record.tracking import check_tracking
from deit_ablate.run.architecture import check_stage_architecture, meta_weights
from deit_ablate.run.build_check import BUILT_GROUPS, check_build
from deit_ablate.run.sizes import check_image_sizes, check_mixer_size, check_pretrain_size, check_upstream_size
from deit_ablate.run.stages import layer_scale_row, stage_batch
from deit_ablate.run.student import StudentSpec, build_stage_model, student_spec
from deit_ablate.run.teacher import check_distill_config
from deit_ablate.run.transfer import check_transfer_config
from deit_ablate.train.batch_plan import BatchPlan

# wandb project and entity names: also folder names, so nothing that could leave the folder or need quoting.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# timm's auto-augment policy strings (timm.data.auto_augment): the keys each kind takes and their number form.
_INT, _FLOAT, _BIT = r"\d+", r"\d+(\.\d+)?", r"[01]"
AUGMENT_KEYS = {
    "rand": {"m": _INT, "n": _INT, "p": _FLOAT, "mstd": _FLOAT, "mmax": _INT, "inc": _BIT},
    "augmix": {"m": _INT, "w": _INT, "d": _INT, "a": _FLOAT, "b": _BIT, "mstd": _FLOAT},
    "autoaugment": {"mstd": _FLOAT},
}
AUTOAUGMENT_POLICIES = ("original", "originalr", "v0", "v0r", "3a")
RAND_TRANSFORM_SETS = ("weights", "3aw", "3a")
AUGMENT_FORMS = ("rand-m<magnitude>[-n<ops>][-p<prob>][-mstd<std>][-mmax<max>][-inc<0|1>][-t<weights|3aw|3a>] "
                 "(DeiT: rand-m9-mstd0.5-inc1), one of " + "|".join(AUTOAUGMENT_POLICIES) + " with an optional "
                 "-mstd<std> (AutoAugment), augmix[-m<m>][-w<w>][-d<d>][-a<a>][-b<0|1>][-mstd<std>], or null (off)")

def per_batch_computations(cfg: DictConfig) -> list[str]:
    """What this stage computes per micro-batch (so splitting one over passes would change it): Mixup/CutMix,
    SAM, drop path or dropout in train mode, BatchNorm."""
    cfg = stage_config(cfg)
    found = []
    if cfg.mix.mixup_alpha > 0 or cfg.mix.cutmix_alpha > 0:
        found.append("Mixup/CutMix draws one lambda and box per micro-batch")
    if cfg.stage == Stage.pretrain and cfg.optimizer.sam_rho > 0:
        found.append("SAM perturbs each micro-batch by its own gradient (m-sharpness)")
    train_mode = cfg.finetune.train_mode if cfg.stage == Stage.finetune else True
    if train_mode and (cfg.model.drop_path > 0 or cfg.model.dropout > 0):
        found.append("drop path and dropout draw their masks per micro-batch")
    if train_mode and has_batch_norm(student_spec(cfg)):
        found.append("BatchNorm normalises over the micro-batch")
    return found


def has_batch_norm(student: StudentSpec) -> bool:
    """Whether the stage's student has BatchNorm layers (built on the meta device: no memory, no weights)."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    with torch.device("meta"):
        model = build_stage_model(student)
    return any(isinstance(module, _BatchNorm) for module in model.modules())


def micro_batch_split(cfg: DictConfig) -> tuple[int, int]:
    """The stage's micro-batch and the passes each needs on one device (runtime.max_batch_per_device), checked
    without the world size: before anything is written or queued."""
    batch = stage_batch(cfg)
    global_batch, global_key = batch.global_batch, batch.global_key
    micro, micro_key = batch.micro_batch, batch.micro_key
    cap = cfg.runtime.max_batch_per_device
    if global_batch <= 0 or micro <= 0 or cap <= 0:
        raise ConfigError(f"{global_key}={global_batch}, {micro_key}={micro} and runtime.max_batch_per_device={cap} "
                          "must be positive.")
    if global_batch % micro:
        fits = [m for m in range(min(micro, global_batch), 0, -1) if global_batch % m == 0][0]
        raise ConfigError(f"{global_key}={global_batch} is not a whole number of micro-batches of {micro_key}={micro}"
                          f": the global batch is micro-batches (virtual GPUs) of the recipe's size. Set {micro_key} "
                          f"to a divisor of {global_batch} (e.g. {fits}) or the global batch to a multiple of {micro}.")
    mixing = cfg.mix.mixup_alpha > 0 or cfg.mix.cutmix_alpha > 0
    if mixing and cfg.mix.mode == MixMode.batch and micro % 2:
        raise ConfigError(f"Mixup/CutMix pairs the images of a micro-batch, so {micro_key}={micro} must be even; "
                          f"use {micro_key}={micro + 1 if global_batch % (micro + 1) == 0 else 2 * micro}.")
    if micro <= cap:
        return micro, 1
    found = per_batch_computations(cfg)
    if found:
        raise ConfigError(f"runtime.max_batch_per_device={cap} cannot hold one micro-batch of {micro_key}={micro}, "
                          f"and splitting it would change the experiment ({'; '.join(found)}). Raise "
                          f"runtime.max_batch_per_device to {micro} (e.g. with train.amp=bf16 or a larger device), or "
                          f"choose a smaller {micro_key}, which is another experiment.")
    split = -(-micro // cap)
    while micro % split:
        split += 1
    return micro, split


def plan_batch(cfg: DictConfig, world_size: int) -> BatchPlan:
    """Deal this stage's virtual slots to `world_size` processes: each runs slots / world_size of them per step."""
    batch = stage_batch(cfg)
    global_batch, global_key, micro_key = batch.global_batch, batch.global_key, batch.micro_key
    micro, split = micro_batch_split(cfg)
    slots = global_batch // micro
    if slots % world_size:
        fits = [w for w in range(min(world_size, slots), 0, -1) if slots % w == 0][0]
        raise ConfigError(
            f"{global_key}={global_batch} is {slots} micro-batches of {micro_key}={micro}, which cannot be dealt "
            f"equally over {world_size} processes. The micro-batches are the recipe's (virtual GPUs), so each "
            f"process must take an equal number: run {fits} process(es) (or another divisor of {slots}), or change "
            f"{global_key}, which is another experiment.")
    return BatchPlan(world_size, micro, slots, slots // world_size, split)


def check_ranges(cfg: DictConfig, keys: tuple[str, ...] | None = None) -> None:
    """Every numeric key of the schema (or of `keys`) within the range its field declares (config.ranged), each item
    of a list key too; null, where the schema allows it, is not checked."""
    for key, bounds in schema_ranges():
        value = None if keys is not None and key not in keys else OmegaConf.select(cfg, key)
        if value is None:
            continue
        listed = isinstance(value, ListConfig | list | tuple)
        items = list(value) if listed else [value]
        bad = next((item for item in items if not bounds.holds(item)), None)
        if bad is None:
            continue
        shown = f"[{', '.join(map(str, items))}]" if listed else str(value)
        finite = "" if math.isfinite(bad) else "a finite number "
        each = f" each ({bad} is not)" if listed else ""
        hint = f": {bounds.hint}" if bounds.hint else ""
        raise ConfigError(f"{key}={shown} must be {finite}{bounds}{each}{hint}.")


def check_names(tracking: TrackingConfig) -> None:
    """runtime.tracking.project and runtime.tracking.entity: names wandb and the file system take as they are."""
    for name in ("project", "entity"):
        key, value = f"runtime.tracking.{name}", tracking[name]
        if value is not None and (not SAFE_NAME.fullmatch(str(value)) or ".." in str(value)):
            raise ConfigError(f"{key}={value} is not a safe name: use letters, digits, '.', '_' and '-' "
                              "(at most 128, starting with a letter or digit), e.g. deit-ablate.")


def _augment_problem(policy: str) -> str | None:
    """What is wrong with an auto-augment policy string by timm's grammar, or None."""
    kind, *sections = policy.split("-")
    if kind not in ("rand", "augmix") and kind not in AUTOAUGMENT_POLICIES:
        return f"'{kind}' is not a policy kind"
    keys = AUGMENT_KEYS.get(kind, AUGMENT_KEYS["autoaugment"])
    for section in sections:
        if kind == "rand" and section.startswith("t"):
            if section[1:] not in RAND_TRANSFORM_SETS:
                return f"section '{section}' names no transform set ({', '.join(RAND_TRANSFORM_SETS)})"
            continue
        match = re.fullmatch(r"([a-z]+)(.*)", section)
        if match is None or match[1] not in keys:
            return f"section '{section}' is not one of {', '.join(keys)} followed by a number"
        if not re.fullmatch(keys[match[1]], match[2]):
            return f"section '{section}' has no valid value for '{match[1]}'"
    return None


def check_auto_augment(policy: str | None) -> None:
    """augment.auto_augment follows timm's grammar: timm skips sections it cannot parse without a word."""
    problem = _augment_problem(policy) if policy else None
    if problem:
        raise ConfigError(f"augment.auto_augment={policy} is not a policy timm reads: {problem}. "
                          f"Expected {AUGMENT_FORMS}.")


# Free-form nodes: extra timm arguments, passed through as given; a stage's override set (checked against the
# whole config: stage_config.check_stage_overrides).
FREE_FORM = ("model.kwargs", "distill.teacher.kwargs", "finetune.overrides", "transfer.overrides")


@functools.cache
def _schema() -> DictConfig:
    """The schema as a config, built once (about 0.1 s a build)."""
    return OmegaConf.structured(Config)


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not have (Hydra's `+key=value` adds them to a typed node without a word)."""
    pending = [(cfg, _schema(), "")]  # (node, the schema's node there, its dotted prefix)
    while pending:
        node, reference, prefix = pending.pop()
        for key in node:
            if not prefix and key == "hydra":  # Hydra's own node, present where the launcher composes a run
                continue
            dotted = f"{prefix}{key}"
            if key not in reference:
                close = difflib.get_close_matches(str(key), [str(k) for k in reference], n=3)
                hint = f" Did you mean {', '.join(prefix + c for c in close)}?" if close else ""
                raise ConfigError(f"{dotted} is not a setting of this project (it was added with '+').{hint} "
                                  f"The keys of {prefix.rstrip('.') or 'the config'} are listed by "
                                  "`python train.py --cfg job`.")
            if dotted not in FREE_FORM and isinstance(node[key], DictConfig) and isinstance(reference[key], DictConfig):
                pending.append((node[key], reference[key], dotted + "."))


def check_model_options(student: StudentSpec) -> None:
    """The options of deit_ablate.train.deeper, the register tokens in model.kwargs and model.head: known values, on a
    model that takes them."""
    from deit_ablate.train.deeper import split_options
    from deit_ablate.train.models import check_head, check_register_tokens, model_family

    check_head(student.model.head, student.name)
    kwargs = dict(OmegaConf.to_container(student.model.kwargs, resolve=True))
    check_register_tokens(student.name, kwargs)
    split_options(kwargs, model_family(student.name))
    layer_scale_row(student.model.kwargs.get("layer_scale_from"))


def check_three_augment_and_crop(aug: AugmentConfig, data: DataConfig) -> None:
    """augment.three_augment and augment.crop=simple (DeiT III): built on the pil backend's crop and policy only."""
    options = [name for name, on in (("augment.three_augment=true", aug.three_augment),
                                     ("augment.crop=simple", aug.crop == CropMode.simple)) if on]
    if not options:
        return
    if data.backend == DataBackend.dali:
        raise ConfigError(f"data.backend=dali: {' and '.join(options)} (DeiT III) is built for the pil backend only; "
                          "set data.backend=pil.")
    if aug.no_aug:
        raise ConfigError(f"augment.no_aug=true (resize and center crop only) turns off {' and '.join(options)}; "
                          "set augment.no_aug=false.")
    if aug.three_augment and aug.auto_augment:
        raise ConfigError(f"augment.three_augment=true replaces the auto-augment policy (augment.auto_augment="
                          f"{aug.auto_augment}); set augment.auto_augment=null, or use augment=three_augment.")
    if aug.crop == CropMode.simple and data.fast_jpeg:
        raise ConfigError("data.fast_jpeg speeds up the random-resized crop, which augment.crop=simple replaces. "
                          "Set data.fast_jpeg=false.")
    if aug.crop == CropMode.simple and aug.interpolation == "random":
        raise ConfigError("augment.crop=simple resizes with one filter; set augment.interpolation to bicubic "
                          "(DeiT III's), bilinear or nearest.")


def check_criterion(mix: MixConfig) -> None:
    """mix.criterion=bce: DeiT III's thresholded targets leave no room for label smoothing."""
    if mix.criterion == Criterion.bce and mix.label_smoothing > 0:
        raise ConfigError(f"mix.criterion=bce with mix.label_smoothing={mix.label_smoothing}: binary cross-entropy "
                          "makes every class above 0 in the mixed target a positive (DeiT III), so every smoothed "
                          "class would be one; set mix.label_smoothing=0, as DeiT III does with BCE.")


def check_layer_decay(zeta: float | None, student: StudentSpec) -> None:
    """finetune.layer_decay (a ratio in (0, 1]: check_ranges) on a model whose layers are `blocks` (a ViT)."""
    import torch

    if zeta is None:
        return
    name = student.name
    with torch.device("meta"):  # the architecture only
        model = build_stage_model(student)
    if not hasattr(model, "blocks"):
        raise ConfigError(f"finetune.layer_decay={zeta} decays the lr over a ViT's `blocks`, which {name} has not; "
                          "unset it (finetune.layer_decay=null) or fine-tune a ViT.")


def check_teacher_view(distill: DistillConfig, mix: MixConfig, data: DataConfig) -> None:
    """distill.teacher_view=fixed (Beyer et al. 2022's fixed teacher): a teacher, unmixed batches, the PIL loader."""
    if distill.teacher_view != TeacherView.fixed:
        return
    if distill.type == DistillKind.none:
        raise ConfigError("distill.teacher_view=fixed says what a teacher sees, but distill=none has no teacher: pick "
                          "a distillation kind (e.g. distill=soft) or drop distill.teacher_view.")
    if mix.mixup_alpha > 0 or mix.cutmix_alpha > 0:
        raise ConfigError("distill.teacher_view=fixed distils towards cached outputs of each unmixed image, which "
                          "a Mixup/CutMix image has none of (Beyer et al.'s fixed teacher trains without mixing): add "
                          "mix=none, or keep teacher_view=same (with mix=function_matching: function matching).")
    if data.backend == DataBackend.dali:
        raise ConfigError("distill.teacher_view=fixed needs each image's index, which the DALI loader does not hand "
                          "through: use data.backend=pil (the default) for a fixed teacher.")


def validate_config(cfg: DictConfig, world_size: int | None = None) -> None:
    """Raise ConfigError, naming the key and the fix, for anything that would fail later in the run: the config
    the run's stage runs (stage_config.py), every stage's override set checked."""
    check_ranges(cfg, (CAIT_LR_DIVISOR,))  # CaiT's rule divides by it wherever transfer.lr is read, from here on
    check_known_keys(cfg)
    check_stage_overrides(cfg)
    declared, cfg = cfg, stage_config(cfg)
    check_ranges(cfg)
    check_names(cfg.runtime.tracking)
    if cfg.train.eval_max_batches is not None:
        raise ConfigError(f"train.eval_max_batches={cfg.train.eval_max_batches} counted batches of runtime.eval_batch "
                          "on each rank, so the images scored changed with the layout. Set "
                          "train.eval_max_images=N instead (the first N images of the eval split, on any layout).")
    check_criterion(cfg.mix)
    check_auto_augment(cfg.augment.auto_augment)
    check_three_augment_and_crop(cfg.augment, cfg.data)
    if cfg.data.fast_jpeg and cfg.augment.no_aug:
        raise ConfigError("data.fast_jpeg speeds up the random-resized crop, which augment.no_aug=true turns off. "
                          "Set data.fast_jpeg=false.")
    if cfg.data.backend == DataBackend.dali:
        check_dali_config(cfg.data, cfg.augment)
    for name in {cfg.model.name, cfg.model.distilled_name or cfg.model.name,
                 cfg.distill.teacher.model if cfg.distill.type != DistillKind.none else cfg.model.name}:
        if not timm.is_model(name):
            close = timm.list_models(f"*{name.split('_')[0]}*")[:8]
            raise ConfigError(f"timm has no model named '{name}'. Close names: {', '.join(close) or 'none'}. "
                              "Pick a `model=` option (see conf/model/) or a timm model name in model.name.")
    student = student_spec(cfg)
    check_model_options(student)
    meta_weights(student)  # timm builds it from model.kwargs
    check_image_sizes(student, cfg.resolution)
    check_layer_decay(cfg.finetune.layer_decay, student)
    check_pretrain_size(cfg.stage, cfg.finetune.pretrain_size, cfg.resolution.train_size)
    check_upstream_size(declared.finetune, declared.stage,
                        list(declared.hydra.overrides.task) if "hydra" in declared else None)
    check_mixer_size(student, cfg.stage, cfg.finetune.pretrain_size)
    for stage, block in STAGE_BLOCKS.items():  # a later stage loads its upstream's weights: the same network
        if (str(declared.stage) == stage or declared[block].overrides) and not declared[block].init_checkpoint:
            upstream, staged = (OmegaConf.merge(declared, {"stage": name}) for name in (Stage.pretrain, stage))
            check_stage_architecture(block, stage, student_spec(upstream), student_spec(staged),
                                     stage_changes(upstream, stage_config(staged)))
    optimizers = {cfg.optimizer.name, cfg.finetune.optimizer, cfg.transfer.optimizer}
    for name in optimizers:
        if name not in list_optimizers():
            raise ConfigError(f"optimizer '{name}' is not a timm optimizer; use optimizer=adamw, sgd or lamb.")
    if cfg.data.name != DataName.builtin:
        check_data_root(cfg.data)
        check_cifar_data(cfg.data)
    check_teacher_view(cfg.distill, cfg.mix, cfg.data)
    row = OmegaConf.select(cfg, "hydra.runtime.choices.transfer", default=None)
    check_transfer_config(cfg.stage, cfg.transfer, cfg.data, cfg.distill, row)
    check_distill_config(cfg)
    micro_batch_split(cfg)
    if world_size is not None:
        plan_batch(cfg, world_size)


def validate_launch(cfg: DictConfig, world_size: int | None = None) -> None:
    """validate_config, then what this machine must offer before anything is written: output folders it can write
    and, for online tracking, a wandb key and a server that answers (train.py, the sweeper and the SLURM launcher
    call it before Hydra makes a folder or anything is queued); the stage's pipeline built once (build_check.py)."""
    validate_config(cfg, world_size)
    staged = stage_config(cfg)
    check_build(*(staged[group] for group in BUILT_GROUPS))
    check_output_root(cfg.runtime.output_root, tracking=cfg.runtime.tracking.mode != TrackingMode.disabled)
    check_tracking(cfg.runtime)
