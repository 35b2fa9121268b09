"""The config resolvers Hydra's configs use: `${run_name:}`, the run's folder name (its identity), and
`${at_scale:PAPER,DEMO}`, how a study's row gives a number at both scales, `${at_stage:PRETRAIN,FINETUNE}`, how
a row gives a number for each stage, `${divide:A,B}`, a value derived from another (CaiT's transfer lr), and
`${released_batch:MODEL,GLOBAL}`, the per-GPU batch of the released command that trains MODEL (layout=released)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from deit_ablate.config.compose import compose_run_config
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.identity import RunIdentity, composed_choices, folder_name, run_identity
from deit_ablate.record.rundir import RunDir, runs_root

# GPUs of the released training command per model family (README of facebookresearch/deit): DeiT-B on 2 nodes x 8
# GPUs x 64, DeiT-S and DeiT-Ti on 4 GPUs x 256; a distilled twin trains as its family (the same commands with
# --distillation-type hard)
RELEASED_GPUS = {"deit_base": 16, "deit_small": 4, "deit_tiny": 4}

# folder name and overrides -> the identity the ${run_name:} resolver computed for it in this process
_named: dict[tuple[str, tuple[str, ...]], RunIdentity] = {}
# overrides -> the identity of the run they compose to, in this process (the conf/ files do not change under it)
_composed: dict[tuple[str, ...], RunIdentity] = {}


def folder_identity(cfg: DictConfig, folder: str, overrides: list[str], choices: Mapping[str, Any]) -> RunIdentity:
    """The identity of the run whose folder is `folder`: the one the resolver computed when Hydra named the folder
    (once per launch), else computed now."""
    identity = _named.get((folder, tuple(overrides))) or run_identity(cfg, overrides, choices)
    return replace(identity, name=folder)


def _run_name_resolver(*, _root_: DictConfig) -> str:
    hydra = "hydra" in _root_
    overrides = list(_root_.hydra.overrides.task) if hydra else []
    identity = run_identity(_root_, overrides, composed_choices(_root_) if hydra else {})
    name = folder_name(identity, runs_root(_root_.runtime.output_root))
    _named[(name, tuple(overrides))] = identity
    return name


def _at_scale_resolver(paper: Any, demo: Any, *, _root_: DictConfig) -> Any:
    return demo if _root_.get("preset") == "demo" else paper


def _at_stage_resolver(pretrain: Any, finetune: Any, *, _root_: DictConfig) -> Any:
    return pretrain if _root_.get("stage") == "pretrain" else finetune  # a transfer continues a fine-tuned model


def _divide_resolver(numerator: float, denominator: float) -> float:
    # 12 significant digits, so that 5e-4 / 10 reads 5e-05 in a printed config, not 4.9999999999999996e-05
    return float(f"{float(numerator) / float(denominator):.12g}")


def released_batch(model: str, global_batch: int) -> int:
    """The per-GPU batch of the released command that trains `model`: the global batch over its GPUs."""
    family = next((f for f in RELEASED_GPUS if str(model).startswith(f + "_")), None)
    if family is None:
        raise ConfigError(f"layout=released gives the per-GPU batch of the released DeiT commands (DeiT-Ti, -S, -B), "
                          f"and model.name={model} has none. Drop layout=released and set train.micro_batch.")
    gpus = RELEASED_GPUS[family]
    if int(global_batch) % gpus:
        raise ConfigError(f"layout=released shares train.global_batch={global_batch} over the {gpus} GPUs of "
                          f"{family}'s released command, which do not divide it. Set train.global_batch to a "
                          f"multiple of {gpus} (the released 1024), or drop layout=released.")
    return int(global_batch) // gpus


def run_dir_of(overrides: list[str], output_root: str | Path, cfg: DictConfig | None = None) -> RunDir:
    """The folder of the run `python train.py <overrides>` trains (its config `cfg`, when already composed), named
    as Hydra names it: how a run finds the run it starts from. Its identity is kept for this process, so finding the
    folder again composes nothing (composing is ~0.1-0.2 s; a sweep hands in the configs it composed)."""
    identity = _composed.get(tuple(overrides)) if cfg is None else None
    if identity is None:
        cfg = compose_run_config(overrides) if cfg is None else cfg
        identity = _composed[tuple(overrides)] = run_identity(cfg, overrides, composed_choices(cfg))
    return RunDir.under(output_root, folder_name(identity, runs_root(output_root)))


def register_resolvers() -> None:
    """Make `${run_name:}` (the run's folder name, from the whole config), `${at_scale:PAPER,DEMO}` (the first
    value, or the second under `preset=demo`: how a study's rows give a number at both scales),
    `${at_stage:PRETRAIN,FINETUNE}` (the second at every stage after pre-training), `${divide:A,B}` (A / B) and
    `${released_batch:MODEL,GLOBAL}` (released_batch) available."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", _run_name_resolver)
    if not OmegaConf.has_resolver("at_scale"):
        OmegaConf.register_new_resolver("at_scale", _at_scale_resolver)
    if not OmegaConf.has_resolver("at_stage"):  # a row's resolution per stage (conf/deit3/res_*.yaml)
        OmegaConf.register_new_resolver("at_stage", _at_stage_resolver)
    if not OmegaConf.has_resolver("divide"):  # CaiT's transfer lr (conf/transfer_recipe/cait.yaml)
        OmegaConf.register_new_resolver("divide", _divide_resolver)
    if not OmegaConf.has_resolver("released_batch"):  # conf/layout/released.yaml
        OmegaConf.register_new_resolver("released_batch", released_batch)
