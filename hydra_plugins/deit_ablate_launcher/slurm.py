"""hydra-submitit's SLURM launcher, plus two things a Table 8 sweep needs before anything is queued.

1. Every run's config is composed and validated on the submitting machine (bad option, missing data root,
   a global batch that does not split over nodes x tasks_per_node, a missing teacher, an output root it cannot
   write, online tracking without a wandb key or server): one error, nothing submitted. The sweeper
   (sweeper.py) checks them once before, with this launcher's world size, and plans dry runs itself.
2. A run that starts from another run of the same sweep waits for it with a SLURM dependency (afterok): a
   fine-tune for its pre-training, so both columns of Table 8 are one submission, a chained student
   (distill.teacher.chain, Table 2) for its teacher run, and CaiT's LayerScale control
   (model.kwargs.layer_scale_from) for the LayerScale run whose learned diagonal it fixes.

Hydra only loads launchers from the `hydra_plugins` package, hence this module's home. It stays light to
import: Hydra imports every plugin module at startup.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

log = logging.getLogger(__name__)


class DeitSlurmLauncher(SlurmLauncher):
    """Validate every run, then submit pre-training runs as an array and fine-tunes with afterok on them."""

    def __call__(self, sweep_overrides: list[str], *args, **kwargs) -> JobReturn:
        """One task of a submitted job; a requeued attempt first clears what a killed attempt left half-saved."""
        _remove_stale_result_file()
        return super().__call__(sweep_overrides, *args, **kwargs)

    @property
    def world_size(self) -> int:
        """The processes of each run: nodes x tasks_per_node."""
        return int(self.params["nodes"]) * int(self.params["tasks_per_node"])

    def _executor(self):
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        executor = submitit.AutoExecutor(cluster="slurm", folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params["max_num_timeout"])
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        skip = {"submitit_folder", "max_num_timeout"}
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in self.params.items()
                                      if k not in skip})
        return executor

    def _validated_configs(self, job_overrides: Sequence[Sequence[str]]) -> list:
        from deit_ablate.core.errors import ConfigError
        from deit_ablate.run.validate import validate_launch

        world_size = self.world_size
        configs = []
        for overrides in job_overrides:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            try:
                validate_launch(cfg, world_size=world_size)
            except ConfigError as error:
                run = " ".join(filter_overrides(overrides)) or "no overrides"
                print(f"\nerror: {error}\n(run: {run}; world size {world_size}). Nothing was submitted.\n",
                      file=sys.stderr)
                sys.exit(2)
            configs.append(cfg)
        return configs

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Validate all runs, submit them, wait, and return their results in sweep order."""
        from deit_ablate.core.errors import ConfigError
        from deit_ablate.run.lineage import Lineage
        from deit_ablate.run.stages import upstream_role

        assert self.config is not None and self.hydra_context is not None
        configs = self._validated_configs(job_overrides)
        if configs and configs[0].runtime.dry_run:  # under another sweeper than ours: plan here, write nothing
            from deit_ablate.run.preflight import print_plans, sweep_plans, sweep_run_dir

            print_plans(sweep_plans(configs, [sweep_run_dir(cfg) for cfg in configs]))
            return []

        def subdir_of(overrides: list[str]) -> str:
            return self.hydra_context.config_loader.load_sweep_config(self.config, overrides).hydra.sweep.subdir

        try:
            upstream = upstream_jobs(configs, job_overrides, subdir_of)
        except ConfigError as error:
            print(f"\nerror: {error}\nNothing was submitted.\n", file=sys.stderr)
            sys.exit(2)
        params = [(list(overrides), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
                   Singleton.get_state()) for i, overrides in enumerate(job_overrides)]
        for i, overrides in enumerate(job_overrides):
            log.info(f"\t#{initial_job_idx + i} : {' '.join(filter_overrides(overrides))}")

        executor = self._executor()
        first = [i for i in range(len(params)) if i not in upstream]
        jobs = dict(zip(first, executor.map_array(self, *zip(*(params[i] for i in first), strict=True)),
                        strict=True))
        extra = dict(self.params.get("additional_parameters") or {})
        for i, parent in submission_order(upstream):
            executor.update_parameters(slurm_additional_parameters={
                **extra, "dependency": f"afterok:{jobs[parent].job_id}", "kill-on-invalid-dep": "yes"})
            jobs[i] = executor.submit(self, *params[i])
            role = upstream_role(Lineage.of(configs[i], ()))
            log.info(f"\t#{initial_job_idx + i} waits for job {jobs[parent].job_id} ({role})")
        record_jobs(self.config.hydra.sweep.dir, {jobs[i].job_id: str(configs[i].hydra.sweep.subdir) for i in jobs})
        # Preemption and timeouts go through the inherited checkpoint(): submitit requeues the same run,
        # which resumes from its own latest checkpoint (deit_ablate/run/main.py).
        return [jobs[i].results()[0] for i in range(len(params))]


