"""Hydra's basic sweeper, with every run of a sweep checked before anything is written, and dry runs planned here.

Hydra's own sweeper writes `runs/multirun.yaml` before it composes a single run, and its launcher makes each run's
folder (and writes `.hydra/` there) before train.py's main is called. Here every run is composed and checked first
(deit_ablate.validate.validate_launch; under the SLURM launcher with its world size): a refused sweep leaves
nothing. A dry run (`runtime.dry_run=true`) then prints each run's plan without launching anything, whatever the
launcher, so nothing is written at all. Light to import, as every plugin module (Hydra imports them at startup).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import filter_overrides


class DeitSweeper(BasicSweeper):
    """BasicSweeper that checks every run up front and plans dry runs without a launcher."""

    def sweep(self, arguments: list[str]) -> Any:
        """Check every run, then plan them (dry run) or sweep them as BasicSweeper does."""
        from deit_ablate.preflight import print_plans, sweep_run_dir
        from deit_ablate.rundir import keep_sweep_record

        configs = self.checked_configs(arguments)
        if configs and configs[0].runtime.dry_run:
            print_plans(configs, [sweep_run_dir(cfg) for cfg in configs])
            return []
        keep_sweep_record(self.config)  # Hydra rewrites multirun.yaml at every sweep: each keeps its own copy too
        return super().sweep(arguments)

    def checked_configs(self, arguments: list[str]) -> list:
        """Each run's config, composed as the launcher will and checked; one line and exit status 2 at the first
        that cannot run."""
        from deit_ablate.preflight import check_launch

        assert self.hydra_context is not None and self.config is not None
        loader = self.hydra_context.config_loader
        parser = OverridesParser.create(config_loader=loader)
        batches = self.split_arguments(parser.parse_overrides(self._parse_config() + list(arguments)),
                                       self.max_batch_size)
        world_size = getattr(self.launcher, "world_size", None)  # the SLURM launcher's nodes x tasks_per_node
        nothing = "Nothing was submitted." if world_size is not None else "Nothing was started."
        configs = []
        for overrides in (job for batch in batches for job in batch):
            cfg = loader.load_sweep_config(self.config, list(overrides))
            run = " ".join(filter_overrides(overrides)) or "no overrides"
            check_launch(cfg, world_size, f" (run: {run}). {nothing}")
            configs.append(cfg)
        return configs

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Nothing left to do: sweep() composed and checked every run before the first was launched."""
