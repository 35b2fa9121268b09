"""The life of a run folder across launches: its lock, what a launch finds there (a result to skip, a checkpoint to
resume), what it records about the run, and what a dry run says it would do."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deit_ablate.config.schema import TrackingMode
from deit_ablate.core.distributed import DistInfo, agree, broadcast_object, stopped_by_peer
from deit_ablate.core.errors import ConfigError, RunError, RunInUse
from deit_ablate.core.logs import attach_run_log, detach_run_log, file_only, log
from deit_ablate.core.stopping import StopRequested
from deit_ablate.core.streams import trained_before
from deit_ablate.record import checkpoint as ckpt
from deit_ablate.record.identity import experiment, same_computation, stage_drop
from deit_ablate.record.resume import LaunchAction, folder_action, previous_result, skip_action
from deit_ablate.record.rundir import EXPERIMENT_LOCKS, RunDir, wandb_root
from deit_ablate.record.runlock import RunLock, live_holder
from deit_ablate.record.tracking import Tracker, read_epoch_rows, wandb_logs
from deit_ablate.run.plan import RunPlan
from deit_ablate.run.report import wandb_summary
from deit_ablate.run.stages import upstream_role


def acquire_run_lock(run_dir: Path, info: DistInfo, wait: bool, poll_s: float = 5.0) -> RunLock | None:
    """The main rank takes the run folder's lock (the others follow its outcome): a RunError naming the holder
    when another launch trains this run, or a wait for it to end with `wait`."""
    lock = RunLock(run_dir) if info.is_main else None
    announced = False
    while True:
        holder = lock.try_acquire() if lock is not None else None
        holder = broadcast_object(holder, info)
        if holder is None:
            return lock
        if not wait:
            lock_file = RunDir(run_dir).lock
            raise RunInUse(f"the run folder {run_dir} is in use by another launch of the same run: {holder} "
                           f"({lock_file}). Wait for it to end or stop it, or add runtime.wait_for_lock=true to wait "
                           f"for it. If that launch is gone (a crashed node), delete {lock_file}.")
        if info.is_main and not announced:
            log.info(f"[run] waiting for the run folder {run_dir}, in use by {holder}")
            announced = True
        if lock is not None:
            time.sleep(poll_s)


@contextlib.contextmanager
def experiment_lock(run_dir: Path, digest: str, info: DistInfo, poll_s: float = 0.1) -> Iterator[None]:
    """Hold the lock of one experiment (rank 0) while a launch picks the folder that holds it and takes that folder's
    lock: two launches of one experiment under two folder names (`deit3=baseline` and `recipe=deit3
    model=vit_base`), started before either made its folder, then train it once, in one folder."""
    lock, folder = None, run_dir.parent / EXPERIMENT_LOCKS / digest
    while info.is_main and lock is None:  # held for the moment a launch takes its folder's lock
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = RunLock(folder)
            if lock.try_acquire() is not None:
                lock = None
                if _held_folder(run_dir, digest):  # the folder is chosen: its own lock decides (stop or wait)
                    break
                time.sleep(poll_s)
        except FileNotFoundError:  # another launch removed the folder as it let go of it: make it again
            lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
            for empty in (folder, folder.parent):  # nothing stays behind but the run folders
                try:
                    empty.rmdir()
                except OSError:  # another launch holds it, or gone already
                    break


def _held_folder(run_dir: Path, digest: str) -> bool:
    """Whether a live launch holds the lock of this run's folder or of another folder of its experiment (the holder
    of the experiment's lock, between taking that lock and letting go of the experiment's, may be stopped there)."""
    folders = [run_dir, *run_dir.parent.glob(f"*-{digest}")]
    return any(live_holder(path) is not None for path in folders if path.is_dir())


def _started(run_dir: RunDir) -> bool:
    """Whether a launch has taken, trained or recorded the run folder (its lock, identity, checkpoint or result)."""
    return any(path.exists() for path in (run_dir.lock, run_dir.identity, run_dir.last_checkpoint, run_dir.result))


def experiment_folder(plan: RunPlan, info: DistInfo) -> RunPlan:
    """The plan in the folder that holds its experiment: one of another name (the same digest) that a launch has
    started, else its own. The folder Hydra made for this launch is then removed (it is empty)."""
    chosen = None
    if info.is_main:
        own = plan.run_dir.path
        started = [RunDir(path) for path in sorted(own.parent.glob(f"*-{plan.identity.digest}"))
                   if path != own and path.is_dir() and _started(RunDir(path))]
        chosen = str(started[0].path) if started else None
    chosen = broadcast_object(chosen, info)
    if chosen is None:
        return plan
    held = RunDir(Path(chosen))
    recorded = held.recorded_data() if info.is_main else None
    if recorded is not None and recorded.get("digest") != plan.data.get("digest"):
        raise ConfigError(f"{held.path} holds this experiment trained on other data: train this data under another "
                          f"output folder (runtime.output_root=...), or delete {held.path} to train it here.")
    if info.is_main:
        plan.run_dir.discard_if_empty()
        log.info(f"[run] this experiment's run is {held.path} (the same experiment, named by other overrides): "
                 "this launch continues it there")
    return replace(plan, run_dir=held, identity=replace(plan.identity, name=held.name))


@contextlib.contextmanager
def hold_run_folder(run_dir: Path, info: DistInfo, wait: bool) -> Iterator[None]:
    """Hold the run folder for this launch: its lock (rank 0) and this rank's log file there, to which the error
    or signal that stops the run is written too. First, every file of the run's there must be a regular file (a FIFO
    would block the launch)."""
    agree(info, RunDir(run_dir).check_files)
    lock = acquire_run_lock(run_dir, info, wait)
    handler = attach_run_log(RunDir(run_dir).rank_log(info.rank))
    try:
        for taken in lock.taken_over if lock is not None else ():
            log.warning(f"[run] took over the lock of {taken}")
        yield
    except (ConfigError, RunError) as error:
        file_only.error(f"error: {error}")
        raise
    except StopRequested as stopped:
        file_only.warning(f"[run] {stopped}")
        raise
    except RuntimeError as error:
        lost = stopped_by_peer(error, info)
        if lost is None:
            raise
        file_only.error(f"error: {lost}")
        raise lost from None
    finally:
        detach_run_log(handler)
        if lock is not None:
            lock.release()


def report_finished(plan: RunPlan, result: dict[str, Any]) -> None:
    """Say that the run is done already (and how to run it again); log it to wandb again if its log is gone."""
    name = plan.identity.name
    top1 = result.get("top1", float("nan"))
    top1_text = f"{top1:.2f}" if isinstance(top1, (int, float)) else repr(top1)  # a hand-edited result: as it is
    log.info(f"[run] {name}: already {result['status']} (top-1 {top1_text}); skipping."
             f" Delete {plan.run_dir.result} to run it again.")
    log_again_if_lost(plan, "is missing")
    before = trained_before(result)
    if before is not None:
        log.warning(f"[run] {name} was trained {before} (README, 'Random streams'). Its result is kept; delete "
                    f"{plan.run_dir.path} to train it again as the recipe now means.")


def record_launch(plan: RunPlan) -> None:
    """Save this launch's config, Hydra's settings and overrides in the run's `.hydra/` (Hydra writes none there:
    conf/config.yaml): for a launch that trains or records the run, never one that skips a finished run, whose
    records stay as the launch that trained it wrote them; a launch after the first is noted beside its records."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    settings = HydraConfig.instance().cfg if HydraConfig.initialized() else None  # {hydra: ...}, as Hydra saves it
    plan.run_dir.record_launch(OmegaConf.to_yaml(plan.declared),
                               None if settings is None else OmegaConf.to_yaml(settings),
                               None if settings is None else OmegaConf.to_yaml(settings.hydra.overrides.task),
                               at=time.strftime("%Y-%m-%dT%H:%M:%S"))


