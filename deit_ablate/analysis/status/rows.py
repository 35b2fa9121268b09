"""One row per run: its state, read from its folder and derived from what a launch would do with it now
(run/lifecycle.py's launch_action, which the dry run prints), so the status and the dry run never disagree.

The states, and the launch action each goes with (tests/test_status.py checks the pairs, ACTION_OF):

    planned     never started (train), or a fine-tune a launch records without training (record)
    waiting     for its pre-training, its transfer source, its teacher run or its LayerScale run (wait)
    blocked     the run it needs ended without finishing: a launch refuses it (refuse)
    queued      its SLURM job is pending (the reason shown); `requeued` when it had trained before
    running     its lock is held by a live launch that wrote progress within the stall bound (host, ranks)
    stalled     its lock is held by a process that is gone, or no progress for longer than STALL_AFTER_S
    preempted   stopped before its end by a signal or a time limit; a relaunch resumes it (resume)
    failed      its launch ended with an error (the error line, and train.log where the whole log is)
    damaged     a file of its folder is not what a run writes there (a folder where result.json belongs, a number
                that is none in progress.json, a list for Hydra's config): the file and its problem
    finished, diverged   its result.json (skip)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from deit_ablate.analysis.status.slurm import SlurmJob
from deit_ablate.record.progress import launch_rate, number_problem
from deit_ablate.record.resume import ACTIONS, LaunchAction
from deit_ablate.record.rundir import RunDir, read_result
from deit_ablate.record.runfiles import DamagedRecord, read_tail
from deit_ablate.record.runlock import describe, read_lock, stale_reason, this_process

STALL_AFTER_S = 600.0  # a held lock with no progress written for this long: stalled (`deit-status --stall-after`)
PENDING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING")  # SLURM's states of a job not running yet
STATES = ("planned", "waiting", "blocked", "queued", "requeued", "running", "stalled", "preempted", "failed",
          "damaged", "finished", "diverged")
RESULT_NUMBERS = ("steps_done", "epochs_done", "train_seconds", "top1", "top1_best")  # what the status shows of it
ACTION_OF = {"planned": {"train", "record"}, "waiting": {"wait"}, "blocked": {"refuse"},
             "queued": {"train", "resume"}, "requeued": {"resume", "train"}, "running": {"train", "resume"},
             "stalled": {"train", "resume"}, "preempted": {"resume", "train"}, "failed": {"train", "resume", "skip"},
             "damaged": set(ACTIONS), "finished": {"skip"}, "diverged": {"skip"}}  # the launch action of each state


@dataclass
class RunRow:
    """What the status shows of one run."""

    run: str  # its folder's name
    row: str  # its study row (`ablation=no_mixup`), or its overrides
    stage: str
    seed: int | None
    state: str
    detail: str  # what it waits for, the host and ranks, the error, why it stalled
    action: str  # what a launch would do now: the dry run's words
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    total_steps: int | None = None
    img_per_s: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None
    last_top1: float | None = None
    best_top1: float | None = None
    slurm_job: str | None = None
    log: str | None = None
    also: list[str] = field(default_factory=list)  # the sweep's other rows that name this run (one per folder)

    def as_json(self) -> dict[str, Any]:
        """The row as `deit-status --json` prints it."""
        return asdict(self)


def _seconds_since(stamp: str | None) -> float | None:
    """Seconds since an ISO time the run wrote, or None."""
    try:
        return max(time.time() - datetime.fromisoformat(str(stamp)).timestamp(), 0.0)
    except ValueError:
        return None


def last_error_line(run_dir: RunDir) -> str | None:
    """The last error line of the run's train.log, or None."""
    try:
        lines = read_tail(run_dir.log).splitlines()  # a log of any size: its last MB
    except (OSError, DamagedRecord):
        return None
    errors = [line for line in lines if " ERROR " in line]
    return errors[-1].split(": ", 1)[-1] if errors else None


