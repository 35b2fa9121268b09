"""Hydra's basic sweeper, with every run of a sweep checked before anything is written, chained teacher runs added,
and dry runs planned here.

Hydra's own sweeper writes `runs/multirun.yaml` before it composes a single run, and its launcher makes each run's
folder (and writes `.hydra/` there) before train.py's main is called. Here every run is composed and checked first
(deit_ablate.run.validate.validate_launch; under the SLURM launcher with its world size): a refused sweep leaves
nothing. A chained student (distill.teacher.chain, Table 2) gets its teacher run added to the sweep right before the
first run that needs it, once, unless it has finished. A dry run (`runtime.dry_run=true`) then prints each run's
plan without launching anything, whatever the launcher, so nothing is written at all. Light to import, as every
plugin module (Hydra imports them at startup).
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import filter_overrides
from omegaconf import OmegaConf


class DeitSweeper(BasicSweeper):
    """BasicSweeper that checks every run up front, adds chained teacher runs and plans dry runs without a
    launcher."""

    def sweep(self, arguments: list[str]) -> Any:
        """Check every run, then plan them (dry run) or launch them in order, as BasicSweeper does."""
        from deit_ablate.record.sweep_records import keep_sweep_record
        from deit_ablate.run.preflight import guarded, print_plans, sweep_plans, sweep_run_dir

        jobs, configs = guarded(self.checked_jobs, arguments)
        if configs and configs[0].runtime.dry_run:
            print_plans(sweep_plans(configs, [sweep_run_dir(cfg) for cfg in configs]))
            return []
        keep_sweep_record(self.config)  # Hydra rewrites multirun.yaml at every sweep: each keeps its own copy too
        return self.launch_jobs(jobs)

    def launch_jobs(self, jobs: list[list[str]]) -> list:
        """BasicSweeper.sweep over these jobs: multirun.yaml first, then batches of max_batch_size, numbered on; a
        run another launch holds (RunInUse) is left while the others go on, and named at the end (exit status 1)."""
        from deit_ablate.core.errors import RunInUse

        assert self.config is not None and self.launcher is not None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.overrides = list(self.split_overrides_to_chunks(jobs, self.max_batch_size)) if jobs else []
        returns, initial_job_idx, left = [], 0, []
        while not self.is_done():
            batch = self.get_job_batch()
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for overrides, result in zip(batch, results, strict=True):
                try:
                    _ = result.return_value  # raises when the job failed, as BasicSweeper does
                except RunInUse as error:
                    left.append((overrides, error))
            initial_job_idx += len(batch)
            returns.append(results)
        if left:
            sys.exit(left_runs_message(left, len(jobs)))
        return returns

    def checked_jobs(self, arguments: list[str]) -> tuple[list[list[str]], list]:
        """Each run's overrides and config, composed as the launcher will and checked, chained teacher runs added
        (chain_order); one line and exit status 2 at the first that cannot run."""
        from deit_ablate.config.compose import read_config_files_once
        from deit_ablate.run.lineage import Lineage
        from deit_ablate.run.stages import teacher_run_overrides

        assert self.hydra_context is not None and self.config is not None
        read_config_files_once(self.hydra_context.config_loader)  # every run of the sweep is composed here
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        batches = self.split_arguments(parser.parse_overrides(self._parse_config() + list(arguments)),
                                       self.max_batch_size)
        jobs = [list(job) for batch in batches for job in batch]
        configs = [self._checked(job) for job in jobs]
        teachers: dict[str, tuple[list[str], Any]] = {}
        needs: list[str | None] = []
        for cfg, job in zip(configs, jobs, strict=True):
            overrides = teacher_run_overrides(Lineage.of(cfg, job))
            if overrides is None:
                needs.append(None)
                continue
            teacher = self._checked(overrides, f"the teacher run of {' '.join(filter_overrides(job))}")
            needs.append(str(teacher.hydra.sweep.subdir))
            teachers.setdefault(needs[-1], (overrides, teacher))
        order = chain_order([str(cfg.hydra.sweep.subdir) for cfg in configs], needs, _finished(teachers))
        ordered = [(jobs[i], configs[i]) if isinstance(i, int) else teachers[i] for i in order]
        return [job for job, _ in ordered], [cfg for _, cfg in ordered]

    def _checked(self, overrides: list[str], what: str | None = None) -> Any:
        """One run's config as the launcher composes it, checked (exit status 2 and one line when refused)."""
        from deit_ablate.run.preflight import check_launch

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        world_size = getattr(self.launcher, "world_size", None)  # the SLURM launcher's nodes x tasks_per_node
        nothing = "Nothing was submitted." if world_size is not None else "Nothing was started."
        run = what or " ".join(filter_overrides(overrides)) or "no overrides"
        check_launch(cfg, world_size, f" (run: {run}). {nothing}")
        return cfg

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Nothing left to do: sweep() composed and checked every run before the first was launched."""


def left_runs_message(left: Sequence[tuple[Sequence[str], Exception]], runs: int) -> str:
    """What a sweep that left runs held by other launches says at its end: each run and why, and what to do."""
    lines = [f"  {' '.join(filter_overrides(overrides)) or 'no overrides'}: {error}" for overrides, error in left]
    return (f"\nerror: the sweep left {len(left)} of its {runs} runs, in use by other launches (the others ran):\n"
            + "\n".join(lines) + "\nLaunch the same sweep again once those launches have ended: it skips the runs "
            "that finished and trains these.\n")


def _finished(teachers: dict[str, tuple[list[str], Any]]) -> set[str]:
    """The teacher runs (folder names) that have finished already."""
    from deit_ablate.record.rundir import RunDir
    from deit_ablate.run.preflight import sweep_run_dir

    done = set()
    for name, (_, cfg) in teachers.items():
        result = RunDir(sweep_run_dir(cfg)).read_result()
        if result is not None and result["status"] == "finished":
            done.add(name)
    return done


def chain_order(runs: Sequence[str], teachers: Sequence[str | None], finished: Collection[str]) -> list[int | str]:
    """The launch order of a sweep's `runs` (folder names; `teachers[i]`: the teacher run run i distils from, or
    None): the runs' indices, each teacher run (its folder name) right before the first run that needs it, once,
    unless it has finished or an earlier run of the sweep is that run (a later one moves up instead)."""
    first = {run: i for i, run in reversed(list(enumerate(runs)))}
    order: list[int | str] = []
    placed: set[str] = set()
    for i, (run, teacher) in enumerate(zip(runs, teachers, strict=True)):
        if teacher is not None and teacher not in placed and teacher not in finished:
            order.append(first.get(teacher, teacher))
            placed.add(teacher)
        if i not in order:
            order.append(i)
            placed.add(run)
    return order