def record_identity(plan: RunPlan) -> None:
    """Write what this run is (its digest, its data and its teacher) into its folder, once."""
    plan.run_dir.record_identity(plan.identity, plan.data)


def record_result(plan: RunPlan, final: dict[str, Any]) -> None:
    """Write the run's result.json: its summary, under the run's name, wandb id, digest and data."""
    plan.run_dir.record_result(plan.identity, plan.data, final)


def log_again_if_lost(plan: RunPlan, what_happened: str) -> None:
    """A finished run whose wandb log is gone (the aggregator reads those logs): log its result.json and
    metrics.csv again, under the same wandb id, and say so."""
    runtime, identity, run_dir = plan.settings.runtime, plan.identity, plan.run_dir
    if runtime.tracking.mode == TrackingMode.disabled or wandb_logs(runtime.output_root, identity.run_id):
        return
    summary = wandb_summary(run_dir.read_summary())  # a measured sharpness as its three figures
    Tracker(plan.declared, identity, plan.data, enabled=True, run_dir=run_dir.path, write_csv=False).replay(
        read_epoch_rows(run_dir.metrics), summary)
    log.warning(f"[run] the wandb log of {identity.name} (id {identity.run_id}) under "
                f"{wandb_root(runtime.output_root)} {what_happened}: logged its result and epochs again from "
                f"{run_dir.result.name} and {run_dir.metrics.name}, so the aggregator sees the run.")


def record_without_training(plan: RunPlan, upstream: str, is_main: bool = True) -> dict[str, Any]:
    """A fine-tune stage whose pre-training diverged (a transfer whose source did): nothing to train from, logged
    with the same status."""
    final = {"status": upstream, "steps_done": 0, "epochs_done": 0, "train_seconds": 0.0,
             "note": (f"its source run ended as {upstream}; not transferred" if plan.is_transfer
                      else f"pre-training ended as {upstream}; not fine-tuned")}
    if not is_main:
        return final
    tracker = Tracker(plan.declared, plan.identity, plan.data, enabled=True, run_dir=plan.run_dir.path)
    tracker.summary(final)
    tracker.finish()
    record_identity(plan)
    record_result(plan, final)
    log.info(f"[run] {plan.identity.name}: {final['note']}.")
    return final


