"""The epoch loop: train an epoch, save it, evaluate it, log it; stop on a signal with a checkpoint; summarize.

The epoch's end is saved once, before its evaluation, so a stop during the evaluation loses no training; the
evaluation is not saved again (one full checkpoint write less per epoch): a launch that resumes from an epoch's end
evaluates that epoch first, the same weights giving the same numbers, and logs its row again. Rank 0 writes every
file; the other ranks follow it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from deit_ablate.core.distributed import DistInfo, barrier, gather_objects
from deit_ablate.core.logs import log
from deit_ablate.core.stopping import StopRequested, StopSignals, WorkerDeaths, WorkerLost
from deit_ablate.core.streams import RunStreams
from deit_ablate.data.bad_images import BadImageError, SkippingImageFolder, stop_error
from deit_ablate.data.loader import SkipFirst, build_train_loader, describe_lost_worker, lost_worker, seed_epoch_data
from deit_ablate.record import checkpoint as ckpt
from deit_ablate.record.predictions import LocalPredictions
from deit_ablate.record.progress import ProgressFile
from deit_ablate.record.tracking import Tracker
from deit_ablate.run.assemble import Pieces
from deit_ablate.run.plan import RunPlan
from deit_ablate.train.trainer import Diverged, evaluate


class RunClock:
    """Training seconds of the whole run: those of earlier launches (from the checkpoint) plus this one's."""

    def __init__(self, before: float = 0.0) -> None:
        self.before, self.started = before, time.perf_counter()

    def __call__(self) -> float:
        return self.before + time.perf_counter() - self.started


@dataclass
class Progress:
    """Where the run stands: the epoch to start from (and batches of it done), the best top-1, the last metrics."""

    start_epoch: int = 0
    skip_batches: int = 0
    best_top1: float = 0.0
    epochs_done: int = 0
    status: str = "finished"
    seconds: float = 0.0  # training seconds of all launches together
    metrics: dict[str, float] = field(default_factory=dict)
    ema_metrics: dict[str, float] = field(default_factory=dict)
    bad_images: set[str] = field(default_factory=set)
    resumed_from: Path | None = None  # the checkpoint this launch resumed from
    predictions: LocalPredictions | None = None  # this rank's share of the last evaluation's headline predictions
    predicted_by: str = "model"  # whose they are: "model", or "ema" when the EMA's top-1 is the headline


def _unwrapped(dataset):
    """The dataset under its wrappers (teacher_cache.WithIndex, data.fraction's subset: each holds `.dataset`)."""
    while hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset


def image_folders(pieces: Pieces) -> list[SkippingImageFolder]:
    """The run's datasets that watch for unreadable images."""
    sets = (pieces.loaders.train_set, pieces.loaders.val_loader.dataset)
    sets = tuple(_unwrapped(d) for d in sets)
    return [d for d in sets if isinstance(d, SkippingImageFolder)]


class StartedEpoch:
    """An epoch's batches whose loader workers have started already: they fill their queues while the epoch before
    is evaluated, so its first step does not wait for worker start-up and first batches."""

    def __init__(self, epoch: int, loader: DataLoader) -> None:
        self.epoch, self.loader, self.batches = epoch, loader, iter(loader)

    def __iter__(self):
        return self.batches

    def __len__(self) -> int:
        return len(self.loader)