def record_jobs(sweep_dir: str, jobs: dict[str, str]) -> None:
    """Note each submitted job's run folder in the sweep folder's slurm-jobs.json (deit-status reads it to show a
    run whose job is still queued); a failure to write it is a warning, never a failed submission."""
    from pathlib import Path

    from deit_ablate.record.sweep_records import record_slurm_jobs

    try:
        record_slurm_jobs(Path(sweep_dir), jobs)
    except OSError as error:
        log.warning(f"could not record the submitted jobs in {sweep_dir} ({error}); deit-status shows them once "
                    "they start")


def upstream_jobs(configs: Sequence, job_overrides: Sequence[Sequence[str]],
                  subdir_of: Callable[[list[str]], str]) -> dict[int, int]:
    """For each run of the sweep that starts from another of its runs (deit_ablate.run.stages.upstream_overrides), the
    index of that run; `subdir_of` names a run's folder from its overrides. A LayerScale control or a chained
    student whose LayerScale or teacher run is neither in the sweep nor finished is a ConfigError (the run would
    stop on it once queued)."""
    from deit_ablate.config.schema import Stage
    from deit_ablate.run.lineage import Lineage
    from deit_ablate.run.stages import finished_layer_scale_run, finished_teacher_run, upstream_overrides

    run_index = {cfg.hydra.sweep.subdir: i for i, cfg in enumerate(configs)}
    upstream = {}
    for i, (cfg, overrides) in enumerate(zip(configs, job_overrides, strict=True)):
        lineage = Lineage.of(cfg, list(overrides))
        parent_overrides = upstream_overrides(lineage)
        if parent_overrides is None:
            continue
        parent = subdir_of(parent_overrides)
        if parent in run_index:
            upstream[i] = run_index[parent]
        elif cfg.stage == Stage.pretrain:
            finished_teacher_run(lineage)
            finished_layer_scale_run(lineage)
    return upstream


def submission_order(upstream: dict[int, int]) -> list[tuple[int, int]]:
    """The (run, the run it waits for) pairs, each after the pair that submits the run it waits for."""
    order, pending, waiting = [], dict(upstream), set(upstream)
    while pending:
        ready = [(i, parent) for i, parent in pending.items() if parent not in waiting]
        if not ready:
            raise ValueError(f"runs {sorted(pending)} of the sweep wait for each other")
        for i, parent in ready:
            order.append((i, parent))
            del pending[i]
            waiting.discard(i)
    return order


def _remove_stale_result_file() -> None:
    """Delete this task's `<result>.save_tmp`, left when an earlier attempt was killed while saving its result.

    submitit refuses to save over it, so without this the requeued attempt trains to the end and then fails."""
    import submitit

    try:
        result = submitit.JobEnvironment().paths.result_pickle
    except (RuntimeError, KeyError):  # not inside a submitit job
        return
    result.with_suffix(result.suffix + ".save_tmp").unlink(missing_ok=True)
