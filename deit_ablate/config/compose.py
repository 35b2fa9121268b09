"""The schema in Hydra: registered as conf/config.yaml's base, and a run's config composed outside `train.py`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

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
        read_config_files_once(GlobalHydra.instance().config_loader())
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        read_config_files_once(GlobalHydra.instance().config_loader())
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


# (the search path's sources, a config file's path) -> Hydra's ConfigResult of that file and the file's stamp
_LOADED: dict[tuple[Any, ...], tuple[Any, tuple[int, int]]] = {}


def _file_stamp(result: Any, config_path: str) -> tuple[int, int] | None:
    """The modification time and size of the file a ConfigResult was read from; None for what is not a file (the
    schema and the studies node in Hydra's ConfigStore, which train.py may register again)."""
    if result is None or not result.path.startswith("file://"):
        return None
    name = config_path if config_path.endswith(".yaml") else f"{config_path}.yaml"
    try:
        stat = (Path(result.path.removeprefix("file://")) / name).stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


class ConfigFilesReadOnce:
    """A Hydra config repository that reads each config file once per process (again when it changes) and hands out
    copies. Hydra reads every file anew for each composition (its own cache lasts one), about half of composing a
    run; a sweep, its dry run and the status compose every run. Hydra changes what it loaded while composing, so each
    composition gets its own copy."""

    def __init__(self, delegate: Any, loaded: dict[tuple[Any, ...], Any] | None = None) -> None:
        self.delegate = delegate
        self.loaded = _LOADED if loaded is None else loaded

    def __deepcopy__(self, memo: dict[int, Any]) -> ConfigFilesReadOnce:
        return ConfigFilesReadOnce(copy.deepcopy(self.delegate, memo), self.loaded)  # as Hydra copies its repository

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its repository alone (a SLURM launcher pickles the sweep's loader into each job): a job reads
        the files itself."""
        return (ConfigFilesReadOnce, (self.delegate,))

    def __getattr__(self, name: str) -> Any:
        if name in ("delegate", "loaded"):  # not set yet (while unpickling): not the repository's
            raise AttributeError(name)
        return getattr(self.delegate, name)

    def load_config(self, config_path: str) -> Any:
        """The file `config_path` of the current search path, as Hydra's repository loads it (a copy of its own)."""
        key = (tuple(source.full_path() for source in self.delegate.get_sources()), config_path)
        kept = self.loaded.get(key)
        if kept is not None and kept[1] == _file_stamp(kept[0], config_path):
            return copy.deepcopy(kept[0])
        result = self.delegate.load_config(config_path=config_path)
        stamp = _file_stamp(result, config_path)
        if stamp is not None:
            self.loaded[key] = (copy.deepcopy(result), stamp)
        return result


def read_config_files_once(config_loader: Any) -> None:
    """Make Hydra's config loader (hydra-core 1.3's ConfigLoaderImpl) read each config file once per process; a
    loader without that attribute is left as it is."""
    repository = getattr(config_loader, "repository", None)
    if repository is not None and not isinstance(repository, ConfigFilesReadOnce):
        config_loader.repository = ConfigFilesReadOnce(repository)


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore as `deit_schema`, the base of conf/config.yaml, and the studies' groups
    with their default rows as `studies` (conf/config.yaml's defaults take it; see deit_ablate/config/studies.py)."""
    store = ConfigStore.instance()
    store.store(name="deit_schema", node=Config)
    store.store(name="studies", node={"defaults": defaults_list()})
