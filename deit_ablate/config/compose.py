"""The schema in Hydra: registered as conf/config.yaml's base, and a run's config composed outside `train.py`."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from deit_ablate.config.schema import Config
from deit_ablate.config.studies import CONF_DIR, defaults_list


def compose_run_config(overrides: list[str]) -> DictConfig:
    """The config `python train.py <overrides>` runs (inside a Hydra app, through its own config search path), with
    Hydra's node: its `hydra.runtime.choices` name the study rows, which a run's identity needs."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore as `deit_schema`, the base of conf/config.yaml, and the studies' groups
    with their default rows as `studies` (conf/config.yaml's defaults take it; see deit_ablate/config/studies.py)."""
    store = ConfigStore.instance()
    store.store(name="deit_schema", node=Config)
    store.store(name="studies", node={"defaults": defaults_list()})
