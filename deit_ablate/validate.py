"""Checks that a run can start, made before any data is read or any job is queued."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import timm
from omegaconf import DictConfig, OmegaConf
from timm.optim import list_optimizers

from deit_ablate.config import Config
from deit_ablate.data.datasets import check_data_root
from deit_ablate.errors import ConfigError
from deit_ablate.stages import stage_global_batch
from deit_ablate.teacher import check_distill_config

PROBABILITIES = ("augment.reprob", "augment.hflip", "mix.prob", "mix.switch_prob", "mix.label_smoothing",
                 "model.drop_path", "model.dropout")


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch splits: per rank, then into accumulation steps of `micro_batch`."""

    world_size: int
    per_rank_batch: int
    accum_steps: int

    @property
    def micro_batch(self) -> int:
        return self.per_rank_batch // self.accum_steps


def _get(cfg: DictConfig, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node[key]
    return node


def plan_batch(cfg: DictConfig, world_size: int) -> BatchPlan:
    """Split this stage's global batch over `world_size` ranks, accumulating when a rank's share exceeds the cap."""
    global_batch, key = stage_global_batch(cfg)
    cap = cfg.runtime.max_batch_per_device
    if global_batch <= 0 or cap <= 0:
        raise ConfigError(f"{key}={global_batch} and runtime.max_batch_per_device={cap} must be positive.")
    if global_batch % world_size:
        raise ConfigError(
            f"{key}={global_batch} cannot be split over {world_size} processes. The global batch is "
            f"the recipe's quantity, so each process must take an equal share: choose a global batch that is a "
            f"multiple of {world_size} (e.g. {global_batch // world_size * world_size or world_size}) or change the "
            "number of processes."
        )
    per_rank = global_batch // world_size
    accum = -(-per_rank // cap)
    while per_rank % accum:
        accum += 1
    plan = BatchPlan(world_size, per_rank, accum)
    mixing = cfg.mix.mixup_alpha > 0 or cfg.mix.cutmix_alpha > 0
    if mixing and cfg.mix.mode == "batch" and per_rank % 2:
        raise ConfigError(f"Mixup/CutMix pairs images within a batch, so each process needs an even batch; "
                          f"{global_batch} over {world_size} processes gives {per_rank}. Use an even share.")
    return plan


# Free-form nodes: extra timm arguments, passed through as given.
FREE_FORM = ("model.kwargs", "distill.teacher.kwargs")


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not have (Hydra's `+key=value` adds them to a typed node without a word)."""
    schema = OmegaConf.structured(Config)

    def walk(node: DictConfig, reference: DictConfig, prefix: str) -> None:
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
                walk(node[key], reference[key], dotted + ".")

    walk(cfg, schema, "")


def validate_config(cfg: DictConfig, world_size: int | None = None) -> None:
    """Raise ConfigError, naming the key and the fix, for anything that would fail later in the run."""
    check_known_keys(cfg)
    for key in PROBABILITIES:
        value = _get(cfg, key)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{key}={value} must lie between 0 and 1.")
    if cfg.mix.mixup_alpha < 0 or cfg.mix.cutmix_alpha < 0:
        raise ConfigError("mix.mixup_alpha and mix.cutmix_alpha are Beta parameters and must be >= 0 "
                          "(0 turns one off).")
    if not 0 <= cfg.runtime.worker_nice <= 19:
        raise ConfigError(f"runtime.worker_nice={cfg.runtime.worker_nice} is outside 0-19: it is added to the loader "
                          "workers' niceness, and only root may raise a priority. Use 0 to leave it as it is.")
    if cfg.runtime.cpu_threads is not None and cfg.runtime.cpu_threads < 1:
        raise ConfigError(f"runtime.cpu_threads={cfg.runtime.cpu_threads} must be >= 1, or null for torch's default "
                          "(one thread per core).")
    if cfg.data.fast_jpeg and cfg.augment.no_aug:
        raise ConfigError("data.fast_jpeg speeds up the random-resized crop, which augment.no_aug=true turns off. "
                          "Set data.fast_jpeg=false.")
    if cfg.augment.repeated_aug < 1:
        raise ConfigError(f"augment.repeated_aug={cfg.augment.repeated_aug}: the number of copies must be >= 1 "
                          "(1 turns repeated augmentation off).")
    for name in {cfg.model.name, cfg.model.distilled_name or cfg.model.name,
                 cfg.distill.teacher.model if cfg.distill.type != "none" else cfg.model.name}:
        if not timm.is_model(name):
            close = timm.list_models(f"*{name.split('_')[0]}*")[:8]
            raise ConfigError(f"timm has no model named '{name}'. Close names: {', '.join(close) or 'none'}. "
                              "Pick a `model=` option (see conf/model/) or a timm model name in model.name.")
    optimizers = {cfg.optimizer.name, cfg.finetune.optimizer}
    for name in optimizers:
        if name not in list_optimizers():
            raise ConfigError(f"optimizer '{name}' is not a timm optimizer; use optimizer=adamw or optimizer=sgd.")
    if cfg.data.name != "builtin":
        check_data_root(cfg)
    check_distill_config(cfg)
    if world_size is not None:
        plan_batch(cfg, world_size)
