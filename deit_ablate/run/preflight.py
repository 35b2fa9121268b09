"""What a launch does before Hydra writes anything: every check (validate_launch), and the whole dry run.

Hydra makes a run's folder and writes its `.hydra/` files there before it calls train.py's main, and a sweep first
writes `runs/multirun.yaml`; so a refused launch used to leave folders behind, and a dry run rewrote the `.hydra/`
files of finished runs. The checks and the dry run therefore come first: in the callback below for one run
(conf/config.yaml registers it), in the sweeper (hydra_plugins/deit_ablate_launcher/sweeper.py) for `-m`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

if TYPE_CHECKING:
    from deit_ablate.run.plan import RunPlan

T = TypeVar("T")
# Hydra's own switch for whole tracebacks: a failed check then shows where it failed, below its one line.
DEBUG_SWITCH = "HYDRA_FULL_ERROR"


def refuse(error: Exception, where: str = "") -> NoReturn:
    """Stop the launch with one line on stderr and exit status 2."""
    print(f"\nerror: {error}{where}\n", file=sys.stderr)
    sys.exit(2)


def unexpected_line(error: BaseException) -> str:
    """The one line a check that failed in a way no check foresaw ends the launch with."""
    text = " ".join(str(error).split())[:300] or "no message"
    return (f"the launch check failed before anything was started or written ({type(error).__name__}: {text}). "
            f"Nothing ran. Set {DEBUG_SWITCH}=1 to see where it failed, and report it if the message does not say "
            "what to fix")


def guarded(step: Callable[..., T], *args: Any, where: str = "") -> T:
    """`step(*args)` (planning or checking a launch), or one line and exit status 2 whatever it raises: Hydra turns an
    exception out of a callback into a warning and runs the job, so no exception may leave a check."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from deit_ablate.core.errors import ConfigError, RunError, no_access

    try:
        return step(*args)
    except (ConfigError, RunError) as error:
        refuse(error, where)
    except PermissionError as error:  # a teacher run or data folder this user may not read
        refuse(no_access(error), where)
    except (HydraException, OmegaConfBaseException) as error:  # composing a run (a sweep's): Hydra's own words
        refuse(RuntimeError(" ".join(str(error).split())), where)
    except Exception as error:  # noqa: BLE001 -- any other failure of a check must stop the launch too
        if os.environ.get(DEBUG_SWITCH) == "1":
            traceback.print_exc()
        refuse(RuntimeError(unexpected_line(error)), where)


def check_launch(cfg: DictConfig, world_size: int | None = None, where: str = "") -> None:
    """validate_launch, or one line and exit status 2 (`where` names the run of a sweep)."""
    from deit_ablate.run.validate import validate_launch

    guarded(validate_launch, cfg, world_size, where=where)


def check_teacher_trained(cfg: DictConfig) -> None:
    """A single launch of a chained student (distill.teacher.chain) whose teacher run has not finished: one line
    naming the command that trains it, and exit status 2 (a sweep trains it first instead)."""
    from deit_ablate.run.lineage import Lineage
    from deit_ablate.run.stages import finished_teacher_run

    guarded(lambda: finished_teacher_run(Lineage.of(cfg, list(cfg.hydra.overrides.task))))


def sweep_run_dir(cfg: DictConfig) -> Path:
    """The folder of a run composed by a sweep (its config holds Hydra's node)."""
    return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)


def print_plans(plans: Iterable[RunPlan]) -> None:
    """Print the dry run's line for each run (`sweep_plans`), then one for each run that computes the same as
    another of the sweep (lifecycle.same_computation_lines); nothing is written. Whatever fails ends the dry run
    with one line and exit status 2 (guarded)."""
    from deit_ablate.run.lifecycle import dry_run_line, same_computation_lines

    def plan_all() -> None:
        planned = []
        for plan in plans:
            print(dry_run_line(plan), flush=True)
            planned.append(plan)
        for line in same_computation_lines(planned):
            print(line, flush=True)

    guarded(plan_all)


def sweep_plans(configs: Sequence[DictConfig], run_dirs: Sequence[Path], job_log: bool = True) -> Iterator[RunPlan]:
    """Each run's plan as a launch would make it (its Hydra node as composed), for the dry run and `deit-status`;
    one line and exit status 2 at the first that cannot be planned. Nothing is written."""
    from hydra.core.hydra_config import HydraConfig

    from deit_ablate.core.distributed import DistInfo
    from deit_ablate.record.overrides import named_by_finetune
    from deit_ablate.record.resolvers import run_dir_of
    from deit_ablate.record.rundir import RunDir
    from deit_ablate.run.plan import make_plan

    if job_log:  # the run's console logging, as the launch would set it up (the status keeps its own)
        configure_job_log(configs[0].hydra.job_logging, configs[0].hydra.verbose)
    saved = HydraConfig.instance().cfg
    try:
        for cfg in configs:  # a fine-tune finds its pre-training among the sweep's runs, not by composing it again
            named = named_by_finetune(str(cfg.stage), list(cfg.hydra.overrides.task))
            if named is not None:
                run_dir_of(named, cfg.runtime.output_root, cfg)
        for cfg, run_dir in zip(configs, run_dirs, strict=True):
            HydraConfig.instance().set_config(cfg)  # as Hydra's run_job does: stages.py reads the overrides there
            yield guarded(make_plan, cfg, DistInfo(), RunDir(run_dir), list(cfg.hydra.overrides.task))
    finally:
        HydraConfig.instance().cfg = saved


def configure_job_log(job_logging: Any, verbose: Any) -> None:
    """The run's console logging (conf/hydra/job_logging, Hydra's `hydra.job_logging` and `hydra.verbose`), which
    Hydra sets up only once it runs a job."""
    from hydra.core.utils import configure_log

    configure_log(job_logging, verbose)


class Preflight(Callback):
    """Check a single run before Hydra makes its folder; plan a dry run and stop there, writing nothing."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        def every_check() -> None:  # a dry run is planned and printed, and the process ends there
            check_launch(config)
            if config.runtime.dry_run:
                print_plans(sweep_plans([config], [Path(str(config.hydra.run.dir))]))
                sys.exit(0)
            check_teacher_trained(config)

        guarded(every_check)
