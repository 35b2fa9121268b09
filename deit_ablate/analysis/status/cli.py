"""`deit-status [OUTPUT_ROOT] [-m OVERRIDES...] [--watch] [--json]`: one row per run of an output root or a sweep,
with its state, progress and ETA, the totals and the sweep's ETA (docs/status.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deit_ablate.analysis.status.rows import STALL_AFTER_S, RunRow, damaged_row, run_row
from deit_ablate.analysis.status.slurm import slurm_jobs
from deit_ablate.analysis.status.sweep import PlannedRun, folder_runs, root_problem, sweep_runs
from deit_ablate.analysis.status.view import FILE_WIDTH, as_json, table
from deit_ablate.record.progress import read_progress
from deit_ablate.record.resume import LaunchAction, NoReadableCheckpoint
from deit_ablate.record.rundir import DEFAULT_OUTPUT_ROOT, RUNS
from deit_ablate.record.runfiles import DamagedRecord
from deit_ablate.record.sweep_records import read_slurm_jobs
from deit_ablate.run.commands import check_overrides, command, number_option

WATCH_EVERY_S = 5.0  # --watch's default refresh


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line: an output root and/or a sweep's overrides, and how to show them."""
    parser = argparse.ArgumentParser(
        prog="deit-status", description="Where every run of a sweep stands (docs/status.md).",
        epilog="examples: deit-status outputs/ | deit-status -m 'ablation=glob(*)' stage=pretrain,finetune --watch")
    parser.add_argument("targets", nargs="*", metavar="OUTPUT_ROOT|OVERRIDE",
                        help=f"an output root (default {DEFAULT_OUTPUT_ROOT}/), or a sweep's overrides as given to "
                             "`python train.py -m` (its runs not started yet show too)")
    parser.add_argument("-m", "--multirun", action="store_true", help="accepted for the sweep's own command line")
    parser.add_argument("--watch", action="store_true", help="refresh in place in the terminal (Ctrl-C ends it)")
    parser.add_argument("--every", type=number_option(float, 0, above=True), default=WATCH_EVERY_S,
                        help="seconds between refreshes (--watch)")
    parser.add_argument("--json", action="store_true", help="print the rows and totals as JSON, for scripts")
    parser.add_argument("--stall-after", type=number_option(float, 0, above=True), default=STALL_AFTER_S,
                        help=f"seconds without progress after which a held run shows as stalled (default "
                             f"{STALL_AFTER_S:.0f})")
    return parser.parse_args(list(argv))


