"""One training run, top to bottom: resolve the plan, take the run folder, skip or resume, train, record.

    run(cfg)            plan.make_plan: identity, data, batch, recipe -- every input error raised here
      lock + log        lifecycle.acquire_run_lock, logs.attach_run_log (rank 0 holds the folder)
      _run_locked       a finished run is skipped; a fine-tune of a diverged pre-training is recorded as such
        _train          assemble.build_pieces, resume, loop.EpochLoop, report.summarize, result.json
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from omegaconf import DictConfig

from deit_ablate.config.stage_config import stage_changes
from deit_ablate.core.distributed import (
    DistInfo,
    agree,
    broadcast_object,
    cleanup,
    init_distributed,
    placement,
    stopped_by_peer,
)
from deit_ablate.core.errors import ConfigError
from deit_ablate.core.logs import log
from deit_ablate.core.stopping import StopRequested, StopSignals
from deit_ablate.core.streams import STREAMS_VERSION, RunStreams
from deit_ablate.data.loader import end_all_workers
from deit_ablate.record import checkpoint as ckpt
from deit_ablate.record.identity import current_run_dir
from deit_ablate.record.predictions import INDEX, compact, gather_in_order
from deit_ablate.record.rundir import DATA, RunDir
from deit_ablate.record.tracking import Tracker
from deit_ablate.run.assemble import Pieces, build_pieces, set_cpu_threads
from deit_ablate.run.lifecycle import (
    experiment_folder,
    experiment_lock,
    hold_run_folder,
    log_again_if_lost,
    previous_result,
    record_identity,
    record_launch,
    record_result,
    record_without_training,
    report_finished,
    resume_point,
)
from deit_ablate.run.loop import EpochLoop, Progress, image_folders
from deit_ablate.run.measure_sharpness import measure_weights
from deit_ablate.run.plan import RunPlan, make_plan
from deit_ablate.run.report import fusion_figures, print_summary, summarize, wandb_summary
from deit_ablate.run.stages import changes_line, compared_config, upstream_status
from deit_ablate.run.teacher import log_teacher, teacher_summary
from deit_ablate.train.models import architecture, describe_architecture
from deit_ablate.train.sharpness import figures_text


def discard_empty_run_dir() -> None:
    """Remove the run folder Hydra made for a run that failed before writing anything of its own."""
    RunDir(current_run_dir()).discard_if_empty()


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Train one run to the end (or to divergence) and return its summary; rank 0 writes everything, holding
    the run folder's lock, and every rank logs to its own file there."""
    if cfg.runtime.dry_run:  # planned and stopped by the launch checks (preflight.py): a dry run never trains
        raise ConfigError("runtime.dry_run=true reached the training run: a dry run writes nothing, so it was "
                          "stopped here. Launch it through train.py, whose checks plan dry runs")
    info = init_distributed(cfg.runtime.device)
    try:
        with StopSignals(info, cfg.runtime.log_interval) as stop, contextlib.ExitStack() as held:
            plan = make_plan(cfg, info)  # from the start of StopSignals: a stop before training says so
            with experiment_lock(plan.run_dir.path, plan.identity.digest, info):
                plan = experiment_folder(plan, info)
                held.enter_context(hold_run_folder(plan.run_dir.path, info, plan.settings.runtime.wait_for_lock))
            return _run_locked(plan, info, stop)
    except RuntimeError as error:
        lost = stopped_by_peer(error, info)  # before the folder is held (its file has it otherwise)
        if lost is None:
            raise
        raise lost from None
    finally:
        cleanup(info)


def _run_locked(plan: RunPlan, info: DistInfo, stop: StopSignals) -> dict[str, Any] | None:
    """What run() does while holding the run folder: skip a finished run, or train (resuming) to the end."""
    if info.is_main:
        for path in ckpt.remove_stale_temp_files(plan.run_dir.path):
            log.info(f"[run] removed {path.name}, left by a launch stopped while writing it")
    result = previous_result(plan.run_dir, info.is_main)
    if result is not None:
        if info.is_main:
            report_finished(plan, result)
        return result
    upstream = upstream_status(plan.lineage, plan.upstream) if plan.is_finetune or plan.is_transfer else "finished"
    if info.is_main:
        record_launch(plan)
    if upstream != "finished":
        return record_without_training(plan, upstream, info.is_main)
    return _train(plan, info, stop)