def live_state(run_dir: RunDir, progress: dict[str, Any] | None, stall_after: float) -> tuple[str, str] | None:
    """running or stalled, from the run's lock and progress.json; None when no launch holds the run."""
    try:
        _, holder, age = read_lock(run_dir.lock)
    except OSError:  # no lock: no launch holds the run
        return None
    reason = stale_reason(holder, age, this_process())
    if reason is not None:
        return "stalled", f"its lock is held by {describe(holder, age)}: {reason}"
    same = progress is not None and holder is not None and progress.get("pid") == holder.get("pid") \
        and progress.get("host") == holder.get("host")
    quiet = _seconds_since(progress.get("updated") if same else (holder or {}).get("started"))
    if quiet is not None and quiet > stall_after:
        return "stalled", f"no progress for {quiet:.0f} s (stall bound {stall_after:.0f} s)"
    ranks = (progress or {}).get("world_size", "?")
    where = f"{(holder or {}).get('host', '?')}, {ranks} rank{'' if ranks == 1 else 's'}" if same \
        else f"{(holder or {}).get('host', '?')}, starting"
    return "running", where


def queued_state(job: SlurmJob | None, trained_before: bool) -> tuple[str, str] | None:
    """queued (requeued when it trained before) or running on its node, from SLURM; None otherwise."""
    if job is None:
        return None
    if job.state in PENDING:
        return ("requeued" if trained_before else "queued"), f"SLURM job {job.job_id}: {job.reason or job.state}"
    if job.state in ("RUNNING", "COMPLETING"):
        return "running", f"{job.nodes}, SLURM job {job.job_id} starting"
    return None


def ended_state(run_dir: RunDir, action: LaunchAction, progress: dict[str, Any] | None,
                job: SlurmJob | None) -> tuple[str, str]:
    """The state of a run no launch holds now: failed, stalled, preempted or planned."""
    recorded = (progress or {}).get("state")
    ended_job = f" (SLURM: {job.state})" if job is not None else ""
    if recorded == "failed":
        return "failed", f"{(progress or {}).get('error') or last_error_line(run_dir)}{ended_job}"
    if recorded == "running":  # its launch vanished without a word, and its lock with it (deleted by hand?)
        return "stalled", f"its launch ended without a word at step {(progress or {}).get('step')}{ended_job}"
    if recorded is None and action.kind in ("train", "resume") and last_error_line(run_dir):
        return "failed", f"{last_error_line(run_dir)}{ended_job}"
    if action.kind == "resume" or recorded == "stopped":
        said = str((progress or {}).get("error") or "").split(";")[0]  # `stopped by SIGTERM at step 147`
        step = (progress or {}).get("step")  # none without progress.json (a run from before it): the checkpoint's
        return "preempted", f"{said or (f'stopped at step {step}' if step is not None else action.text)}{ended_job}"
    return "planned", ""


def run_state(run_dir: RunDir, action: LaunchAction, progress: dict[str, Any] | None, job: SlurmJob | None,
              stall_after: float = STALL_AFTER_S) -> tuple[str, str]:
    """The state of one run (STATES) and its detail, consistent with the launch `action` (ACTION_OF)."""
    if action.kind == "skip":
        result = action.result or read_result(run_dir.result)
        return result["status"], str(result.get("note", ""))
    if action.kind == "wait":
        role, _, name = action.text.removeprefix("wait for ").rpartition(" ")
        return "waiting", f"{role} …-{name.rsplit('-', 1)[-1]}" if "-" in name else f"{role} {name}"
    if action.kind == "refuse":
        return "blocked", action.text
    if action.kind == "record":
        return "planned", action.text
    queued = queued_state(job, trained_before=progress is not None or action.kind == "resume")
    if queued is not None and queued[0] != "running":  # pending in SLURM, whatever an old lock on a node says
        return queued
    state, detail = live_state(run_dir, progress, stall_after) or queued or ended_state(run_dir, action, progress, job)
    if state == "stalled":
        detail = f"{detail}; {relaunch_redoes(action, progress)}"
    return state, detail