def resume_point(run_dir: RunDir, info: DistInfo) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint this launch resumes from (None for a fresh run): rank 0 picks the newest readable one,
    setting aside and reporting any it cannot read; every rank then loads that one."""
    found: list[ckpt.ResumePoint | None] = [None]

    def decide() -> str | None:
        found[0] = point = ckpt.find_resume_point(run_dir.path)
        if point is None:
            return None
        for error in point.unreadable:
            aside = ckpt.set_aside(error.path)
            log.warning(f"[run] {error.path.name} cannot be read ({error.reason}); set aside as {aside.name} "
                        f"(delete it when you no longer need it). Falling back to {point.path.name}, the copy "
                        "before it.")
        return str(point.path)

    path = agree(info, decide)
    if path is None:
        return None
    return Path(path), found[0].state if info.is_main else ckpt.load(path)


def _waits_for(plan: RunPlan, source: RunDir | None) -> LaunchAction | None:
    """What keeps the run from training now (its pre-training, its teacher run or its LayerScale run `source`), or
    None."""
    if plan.upstream is not None:
        upstream = previous_result(plan.upstream, is_main=False)
        role = upstream_role(plan.lineage)  # its pre-training, or a transfer's source run
        if upstream is None:
            return LaunchAction("wait", f"wait for {role} {plan.upstream.name}")
        if upstream["status"] != "finished":
            return LaunchAction("record", f"record as {upstream['status']} without training ({role} "
                                          f"{plan.upstream.name})")
    return _needed_run_line(plan.teacher_run, "its teacher run") or _needed_run_line(source, "its LayerScale run")


def _needed_run_line(run: RunDir | None, role: str) -> LaunchAction | None:
    """What a run that needs `run` (`role`: "its teacher run") to have finished does now: wait, refuse, or None."""
    result = previous_result(run, is_main=False) if run is not None else None
    if run is not None and result is None:
        return LaunchAction("wait", f"wait for {role} {run.name}")
    if result is not None and result["status"] != "finished":
        return LaunchAction("refuse", f"refuse ({role} {run.name} ended as {result['status']})")
    return None


def launch_action(plan: RunPlan) -> LaunchAction:
    """What launching this run would do now: skip, train, resume, or wait for the run it starts from. The dry run
    prints it (dry_run_line) and `deit-status` shows the state it implies (analysis/status/)."""
    source = plan.layer_scale_source
    result = previous_result(plan.run_dir, is_main=False)
    waiting = None if result is not None else _waits_for(plan, source)
    if waiting is not None:
        return waiting
    if result is not None:
        return skip_action(result)
    return folder_action(plan.run_dir, "train from step 0"
                         + (f", starting from {plan.upstream.name}" if plan.upstream is not None else "")
                         + (f", LayerScale diagonal fixed at the values of {source.name}" if source is not None
                            else ""))


def launch_plan(plan: RunPlan) -> str:
    """The dry run's words for launch_action."""
    return launch_action(plan).text


def dry_run_line(plan: RunPlan) -> str:
    """The dry run's line for one run: its folder, wandb id (or what it waits for) and what a launch would do."""
    pending = plan.identity.pending
    wandb_id = f"wandb id pending: keyed by {pending}" if pending else f"wandb id {plan.identity.run_id}"
    return f"[dry run] {plan.run_dir.name} ({wandb_id}): {launch_plan(plan)}"


def _declared_experiment(plan: RunPlan) -> dict[str, Any]:
    """What the run computes, as declared: its experiment without Hydra's choices and unread settings as set."""
    return experiment(plan.declared, stage_drop(str(plan.declared.stage)), canonical=False)


def same_computation_lines(plans: Sequence[RunPlan]) -> list[str]:
    """The dry run's line for each run of a sweep that computes the same as an earlier one (the same identity) though
    its overrides differ: which settings tell them apart and why no stage reads them (keys.UNREAD), or that the
    options compose the same experiment."""
    lines, seen = [], []
    for plan in plans:
        ours = _declared_experiment(plan)
        for other, theirs in seen:
            # the identity holds what any stage or teacher reads; the same overrides twice are one run
            if other.identity.digest != plan.identity.digest or set(other.overrides) == set(plan.overrides):
                continue
            why = same_computation(ours, theirs) or "the same experiment, composed from other options"
            if why:
                row, same_as = (",".join(sorted(set(a) - set(b))) or "(no override)"
                                for a, b in ((plan.overrides, other.overrides), (other.overrides, plan.overrides)))
                lines.append(f"[dry run] row {row} computes the same as row {same_as} ({why})")
                break
        seen.append((plan, ours))
    return lines