def _resume(plan: RunPlan, info: DistInfo, pieces: Pieces) -> tuple[Progress, dict[str, Any]]:
    """Where this launch starts: its last checkpoint's state (restored into the trainer), or the beginning."""
    resumed = resume_point(plan.run_dir, info)
    if resumed is None:
        return Progress(), {}
    resumed_from, state = resumed
    trainer = pieces.trainer
    start_epoch, best_top1, skip_batches = ckpt.restore(trainer, state)
    for dataset in image_folders(pieces):
        dataset.mark_bad(state.get("bad_images", ()))
    where = "" if info.is_main else f" (rank {info.rank} on {info.host})"  # each rank's file says it resumed
    log.info(f"[run] resuming {plan.identity.name} from {resumed_from}: epoch {start_epoch + 1} (batch "
             f"{skip_batches}), step {trainer.step}{where}")
    progress = Progress(start_epoch=start_epoch, skip_batches=skip_batches, best_top1=best_top1,
                        epochs_done=start_epoch, bad_images=set(state.get("bad_images", ())), resumed_from=resumed_from)
    return progress, state


def _train(plan: RunPlan, info: DistInfo, stop: StopSignals) -> dict[str, Any]:
    """Build, resume, train and evaluate; record the result (rank 0) and return it on every rank."""
    streams = RunStreams(plan.settings.seed, info.rank)
    streams.seed_init()  # the same initial weights on every rank
    set_cpu_threads(plan.settings.runtime, info.device)
    pieces = build_pieces(plan, info)  # every input error is raised by now, before anything is logged
    try:
        return _train_built(plan, info, pieces, streams, stop)
    finally:
        # every loader of the run (training, evaluation, a resumed epoch's, the teacher cache's): they sit in reference
        # cycles, and a sweep's next run, in this process, would start beside their workers
        end_all_workers()


def _train_built(plan: RunPlan, info: DistInfo, pieces: Pieces, streams: RunStreams,
                 stop: StopSignals) -> dict[str, Any]:
    """`_train` once its pieces are built."""
    progress, state = _resume(plan, info, pieces)
    tracker = Tracker(plan.declared, plan.identity, plan.data, enabled=info.is_main, run_dir=plan.run_dir.path)
    if info.is_main:
        record_identity(plan)
    pieces.trainer.on_log = tracker.log
    loop: EpochLoop | None = None
    try:
        run_facts = _start_line(plan, info, pieces, tracker)
        stop.before_training(progress.resumed_from)
        loop = EpochLoop(plan, info, pieces, streams, tracker, stop, state, progress)
        progress = loop.run()
    except BaseException as error:
        with contextlib.suppress(Exception):
            tracker.finish(exit_code=1)
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.record.end(*ended_as(error, pieces.trainer.step))
        raise
    final = _final_summary(plan, pieces, progress, run_facts)
    sharpness = _sharpness_at_end(plan, info, pieces, progress.status)
    if sharpness is not None:
        final["sharpness"] = sharpness  # result.json keeps it with its settings; wandb, the three figures
    predictions = _gathered_predictions(plan, info, pieces, progress)
    tracker.summary(wandb_summary(final))
    tracker.finish(exit_code=0)
    if info.is_main:
        if predictions is not None:  # before result.json: a finished run has both
            plan.run_dir.write_predictions(*predictions)
        record_result(plan, final)
        loop.record.end(progress.status, pieces.trainer.step)
        log_again_if_lost(plan, "was removed while the run trained")
        print_summary(plan.identity.name, plan.identity.run_id, final, plan.run_dir.path)
    return broadcast_object(final, info)


def ended_as(error: BaseException, step: int) -> tuple[str, int, str]:
    """How a launch stopped by `error` at `step` ends in progress.json: `stopped` by a signal (a relaunch resumes
    it), or `failed`, each with the error's first line."""
    line = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, (StopRequested, KeyboardInterrupt)):
        return "stopped", step, line or type(error).__name__
    return "failed", step, f"{type(error).__name__}: {line}" if line else type(error).__name__


