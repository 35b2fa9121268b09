"""Train one run of the DeiT recipe: `python train.py [group=option ...] [key=value ...]` (see README)."""

import gc
import os
import signal
import sys


def stopped_while_starting(signum: int, frame) -> None:
    """SIGTERM or Ctrl-C before the run took these signals over (core/stopping.py): imports, composing the config.
    End the process at once: nothing is written before the run takes the signals over, and an exception raised
    here could land inside a library (omegaconf's deepcopy, flag_override) and become its error and traceback."""
    for ignored in (signal.SIGTERM, signal.SIGINT):
        signal.signal(ignored, signal.SIG_IGN)
    try:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"\nstopped by {signal.Signals(signum).name} while starting, before the first step: "
                             "nothing to save; the same command starts the run\n\n")
            sys.stderr.flush()
    finally:
        os._exit(128 + signum)


if __name__ == "__main__":  # before the imports, which take seconds
    for _signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_signum, stopped_while_starting)
    # Start-up makes millions of objects that live as long as the process (torch, timm, wandb, the config): no
    # collection passes over them while they are made (0.5 s of a 4 s start), one freeze once they are (main()).
    gc.disable()
    from deit_ablate.core.imports import keep_wandb_out_of_timm

    keep_wandb_out_of_timm()  # the launch checks import timm: without the wandb it imports for its own script

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from deit_ablate.core.errors import ConfigError, DataError, RunError, RunInUse, no_access  # noqa: E402
from deit_ablate.run.commands import check_overrides, prepare_configs, show_stage_config  # noqa: E402

prepare_configs()


def check_group_options(argv: list[str]) -> None:
    """Catch `resolution=384` (a bare number, which Hydra reads as an int, not an option name) with the fix."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") == "resolution" and value and all(v.strip().isdigit() for v in value.split(",")):
            fixed = ",".join(f"{v.strip()}px" for v in value.split(","))
            print(f"\nerror: {arg}: resolution options carry a px suffix (Hydra reads a bare number as a number, "
                  f"not an option name). Did you mean resolution={fixed}?\n", file=sys.stderr)
            sys.exit(2)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    gc.freeze()  # what start-up made is kept for the run: the collector skips it (and forked workers share it)
    gc.enable()
    from deit_ablate.core.stopping import StopRequested
    from deit_ablate.run.main import discard_empty_run_dir, run

    speaks = os.environ.get("RANK", "0") == "0"  # one line from a torchrun/SLURM job, not one per rank
    try:
        run(cfg)
        for signum in (signal.SIGTERM, signal.SIGINT):  # the run is recorded: its exit is not interrupted
            signal.signal(signum, signal.SIG_IGN)
    except RunInUse as error:
        discard_empty_run_dir()
        if speaks:
            print(f"\nerror: {error}\n", file=sys.stderr)
        if in_sweep():
            raise  # the job's failure, which the sweeper notes: it goes on and names the run at its end
        sys.exit(1)
    except (ConfigError, RunError) as error:
        discard_empty_run_dir()
        if speaks or not isinstance(error, ConfigError) or isinstance(error, DataError):  # a config: one says it
            print(f"\nerror: {error}\n", file=sys.stderr)
        sys.exit(2 if isinstance(error, ConfigError) else 1)
    except PermissionError as error:  # a teammate's teacher run, data or cache this user may not read
        discard_empty_run_dir()
        if speaks:
            print(f"\nerror: {no_access(error)}\n", file=sys.stderr)
        sys.exit(2)
    except StopRequested as stopped:
        if speaks:
            print(f"\n{stopped}\n", file=sys.stderr)
        sys.exit(stopped.exit_code)
    except KeyboardInterrupt:
        if speaks:
            print("\nstopped at once (a second Ctrl-C); the same command resumes the run from its last checkpoint\n",
                  file=sys.stderr)
        sys.exit(130)


def in_sweep() -> bool:
    """Whether this run is one of a sweep's (`-m`)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def exit_status(stop: SystemExit) -> int:
    """The status a process ends with for this SystemExit, as Python's own exit gives it (a message: printed, 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def exit_now(status: int) -> None:
    """End the process as Python's exit would, without its last step: tearing down every module and object (1-2 s
    with torch, timm and wandb loaded, all of it after the run's files are written). The atexit handlers (wandb's,
    logging's, multiprocessing's, which stop the loader workers) still run and the standard streams are flushed.
    Under a profiler or tracer (python -m cProfile ..., which writes its file after the script), or with a thread
    still running, the normal exit."""
    import atexit
    import threading

    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if run_exitfuncs is None or others or sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(status)
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(status)


if __name__ == "__main__":
    try:
        check_group_options(sys.argv[1:])
        check_overrides(sys.argv[1:])
        if show_stage_config(sys.argv[1:]):  # a fine-tune or transfer as it runs, not as composed
            exit_now(0)
        main()
    except SystemExit as stop:
        exit_now(exit_status(stop))
    exit_now(0)
