"""A run's identity: its overrides decide its folder, its wandb run id and its group."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

_UNSAFE = re.compile(r"[^A-Za-z0-9=,._+-]+")
_MAX_NAME = 120
# Overrides that pick a stage of a run rather than the run: the fine-tune stage finds its pre-training by
# dropping them, and wandb groups seeds of one setting together by dropping the seed.
STAGE_KEYS = ("stage", "resolution")


@dataclass(frozen=True)
class RunIdentity:
    """Name (folder), wandb id and wandb group of a run."""

    name: str
    run_id: str
    group: str


# Overrides that restate a default and so do not change the run: `stage=pretrain` names the same run as none.
DEFAULT_ITEMS = ("stage=pretrain",)


def run_name_from_overrides(override_dirname: str) -> str:
    """A folder-safe, readable run name; `default` when the run has no overrides."""
    override_dirname = ",".join(item for item in _items(override_dirname) if item not in DEFAULT_ITEMS)
    if not override_dirname:
        return "default"
    name = _UNSAFE.sub("_", override_dirname)
    if len(name) > _MAX_NAME:
        name = f"{name[:_MAX_NAME - 9]}-{run_id_from_name(name)[:8]}"
    return name


def run_id_from_name(run_name: str) -> str:
    """The wandb run id of a run: a stable hash of its name, so a relaunch resumes the same wandb run."""
    return hashlib.sha1(run_name.encode()).hexdigest()[:16]


def _items(override_dirname: str) -> list[str]:
    return [item for item in override_dirname.split(",") if item] if override_dirname else []


def without_keys(override_dirname: str, keys: tuple[str, ...]) -> str:
    """The override string with the items of `keys` removed."""
    return ",".join(item for item in _items(override_dirname) if item.split("=", 1)[0].lstrip("+~") not in keys)


def identity_from_overrides(override_dirname: str) -> RunIdentity:
    """The identity of the run that Hydra launched with these (sorted, filtered) overrides."""
    name = run_name_from_overrides(override_dirname)
    group = run_name_from_overrides(without_keys(override_dirname, ("seed",)))
    return RunIdentity(name=name, run_id=run_id_from_name(name), group=group)


def current_override_dirname() -> str:
    """Hydra's override_dirname of the running job (empty outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.override_dirname if HydraConfig.initialized() else ""


def current_run_dir() -> Path:
    """The folder Hydra gave the running job (the current directory outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()


def identity_from_hydra() -> RunIdentity:
    """The identity of the current Hydra job."""
    return identity_from_overrides(current_override_dirname())


def pretrain_run_name(override_dirname: str) -> str:
    """The folder name of the pre-training run a fine-tune stage starts from."""
    return run_name_from_overrides(without_keys(override_dirname, STAGE_KEYS))


def register_resolvers() -> None:
    """Make `${run_name:...}` available to the Hydra configs."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name_from_overrides)