class EpochLoop:
    """The epochs a launch trains (or, when training is already complete, only the final evaluation)."""

    def __init__(self, plan: RunPlan, info: DistInfo, pieces: Pieces, streams: RunStreams, tracker: Tracker,
                 stop: StopSignals, state: dict[str, Any], progress: Progress) -> None:
        self.plan, self.info, self.pieces, self.streams = plan, info, pieces, streams
        self.tracker, self.stop = tracker, stop
        self.trainer, self.progress, self.resumed_state = pieces.trainer, progress, state
        self.clock = RunClock(float(state.get("train_seconds", 0.0)))
        self.max_steps = plan.settings.train.max_steps
        self.record = self.progress_file()  # progress.json, for a reader outside the run (deit-status)
        self.current_epoch = progress.start_epoch
        self.worker_deaths = WorkerDeaths()
        self.started: StartedEpoch | None = None
        self.batches_in_loader: int | None = None  # of the epoch training now (None between epochs)
        runtime, run_dir = plan.settings.runtime, plan.run_dir
        self.saver = ckpt.MidEpochSaver(self.trainer, run_dir.last_checkpoint, runtime.checkpoint_every_steps,
                                        runtime.checkpoint_every_minutes, info.is_main,
                                        keep_previous=run_dir.previous_checkpoint, extra=self.mid_epoch_extra,
                                        ready=lambda: self.trainer.losses.readable())

    def progress_file(self) -> ProgressFile:
        """The launch's progress.json (record/progress.py), written by rank 0."""
        steps = self.pieces.loaders.steps_per_epoch * self.plan.recipe.epochs
        total = steps if self.max_steps is None else min(steps, self.max_steps)
        return ProgressFile(self.plan.run_dir, total, self.plan.recipe.epochs, self.plan.recipe.global_batch,
                            self.info.world_size, self.clock, enabled=self.info.is_main)

    def extra(self, complete: bool = False) -> dict[str, Any]:
        """What a checkpoint holds beside the training state: the clock, completion and the unreadable images."""
        return {"train_seconds": self.clock(), "training_complete": complete,
                "bad_images": sorted(self.progress.bad_images)}

    def mid_epoch_extra(self) -> dict[str, Any]:
        """What a mid-epoch checkpoint holds beside `extra`: the loss sum of the epoch's batches so far, over every
        rank's images, so that a resume on any layout logs the whole epoch's mean (at an epoch's last batch,
        resumed with no batch left, it logged 0.0)."""
        return {**self.extra(), "epoch_loss_sum": self.trainer.losses.epoch_sum()}

    def run(self) -> Progress:
        """Train the epochs left and evaluate each; the progress at the end (status `diverged` on divergence)."""
        progress, state = self.progress, self.resumed_state
        self.record.start(progress.start_epoch, self.trainer.step)
        with self.worker_deaths:  # a loader worker's death is raised between steps only (core/stopping.py)
            try:
                if state.get("evaluated") is False and not progress.skip_batches and \
                        progress.start_epoch < self.plan.recipe.epochs:  # resumed from an epoch's end: evaluate it
                    row = {"train/epoch_loss": state["train_loss"]} if state.get("train_loss") is not None else {}
                    self.evaluate_epoch(progress.start_epoch - 1, row, progress.resumed_from)
                for epoch in range(progress.start_epoch, self.plan.recipe.epochs):
                    if self.max_steps is not None and self.trainer.step >= self.max_steps:
                        break
                    self.epoch(epoch)
                if not progress.metrics:  # relaunched after the final checkpoint: training complete, evaluation not
                    if self.info.is_main:
                        log.info(f"[run] training was complete at step {self.trainer.step} (epoch "
                                 f"{progress.epochs_done}); evaluating the final weights")
                    self.evaluate_now()
            except Diverged as diverged:
                progress.status = "diverged"
                if self.info.is_main:
                    log.info(f"[run] {self.plan.identity.name} diverged: {diverged}. Recorded as a result; the "
                             "sweep goes on.")
            except BadImageError:
                raise stop_error(image_folders(self.pieces)) from None
            except (RuntimeError, EOFError, ConnectionError) as error:
                if not lost_worker(error):
                    raise
                if self.stop.requested is None:
                    lost = describe_lost_worker(error)
                    if lost is None:  # a connection error that no worker's death explains
                        raise
                    raise self.lost_worker_without_stop(lost) from None
                raise self.stopped_without_worker(error) from None
        progress.seconds = self.clock()
        return progress

    def epoch_batches(self, epoch: int):
        """This epoch's batches: those started during the last evaluation, or the loader now."""
        started, self.started = self.started, None
        return started if started is not None and started.epoch == epoch else self.epoch_loader(epoch)

    def start_early(self, epoch: int) -> None:
        """Start `epoch`'s loader workers now (seeded as at the epoch's start: the same batches), when it has any."""
        loaders = self.pieces.loaders
        if isinstance(loaders.train_loader, DataLoader) and loaders.train_loader.num_workers > 0:
            seed_epoch_data(loaders.train_sampler, loaders.train_loader, self.streams, epoch)
            self.started = StartedEpoch(epoch, loaders.train_loader)

    def epoch_loader(self, epoch: int):
        """This epoch's loader, seeded: the permutation and each sample's augmentation (streams.py); a resumed
        epoch skips the batches done before the stop (and draws the rest exactly as it would have)."""
        loaders, per_rank = self.pieces.loaders, self.plan.batch.per_rank_batch
        loader = loaders.train_loader
        if epoch == self.progress.start_epoch and self.progress.skip_batches:  # resumed mid-epoch (preemption)
            sampler = SkipFirst(loaders.train_sampler, self.progress.skip_batches * per_rank)
            loader = build_train_loader(loaders.train_set, sampler, per_rank, self.plan.transforms,
                                        self.plan.settings.runtime, self.info.device,
                                        erasing=loaders.batch_transform.erasing)
        seed_epoch_data(loaders.train_sampler, loader, self.streams, epoch)
        return loader

    def epoch(self, epoch: int) -> None:
        """Train one epoch, save its end, evaluate it; stop at an agreed signal between the two."""
        progress, trainer = self.progress, self.trainer
        self.current_epoch = epoch
        loader = self.epoch_batches(epoch)
        skipped = progress.skip_batches if epoch == progress.start_epoch else 0
        self.saver.start_epoch(epoch, progress.best_top1, skipped)
        steps_before = trainer.step
        resumed_sum = self.resumed_state.get("epoch_loss_sum") if skipped else None  # None: before it was kept
        before = (float(resumed_sum), skipped) if resumed_sum is not None else (0.0, 0)
        self.batches_in_loader = 0  # a stop in the epoch saves its steps so far; None: the epoch's end is saved
        train_loss = trainer.train_steps(loader, epoch, self.max_steps, step_hook=self.step_hook,
                                         streams=self.streams, first_step=skipped, done=before)
        self.batches_in_loader = None
        batches_done = skipped + trainer.step - steps_before
        if not before[1] and trainer.step == steps_before:  # no batch of the epoch counted: no loss to log
            train_loss = None
        complete = batches_done >= self.pieces.loaders.steps_per_epoch  # train.max_steps may stop it part-way
        progress.epochs_done = epoch + 1 if complete else epoch
        done = progress.epochs_done >= self.plan.recipe.epochs or \
            (self.max_steps is not None and trainer.step >= self.max_steps)
        if self.info.is_main:  # the epoch's end is saved before its evaluation: a stop there loses no training
            state = ckpt.training_state(trainer, progress.epochs_done, progress.best_top1,
                                        0 if complete else batches_done, evaluated=False, train_loss=train_loss,
                                        **self.extra(done), epoch_loss_sum=trainer.losses.epoch_sum())
            ckpt.save_atomic(state, self.plan.run_dir.last_checkpoint,
                             keep_previous=self.plan.run_dir.previous_checkpoint)
        self.stop_if_asked()
        if not done:
            self.start_early(epoch + 1)
        row = {"train/epoch_loss": train_loss} if train_loss is not None else {}
        self.evaluate_epoch(epoch, row, self.plan.run_dir.last_checkpoint)
        self.stop_if_asked()

    def step_hook(self, batches_in_loader: int) -> None:
        """After each optimizer step: the mid-epoch checkpoint when due, and a stop when one is agreed."""
        self.batches_in_loader = batches_in_loader
        self.worker_deaths.check()  # before this step is saved: a worker that died during it ends the run here
        if self.saver.by_steps():  # on every rank: the checkpoint keeps the loss summed over the ranks
            self.trainer.losses.reduce()
        self.saver(batches_in_loader)
        self.record.step(self.current_epoch, self.trainer.step)
        self.stop_if_asked(self.trainer.step, batches_in_loader)

    def stopped_without_worker(self, error: Exception) -> StopRequested:
        """The stop when a loader worker was killed while it was pending (a SIGKILL to the process group after its
        SIGTERM): the steps done this epoch saved (an epoch's end is saved already), no traceback."""
        if self.batches_in_loader is not None:
            self.saver.save(self.batches_in_loader)
        if self.info.is_main:
            said = str(error).strip().splitlines() or [type(error).__name__]  # the resource sharer's EOFError: ''
            log.info(f"[run] a loader worker ended during the stop ({said[0]})")
        return StopRequested(self.stop.requested, f"at step {self.trainer.step}; the same command resumes it from "
                                                  f"{self.plan.run_dir.last_checkpoint}")

    def lost_worker_without_stop(self, lost: str) -> WorkerLost:
        """A loader worker killed with no stop pending (the kernel's out-of-memory killer sends SIGKILL): the steps
        done this epoch saved (an epoch's end is saved already), and one line naming the worker and its signal."""
        if self.batches_in_loader is not None:
            self.saver.save(self.batches_in_loader)
        return WorkerLost(f"{lost} at step {self.trainer.step}, with no stop asked (the "
                          "kernel's out-of-memory killer sends SIGKILL: lower runtime.num_workers or what the run "
                          f"holds in memory); step {self.trainer.step} is saved and the same command resumes the run "
                          f"from {self.plan.run_dir.last_checkpoint}")

    def stop_if_asked(self, step: int | None = None, batches_in_loader: int | None = None) -> None:
        """Stop on an agreed signal: save the mid-epoch state first (the epoch-end one is written already)."""
        signum = self.stop.agreed(step)
        if signum is None:
            return
        if batches_in_loader is not None:
            self.trainer.losses.reduce()  # every rank stops here: the checkpoint keeps the loss summed over them
            self.saver.save(batches_in_loader)
        barrier(self.info)
        raise StopRequested(signum, f"at step {self.trainer.step}; the same command resumes it from "
                                    f"{self.plan.run_dir.last_checkpoint}")

    def evaluate_now(self) -> float:
        """Evaluate the model (and its EMA), collect unreadable images; the headline top-1 (EMA's when kept).
        The headline weights' predicted classes are kept too (argmax of scores computed anyway; on the device)."""
        progress, trainer = self.progress, self.trainer
        settings = (self.pieces.loaders.val_loader, trainer.info, trainer.amp_dtype,
                    None, self.plan.settings.distill.fusion)  # train.eval_max_images: the loader's images
        progress.predictions = LocalPredictions()
        progress.predicted_by = "model" if trainer.ema is None else "ema"
        model_kept = progress.predictions if trainer.ema is None else None
        progress.metrics = evaluate(trainer.model, *settings, predictions=model_kept)
        progress.ema_metrics = (evaluate(trainer.ema.module, *settings, predictions=progress.predictions)
                                if trainer.ema is not None else {})
        self.collect_bad_images()
        return progress.ema_metrics["top1"] if progress.ema_metrics else progress.metrics["top1"]

    def evaluate_epoch(self, epoch: int, row: dict[str, Any], saved: Path | None) -> None:
        """Evaluate the weights at an epoch's end (saved in `saved`), log the epoch, keep the best checkpoint."""
        progress, run_dir = self.progress, self.plan.run_dir
        headline = self.evaluate_now()
        progress.best_top1 = max(progress.best_top1, headline)
        self.record.evaluated(epoch, self.trainer.step, headline, progress.best_top1)
        metrics, ema_metrics = progress.metrics, progress.ema_metrics
        self.tracker.log({"epoch": epoch, **row, **{f"val/{k}": v for k, v in metrics.items()},
                          **{f"val_ema/{k}": v for k, v in ema_metrics.items()}}, self.trainer.step)
        if self.info.is_main:
            ema_text = f", EMA top-1 {ema_metrics['top1']:.2f}" if ema_metrics else ""
            loss_text = f"train loss {row['train/epoch_loss']:.4f} | " if row else ""
            log.info(f"[epoch {epoch + 1}] {loss_text}val top-1 {metrics['top1']:.2f} "
                     f"top-5 {metrics['top5']:.2f}{ema_text} | step {self.trainer.step}")
            if headline >= progress.best_top1 and saved is not None:  # copied, not serialized again
                ckpt.copy_atomic(saved, run_dir.best_checkpoint)
        barrier(self.info)

    def collect_bad_images(self) -> None:
        """Name in the log each unreadable image found since the last call (any rank's)."""
        local = [path for dataset in image_folders(self.pieces) for path in dataset.newly_bad()]
        everyone = set().union(*gather_objects(local, self.info))
        for path in sorted(everyone - self.progress.bad_images) if self.info.is_main else local:
            log.warning(f"[data] unreadable image {path}: the next readable image takes its place "
                        "(runtime.on_bad_image=fail stops instead)")  # rank 0's log names every rank's
        self.progress.bad_images |= everyone