def fail(message: str) -> int:
    """One error line on stderr; exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def output_root(path: Path) -> Path:
    """The output root `path` names (`outputs/runs` is taken as `outputs`)."""
    return path.parent if path.name == RUNS and not (path / RUNS).is_dir() else path


class RootGone(Exception):
    """The output root a --watch shows is no longer there (deleted, moved, unmounted)."""


def damage_of(run: PlannedRun, error: DamagedRecord | NoReadableCheckpoint | OSError) -> str:
    """The detail of a damaged run's row: its file and the problem (the whole path for another run's file)."""
    if isinstance(error, NoReadableCheckpoint):
        return error.detail
    if isinstance(error, DamagedRecord):
        return error.detail(run.run_dir.path)
    where = Path(error.filename).name if error.filename else "its folder"
    return f"{where}: cannot be read ({error.strerror or error})"


def read_run(run: PlannedRun) -> tuple[dict[str, Any] | None, LaunchAction] | RunRow:
    """A run's progress record and launch action, each read once; its damaged row where a file of its folder is not
    what a run writes there."""
    if run.damage is not None:
        return damaged_row(run.run_dir, run.labels, run.damage)
    try:
        try:
            run.run_dir.check_files()  # before anything is opened: a FIFO would block the status
        except FileNotFoundError:  # a sweep's run not started
            pass
        action = run.action()
    except (DamagedRecord, NoReadableCheckpoint, OSError) as error:
        return damaged_row(run.run_dir, run.labels, damage_of(run, error))
    try:  # a launch never reads progress.json: its damage leaves the launch action as it is
        return read_progress(run.run_dir), action
    except (DamagedRecord, OSError) as error:
        return damaged_row(run.run_dir, run.labels, damage_of(run, error), action.text)


def collect(runs: Sequence[PlannedRun], stall_after: float) -> list[RunRow]:
    """The rows of `runs`, now: each run's action, its folder's records and SLURM's queue (one query); a run with a
    damaged file is one row naming it, the others as they are."""
    runs = [run.now() for run in runs]
    job_of_run = {run: job for root in {r.run_dir.path.parent for r in runs}
                  for job, run in read_slurm_jobs(root).items()}  # run folder name -> its newest job
    records = [read_run(r) for r in runs]
    progress_jobs = {str((seen[0] or {}).get("slurm_job") or "") for seen in records if isinstance(seen, tuple)}
    jobs = slurm_jobs((set(job_of_run.values()) | progress_jobs) - {""})
    rows = []
    for run, seen in zip(runs, records, strict=True):
        if isinstance(seen, RunRow):
            rows.append(seen)
            continue
        progress, action = seen
        try:
            rows.append(replace(run_row(run.run_dir, run.labels, action, progress, jobs, job_of_run, stall_after),
                                also=list(run.also)))
        except (DamagedRecord, OSError) as error:
            rows.append(damaged_row(run.run_dir, run.labels, damage_of(run, error), action.text))
    return rows


def show(rows: list[RunRow], where: str, as_json_too: bool) -> None:
    """Print the rows once: the table, or JSON."""
    if as_json_too:
        print(json.dumps(as_json(rows, where), indent=2))
        return
    console().print(table(rows, where))


def console():
    """rich's console on stdout: the terminal's width, or FILE_WIDTH for a file or a pipe (not 80 characters)."""
    from rich.console import Console

    here = Console()
    return here if here.is_terminal else Console(width=FILE_WIDTH)


def watch(rows_now: Callable[[], list[RunRow]], where: str, every: float) -> None:
    """Refresh the table in place every `every` seconds until Ctrl-C (exit status 0)."""
    from rich.live import Live

    with Live(table(rows_now(), where), console=console(), auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(every)
                live.update(table(rows_now(), where), refresh=True)
        except KeyboardInterrupt:  # how a watch ends: the last table stays on the screen
            return


@command("deit-status")
def main(argv: Sequence[str] | None = None) -> int:
    """Show where every run stands; 2 for a path that is not an output root or a sweep that does not compose."""
    args = parse(sys.argv[1:] if argv is None else argv)
    paths = [t for t in args.targets if "=" not in t or Path(t).is_dir()]  # a folder whose path holds `=` too
    overrides = [t for t in args.targets if t not in paths]
    if len(paths) > 1 or (paths and overrides):
        return fail(f"give one output root or a sweep's overrides, not {' '.join(paths)}: for a sweep under another "
                    "output root add runtime.output_root=<folder> to its overrides.")
    root, planned = output_root(Path(paths[0] if paths else DEFAULT_OUTPUT_ROOT)), None
    if overrides or args.multirun:
        check_overrides(overrides)
        planned = planned_sweep(overrides)
        if isinstance(planned, int):
            return planned
        where = f"sweep: {' '.join(overrides)}"
    elif root_problem(root) is not None:
        return fail(f"{root_problem(root)}: give an output root (runtime.output_root, {DEFAULT_OUTPUT_ROOT}/ by "
                    "default), or the sweep's overrides (deit-status -m 'ablation=glob(*)' ...).")
    else:
        where = f"output root: {root}"

    def rows_now() -> list[RunRow]:
        if planned is not None:
            return collect(planned, args.stall_after)
        try:
            return collect(folder_runs(root), args.stall_after)
        except FileNotFoundError:  # the root went away while its folders were read
            if root_problem(root) is None:
                raise
            raise RootGone(root_problem(root)) from None

    if args.watch and not args.json:
        try:
            watch(rows_now, where, args.every)
        except RootGone as gone:
            return fail(f"{gone}: the output root went away while it was watched, and the watch ended there. Give it "
                        f"again once it is back (deit-status {root} --watch).")
        return 0
    show(rows_now(), where, args.json)
    return 0


def planned_sweep(overrides: list[str]) -> list[PlannedRun] | int:
    """The sweep's runs, planned; exit status 2 (and one line) when its overrides do not compose."""
    from hydra.errors import HydraException

    try:
        return sweep_runs(overrides)
    except HydraException as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return fail(f"the sweep's overrides do not compose: {first}. Fix the override as for python train.py -m "
                    "(python train.py --help lists the groups).")
