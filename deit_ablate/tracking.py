"""wandb logging from rank 0: offline by default into <output_root>/wandb, one wandb run per training run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from deit_ablate.identity import RunIdentity

# Keys of the resolved config that never go to wandb (they could carry credentials or host details).
_PRIVATE_KEYS = ("runtime.tracking.entity",)


def loggable_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as a plain dict, without private keys."""
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for dotted in _PRIVATE_KEYS:
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return config


class Tracker:
    """A wandb run on rank 0 and a silent stand-in elsewhere."""

    def __init__(self, cfg: DictConfig, identity: RunIdentity, data: dict[str, Any], enabled: bool) -> None:
        self.run = None
        if not enabled or cfg.runtime.tracking.mode == "disabled":
            return
        import wandb

        wandb_dir = Path(cfg.runtime.output_root).resolve()
        wandb_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=cfg.runtime.tracking.project,
            entity=cfg.runtime.tracking.entity,
            dir=str(wandb_dir),
            mode=cfg.runtime.tracking.mode,
            id=identity.run_id,
            name=identity.name,
            group=identity.group,
            tags=[cfg.ablation, str(cfg.stage), cfg.preset],
            config={**loggable_config(cfg), "run_id": identity.run_id, "run_name": identity.name,
                    "experiment_digest": identity.digest, "data_fingerprint": data},
            resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log a row of metrics at optimizer step `step`."""
        if self.run is not None:
            self.run.log(metrics, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        """Set the run's summary values (the aggregator reads these)."""
        if self.run is not None:
            self.run.summary.update(values)

    def finish(self, exit_code: int = 0) -> None:
        """Close the run and flush its files."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