def relaunch_redoes(action: LaunchAction, progress: dict[str, Any] | None) -> str:
    """What a relaunch of a stalled run loses: `resumes from step 39 (17 steps to redo)`, or `no checkpoint yet:
    restarts from step 0`, the steps counted to its last progress record."""
    start = action.resume_step or 0
    said = f"resumes from step {start}" if action.kind == "resume" else "no checkpoint yet: restarts from step 0"
    reached = (progress or {}).get("step")
    if not isinstance(reached, int):
        return said
    lost = max(reached - start, 0)
    return f"{said} ({lost} step{'' if lost == 1 else 's'} to redo)"


def numbers(progress: dict[str, Any] | None, result: dict[str, Any] | None) -> dict[str, Any]:
    """Epoch, step of total, images/s, elapsed, ETA and top-1 from progress.json (or result.json when finished); the
    images/s of a run under way since its launch started (launch_rate), the ETA at that rate; a finished run's over
    its whole training."""
    p = dict(progress or {})
    if result is not None:
        p.update(step=result.get("steps_done", p.get("step")), epoch=result.get("epochs_done", p.get("epoch")),
                 elapsed_s=result.get("train_seconds", p.get("elapsed_s")),
                 last_top1=result.get("top1", p.get("last_top1")),
                 best_top1=result.get("top1_best", p.get("best_top1")))
    step, total, images = p.get("step"), p.get("total_steps"), p.get("images_per_step")
    if result is None:
        rate = launch_rate(p)
    else:  # a finished run: over its whole training
        rate = step * images / p["elapsed_s"] if step and images and p.get("elapsed_s") else None
    eta = None
    if result is None and step is not None and total and rate and images:
        eta = max(total - step, 0) * images / rate
    elif result is None and step and total and p.get("elapsed_s"):
        eta = p["elapsed_s"] / step * max(total - step, 0)
    keys = ("epoch", "epochs", "step", "total_steps", "elapsed_s", "last_top1", "best_top1")
    return {**{k: p.get(k) for k in keys}, "img_per_s": None if rate is None else round(rate, 1), "eta_s": eta}


def damaged_row(run_dir: RunDir, labels: tuple[str, str, int | None], detail: str,
                action: str = "refuse until it is repaired") -> RunRow:
    """The row of a run whose folder holds a damaged file (`detail`: the file and its problem)."""
    row, stage, seed = labels
    return RunRow(run=run_dir.name, row=row, stage=stage, seed=seed, state="damaged", detail=detail, action=action)


def run_row(run_dir: RunDir, labels: tuple[str, str, int | None], action: LaunchAction,
            progress: dict[str, Any] | None, jobs: dict[str, SlurmJob], job_of_run: dict[str, str],
            stall_after: float = STALL_AFTER_S) -> RunRow:
    """The row of the run in `run_dir` (`labels`: its study row, stage and seed), planned as `action`, its
    progress.json read as `progress`; a DamagedRecord when its result holds a number that is none."""
    result = (action.result or read_result(run_dir.result)) if action.kind == "skip" else None
    problem = number_problem(result, RESULT_NUMBERS) if result is not None else None
    if problem is not None:
        raise DamagedRecord(run_dir.result, problem)
    job_id = job_of_run.get(run_dir.name) or (progress or {}).get("slurm_job")  # the launcher's record first
    job = jobs.get(str(job_id)) if job_id else None
    state, detail = run_state(run_dir, action, progress, job, stall_after)
    row, stage, seed = labels
    log = str(run_dir.log) if run_dir.log.exists() else None
    return RunRow(run=run_dir.name, row=row, stage=stage, seed=seed, state=state, detail=detail, action=action.text,
                  slurm_job=str(job_id) if job_id else None, log=log, **numbers(progress, result))