def _gathered_predictions(plan: RunPlan, info: DistInfo, pieces: Pieces,
                          progress: Progress) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A finished run's final predictions in dataset order and their record, on rank 0 (None elsewhere, and for a
    run that did not finish); every rank takes part in the gather."""
    if progress.status != "finished" or progress.predictions is None:
        return None
    val_loader = pieces.loaders.val_loader
    arrays = gather_in_order(progress.predictions, val_loader, info)
    if arrays is None:
        return None
    record = {"run_id": plan.identity.run_id, "name": plan.identity.name, DATA: dict(plan.data), "split": "val",
              "split_images": len(val_loader.dataset), "images": int(arrays[INDEX].size),
              "checkpoint": plan.run_dir.last_checkpoint.name, "weights": progress.predicted_by,
              "step": pieces.trainer.step, "epochs_done": progress.epochs_done, "model_name": plan.model_name,
              "fusion": plan.settings.distill.fusion if "fused" in arrays else None,
              "top1": progress.ema_metrics.get("top1", progress.metrics.get("top1"))}
    return compact(arrays), record


def _sharpness_at_end(plan: RunPlan, info: DistInfo, pieces: Pieces, status: str) -> dict[str, Any] | None:
    """sharpness.at_end=true: the sharpness of the final weights of a finished run (sharpness/measure.py), measured
    on rank 0 alone while the others wait for its figures; None otherwise."""
    if not plan.settings.sharpness.at_end or status != "finished":
        return None

    def measure_on_rank_0() -> dict[str, Any] | None:
        log.info("[run] measuring the sharpness of the final weights (sharpness.at_end=true)")
        try:
            record = measure_weights(plan.settings, pieces.trainer.module.state_dict(), info.device)
        except Exception as error:  # noqa: BLE001 - an evaluation failing (memory) must not cost the run its result
            log.warning(f"[run] sharpness not measured ({type(error).__name__}: {str(error)[:200]}); the run is "
                        f"recorded without it. Measure it later: python -m deit_ablate.sharpness {plan.run_dir.path}"
                        " (--batch-size lower for less memory)")
            return None
        log.info(f"[run] sharpness:\n{figures_text(record)}")
        return record

    return agree(info, measure_on_rank_0)


def _start_line(plan: RunPlan, info: DistInfo, pieces: Pieces, tracker: Tracker) -> dict[str, Any]:
    """Say what trains (architecture as built, batch split, length, lr, device) and put it in the wandb summary;
    the facts the result keeps too."""
    trainer, batch, recipe, cfg = pieces.trainer, plan.batch, plan.recipe, plan.settings
    arch = architecture(trainer.model, plan.model_name)  # what was built, not what the config names
    if info.is_main:
        log_teacher(plan.identity.teacher)
        log.info(f"[run] {plan.identity.name}: {cfg.stage} at {cfg.resolution.train_size}px of "
                 f"{describe_architecture(arch)}{'' if recipe.train_mode else ' (in eval mode)'}, world size "
                 f"{info.world_size}, global batch {recipe.global_batch} = {batch.slots} micro-batches of "
                 f"{batch.micro_batch} (virtual slots), {batch.accum_steps} per rank and step"
                 + (f" in {batch.split} passes each" if batch.split > 1 else "") + ", "
                 f"{pieces.loaders.steps_per_epoch} steps/epoch, {recipe.epochs} epochs, "
                 f"lr {trainer.optimizer.param_groups[0]['lr']:.2e} at step {trainer.step}, device {info.device}"
                 + f", {torch.get_num_threads()} torch thread(s)")
        compared = compared_config(plan.lineage)
        changes = changes_line(plan.lineage, stage_changes(plan.declared if compared is None else compared, cfg))
        if changes:
            log.info(f"[run] {changes}")
    facts = {"nodes": placement(info), "model_name": plan.model_name, "architecture": arch}  # host -> ranks
    tracker.summary({"world_size": info.world_size, "per_device_batch": batch.per_rank_batch,
                     "micro_batch": batch.micro_batch, "accum_steps": batch.accum_steps, "slots": batch.slots,
                     "effective_batch": recipe.global_batch, **facts})
    return facts


def _final_summary(plan: RunPlan, pieces: Pieces, progress: Progress, facts: dict[str, Any]) -> dict[str, Any]:
    """The run's summary with what it was run as: model, teacher, nodes, streams, LayerScale source, fp16 skips."""
    trainer = pieces.trainer
    final = summarize(progress.status, progress.metrics, progress.ema_metrics, progress.best_top1,
                      progress.epochs_done, trainer.step, progress.seconds)
    final.update(model_name=facts["model_name"], architecture=facts["architecture"])
    if "top1_fused" in final:  # the stage's rule (a fine-tune's finetune.overrides may set another)
        final.update(fusion_figures(final, str(plan.settings.distill.fusion)))
    if plan.identity.teacher is not None:
        final["teacher"] = teacher_summary(plan.identity.teacher)
    final["nodes"] = facts["nodes"]
    final["streams"] = STREAMS_VERSION
    if pieces.layer_scale_from is not None:
        final["layer_scale_from"] = pieces.layer_scale_from
    if pieces.transfer_from is not None:
        final["transfer_from"] = pieces.transfer_from
    if trainer.scaler is not None:
        final["amp_skipped_steps"] = trainer.amp_skipped_steps
    if progress.bad_images or image_folders(pieces):
        final["data/bad_images"] = len(progress.bad_images)
    return final
