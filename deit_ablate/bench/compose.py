"""The run config `python train.py <overrides>` would use, composed in-process with Hydra's compose API."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
TRAIN_PY = REPO / "train.py"

_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from deit_ablate.config.compose import register_configs
        from deit_ablate.record.resolvers import register_resolvers

        register_configs()
        register_resolvers()
        _registered = True


def compose_run(overrides: list[str]) -> DictConfig:
    """The composed config for these command-line overrides."""
    _register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def sweep_overrides() -> list[list[str]]:
    """The 26 runs of `python train.py -m 'ablation=glob(*)' stage=pretrain,finetune`."""
    rows = sorted(p.stem for p in (CONF / "ablation").glob("*.yaml"))
    return [[f"ablation={row}", f"stage={stage}"] for row in rows for stage in ("pretrain", "finetune")]
