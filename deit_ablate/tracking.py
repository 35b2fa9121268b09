"""wandb logging from rank 0: offline by default into <output_root>/wandb, one wandb run per training run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# Keys of the resolved config that never go to wandb (they could carry credentials or host details).
_PRIVATE_KEYS = ("tracking.entity",)


def loggable_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as a plain dict, without private keys."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for dotted in _PRIVATE_KEYS:
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return config


class Tracker:
    """A wandb run on rank 0 and a silent stand-in elsewhere."""

    def __init__(self, cfg: DictConfig, run_id: str, run_name: str, group: str, enabled: bool) -> None:
        self.run = None
        if not enabled or cfg.tracking.mode == "disabled":
            return
        import wandb

        wandb_dir = Path(cfg.output_root).resolve()
        wandb_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=cfg.tracking.project,
            entity=cfg.tracking.entity,
            dir=str(wandb_dir),
            mode=cfg.tracking.mode,
            id=run_id,
            name=run_name,
            group=group,
            tags=[cfg.ablation, cfg.stage, cfg.preset],
            config={**loggable_config(cfg), "run_id": run_id, "run_name": run_name},
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
