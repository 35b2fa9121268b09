"""One training run: build the pieces from the config, resume if a checkpoint exists, train, evaluate, log."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from timm.utils import ModelEmaV3

from deit_ablate import checkpoint as ckpt
from deit_ablate.data.bad_images import BadImageError, SkippingImageFolder, stop_error
from deit_ablate.data.datasets import build_dataset, data_fingerprint, dataset_root, describe_data
from deit_ablate.data.loader import (
    ShardSampler,
    SkipFirst,
    build_loader,
    build_train_loader,
    build_train_sampler,
    seed_epoch_data,
)
from deit_ablate.data.transforms import build_eval_transform, build_train_pipeline
from deit_ablate.distributed import (
    DistInfo,
    barrier,
    broadcast_object,
    cleanup,
    gather_objects,
    init_distributed,
    placement,
)
from deit_ablate.engine import Diverged, Trainer, evaluate
from deit_ablate.errors import ConfigError, RunError
from deit_ablate.identity import (
    RunIdentity,
    composed_choices,
    current_run_dir,
    identity_from_hydra,
    run_identity,
    with_data,
)
from deit_ablate.logs import attach_run_log, detach_run_log, file_only, log
from deit_ablate.losses import TOKEN_KINDS, DistillationLoss
from deit_ablate.mixing import build_criterion, build_mixup
from deit_ablate.models import architecture, build_model, compile_in_place, describe_architecture, student_model_name
from deit_ablate.optim import build_optimizer, build_scheduler, scaled_lr
from deit_ablate.rundir import RunDir
from deit_ablate.runlock import LOCK_NAME, RunLock
from deit_ablate.stages import (
    StageRecipe,
    fix_layer_scale,
    layer_scale_run_dir,
    load_pretrained,
    pretrain_run_dir,
    pretrain_status,
    stage_recipe,
)
from deit_ablate.stopping import StopRequested, StopSignals
from deit_ablate.streams import STREAMS_VERSION, RunStreams, copies_augmented_alike
from deit_ablate.teacher import build_teacher, log_teacher, teacher_forward, teacher_summary, with_run_teacher
from deit_ablate.tracking import Tracker, read_epoch_rows, wandb_logs
from deit_ablate.validate import BatchPlan, plan_batch, validate_config


def amp_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU under `auto`, full precision on CPU; fp16 under `fp16` (with grad_scaler's scaler)."""
    if setting == "fp16":
        return torch.float16
    if setting == "bf16" or (setting == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def grad_scaler(setting: str, device: torch.device) -> torch.amp.GradScaler | None:
    """The dynamic loss scaler of `fp16` (torch's defaults: 2**16, halved on a skipped step, doubled after 2000
    good ones); None for every other precision."""
    return torch.amp.GradScaler(device.type) if setting == "fp16" else None


def set_cpu_threads(threads: int | None, device: torch.device) -> None:
    """Hold torch to `threads` intra-op threads on a CPU run (None keeps torch's default)."""
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)


@dataclass
class Pieces:
    """Everything a run builds before its first step."""

    trainer: Trainer
    train_loader: Any
    train_sampler: Any
    val_loader: Any
    steps_per_epoch: int
    recipe: StageRecipe
    plan: BatchPlan
    streams: RunStreams
    layer_scale_from: dict[str, str] | None = None  # the run whose learned LayerScale diagonal it fixes


def build_pieces(cfg: DictConfig, info: DistInfo, plan: BatchPlan) -> Pieces:
    """Data, model, optimizer, schedule and loss for this stage of the run."""
    recipe = stage_recipe(cfg)
    # the first rank of every node draws the built-in set if its cache lacks it (a node-local cache is filled
    # on each node; on a shared file system the second finds it there or loses the atomic rename harmlessly)
    root = dataset_root(cfg) if info.local_rank == 0 else None
    barrier(info)
    root = dataset_root(cfg) if root is None else root
    train_transform, batch_transform = build_train_pipeline(cfg)
    train_set = build_dataset(cfg, "train", train_transform, root)
    val_set = build_dataset(cfg, "val", build_eval_transform(cfg), root)
    train_sampler = build_train_sampler(train_set, cfg.augment.repeated_aug, info.world_size, info.rank)
    train_loader = build_train_loader(train_set, train_sampler, plan.per_rank_batch, cfg, info.device)
    val_sampler = ShardSampler(len(val_set), info.world_size, info.rank)
    val_loader = build_loader(val_set, val_sampler, cfg.runtime.eval_batch, cfg, train=False)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ConfigError(f"an epoch of {len(train_sampler)} images per rank holds no full batch of "
                          f"{plan.per_rank_batch}; lower train.global_batch or use more data.")

    model_name = student_model_name(cfg)
    model = build_model(cfg.model, cfg.data.num_classes, cfg.resolution.train_size, name=model_name).to(info.device)
    if recipe.init_checkpoint is not None:
        load_pretrained(model, recipe.init_checkpoint)
        if info.is_main:
            log.info(f"[run] fine-tuning from {recipe.init_checkpoint}")
    layer_scale = fix_layer_scale(model, cfg)
    if layer_scale is not None and info.is_main:
        log.info(f"[run] LayerScale diagonal fixed at the values the run {layer_scale['run']} learned "
                 f"(digest {layer_scale['digest']})")
    if info.enabled:
        ddp_device = [info.device.index] if info.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ddp_device)
    module = model.module if info.enabled else model

    lr = scaled_lr(recipe.lr, recipe.global_batch, cfg.optimizer.lr_base_batch)
    optimizer = build_optimizer(module, recipe.optimizer, lr, recipe.weight_decay, cfg.optimizer.momentum,
                                tuple(cfg.optimizer.betas), cfg.optimizer.eps)
    scheduler = stage_scheduler(optimizer, recipe, steps_per_epoch)
    mixup = build_mixup(cfg.mix, cfg.data.num_classes)
    criterion = build_criterion(cfg.mix, mixup)
    ema = ModelEmaV3(module, decay=cfg.train.ema_decay) if cfg.train.ema else None  # starts from the loaded weights
    if cfg.runtime.compile:
        compile_in_place(module)  # after the EMA copy, which is only evaluated and stays eager

    loss_fn = build_loss_fn(cfg, module, criterion, info.device)

    trainer = Trainer(model=model, optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn, info=info,
                      accum_steps=plan.accum_steps, mixup=mixup, ema=ema, batch_transform=batch_transform,
                      train_mode=recipe.train_mode,
                      amp_dtype=amp_dtype(cfg.train.amp, info.device), scaler=grad_scaler(cfg.train.amp, info.device),
                      clip_grad=cfg.optimizer.clip_grad, log_interval=cfg.runtime.log_interval)
    return Pieces(trainer, train_loader, train_sampler, val_loader, steps_per_epoch, recipe, plan,
                  RunStreams(cfg.seed, info.rank), layer_scale)


def stage_scheduler(optimizer: torch.optim.Optimizer, recipe: StageRecipe, steps_per_epoch: int):
    """The stage's warm-up + cosine schedule in optimizer updates (train.max_steps never shortens it)."""
    total_steps = recipe.epochs * steps_per_epoch
    warmup_steps = min(round(recipe.warmup_epochs * steps_per_epoch), max(total_steps - 1, 0))
    return build_scheduler(optimizer, total_steps, warmup_steps, recipe.min_lr, recipe.warmup_lr)


def build_loss_fn(cfg: DictConfig, model: torch.nn.Module, criterion: torch.nn.Module, device: torch.device):
    """The loss of one (mixed) batch: the class criterion, plus the teacher's term when distilling."""
    if cfg.distill.type == "none":
        return lambda images, outputs, targets: criterion(outputs, targets)
    teacher = build_teacher(cfg, device)
    distill_loss = DistillationLoss(criterion, cfg.distill.type, cfg.distill.alpha, cfg.distill.tau,
                                    cfg.distill.kl_normalization)
    if hasattr(model, "set_distilled_training"):
        model.set_distilled_training(cfg.distill.type in TOKEN_KINDS)
    # The teacher sees exactly the student's batch: augmented, then mixed by Mixup/CutMix.
    return lambda images, outputs, targets: distill_loss(outputs, teacher_forward(teacher, images), targets)


def discard_empty_run_dir() -> None:
    """Remove the run folder Hydra made for a run that failed before writing anything of its own."""
    RunDir(current_run_dir()).discard_if_empty()


def agree(info: DistInfo, decide: Callable[[], Any]) -> Any:
    """Rank 0 decides; every rank gets its answer, or raises the same ConfigError/RunError it raised (any other
    error of rank 0 stops the others with a RunError, instead of leaving them waiting for its answer)."""
    outcome: tuple = ("ok", None)
    if info.is_main:
        try:
            outcome = ("ok", decide())
        except (ConfigError, RunError) as error:
            outcome = ("error", type(error), str(error))
        except Exception as error:
            broadcast_object(("error", RunError, f"rank 0 failed ({type(error).__name__}: {error}); see its log"), info)
            raise
    outcome = broadcast_object(outcome, info)
    if outcome[0] == "error":
        raise outcome[1](outcome[2])
    return outcome[1]


def peer_lost(error: RuntimeError) -> str | None:
    """How a collective failed if it failed because another rank is gone (it crashed or stopped on an error of its
    own), else None."""
    import torch.distributed as dist

    for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"):
        if sign in str(error):
            return sign
    return type(error).__name__ if isinstance(error, dist.DistError) else None


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
            raise RunError(f"the run folder {run_dir} is in use by another launch of the same run: {holder} "
                           f"({run_dir / LOCK_NAME}). Wait for it to end or stop it, or add "
                           f"runtime.wait_for_lock=true to wait for it. If that launch is gone (a crashed node), "
                           f"delete {run_dir / LOCK_NAME}.")
        if info.is_main and not announced:
            log.info(f"[run] waiting for the run folder {run_dir}, in use by {holder}")
            announced = True
        if lock is not None:
            time.sleep(poll_s)


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Train one run to the end (or to divergence) and return its summary; rank 0 writes everything, holding
    the run folder's lock, and every rank logs to its own file there."""
    validate_config(cfg)
    identity = identity_from_hydra(cfg)
    run_dir = RunDir(current_run_dir())
    info = init_distributed(cfg.runtime.device)
    lock, handler = None, None
    try:
        data = agree(info, lambda: data_identity(cfg, run_dir))  # one scan of the data, not one per rank
        # the teacher's weights, refused when they are not those the run folder records
        identity = agree(info, lambda: with_run_teacher(with_data(identity, data), cfg, run_dir))
        lock = acquire_run_lock(run_dir.path, info, cfg.runtime.wait_for_lock)
        handler = attach_run_log(run_dir.path, info.rank)
        for taken in lock.taken_over if lock is not None else ():
            log.warning(f"[run] took over the lock of {taken}")
        return _run_locked(cfg, info, identity, run_dir, data)
    except (ConfigError, RunError) as error:
        if handler is not None:
            file_only.error(f"error: {error}")
        raise
    except StopRequested as stopped:
        if handler is not None:
            file_only.warning(f"[run] {stopped}")
        raise
    except RuntimeError as error:
        sign = peer_lost(error) if info.enabled else None
        if sign is None:
            raise
        lost = RunError(f"rank {info.rank} stopped because another rank left the process group mid-run ({sign}). "
                        "The rank that stopped first says why in its own output; the run's checkpoints are intact, "
                        "and relaunching the same command resumes it.")
        if handler is not None:
            file_only.error(f"error: {lost}")
        raise lost from None
    finally:
        if handler is not None:
            detach_run_log(handler)
        if lock is not None:
            lock.release()
        cleanup(info)


def previous_result(run_dir: RunDir, is_main: bool) -> dict[str, Any] | None:
    """The run's result.json when it holds one; a damaged one is reported and the run counts as unfinished."""
    try:
        return run_dir.read_result()
    except ConfigError as error:
        if is_main:
            log.warning(f"[run] {error} Treated as unfinished: the run resumes and writes it again.")
        return None


def data_identity(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    """The data's fingerprint, checked against the one the run folder recorded: another dataset under the same
    settings is refused, never resumed or skipped with the other data's result."""
    current = data_fingerprint(cfg)
    recorded = (run_dir.read_identity() or {}).get("data")
    if recorded is not None and recorded.get("digest") != current.get("digest"):
        raise ConfigError(
            f"{run_dir.path} holds this experiment trained on other data ({describe_data(recorded)}), but "
            f"data.root={cfg.data.root} now holds {describe_data(current)}. The data is part of a run's identity: "
            f"train this data under another output folder (runtime.output_root=...), or delete {run_dir.path} "
            "to train it here.")
    return current


def launch_plan(cfg: DictConfig, run_dir: RunDir) -> str:
    """What launching this run would do now: skip, train, resume, or wait for its pre-training."""
    result = previous_result(run_dir, is_main=False)
    if result is not None:
        return f"skip (already {result['status']})"
    upstream = pretrain_run_dir(cfg) if cfg.stage == "finetune" and not cfg.finetune.init_checkpoint else None
    if upstream is not None:
        upstream_result = previous_result(upstream, is_main=False)
        if upstream_result is None:
            return f"wait for its pre-training {upstream.name}"
        if upstream_result["status"] != "finished":
            return f"record as {upstream_result['status']} without training (its pre-training {upstream.name})"
    source = layer_scale_run_dir(cfg)
    source_result = previous_result(source, is_main=False) if source is not None else None
    if source is not None and source_result is None:
        return f"wait for its LayerScale run {source.name}"
    if source_result is not None and source_result["status"] != "finished":
        return f"refuse (its LayerScale run {source.name} ended as {source_result['status']})"
    point = ckpt.find_resume_point(run_dir.path)
    if point is not None:
        return f"resume from step {point.state['step']} ({point.path.name})"
    return ("train from step 0" + (f", starting from {upstream.name}" if upstream is not None else "")
            + (f", LayerScale diagonal fixed at the values of {source.name}" if source is not None else ""))


def dry_run_line(cfg: DictConfig, run_dir: RunDir, overrides: list[str]) -> str:
    """The dry run's line for one run launched with `overrides`: its folder, wandb id and what a launch would do."""
    identity = run_identity(cfg, overrides, composed_choices(cfg))
    identity = with_run_teacher(with_data(identity, data_identity(cfg, run_dir)), cfg, run_dir)
    return f"[dry run] {run_dir.name} (wandb id {identity.run_id}): {launch_plan(cfg, run_dir)}"


def record_identity(run_dir: RunDir, identity: RunIdentity, data: dict[str, Any]) -> None:
    """Write what this run is (its digest, its data and its teacher) into its folder, once."""
    if run_dir.read_identity() is None:
        run_dir.write_identity({"name": identity.name, "run_id": identity.run_id, "digest": identity.digest,
                                "data": data, **({"teacher": identity.teacher} if identity.teacher else {})})


def _run_locked(cfg: DictConfig, info: DistInfo, identity: RunIdentity, run_dir: RunDir,
                data: dict[str, Any]) -> dict[str, Any] | None:
    """What run() does while holding the run folder: skip a finished run, or train (resuming) to the end."""
    if info.is_main:
        for path in ckpt.remove_stale_temp_files(run_dir.path):
            log.info(f"[run] removed {path.name}, left by a launch stopped while writing it")
    result = previous_result(run_dir, info.is_main)
    if result is not None:
        if info.is_main:
            top1 = result.get("top1", float("nan"))
            log.info(f"[run] {identity.name}: already {result['status']} (top-1 {top1:.2f}); skipping."
                     f" Delete {run_dir.result} to run it again.")
            log_again_if_lost(cfg, identity, data, run_dir, "is missing")
            if copies_augmented_alike(result, cfg.augment.repeated_aug):
                log.warning(f"[run] {identity.name} was trained on several ranks before the per-rank random streams "
                            "(README, 'Random streams across ranks'): its repeated-augmentation copies were augmented "
                            f"alike. Delete {run_dir.path} to train it again as the recipe means.")
        return result
    if cfg.stage == "finetune":
        upstream = pretrain_status(cfg)
        if upstream != "finished":
            return record_without_training(cfg, identity, run_dir, upstream, data, info.is_main)
    return _train(cfg, info, identity, run_dir, data)


def log_again_if_lost(cfg: DictConfig, identity: RunIdentity, data: dict[str, Any], run_dir: RunDir,
                      what_happened: str) -> None:
    """A finished run whose wandb log is gone (the aggregator reads those logs): log its result.json and
    metrics.csv again, under the same wandb id, and say so."""
    if cfg.runtime.tracking.mode == "disabled" or wandb_logs(cfg.runtime.output_root, identity.run_id):
        return
    result = run_dir.read_result() or {}
    summary = {k: v for k, v in result.items() if k not in ("run_id", "name", "experiment_digest", "data_fingerprint")}
    Tracker(cfg, identity, data, enabled=True, run_dir=run_dir.path, write_csv=False).replay(
        read_epoch_rows(run_dir.metrics), summary)
    log.warning(f"[run] the wandb log of {identity.name} (id {identity.run_id}) under "
                f"{Path(cfg.runtime.output_root) / 'wandb'} {what_happened}: logged its result and epochs again from "
                f"{run_dir.result.name} and {run_dir.metrics.name}, so the aggregator sees the run.")


def record_without_training(cfg: DictConfig, identity: RunIdentity, run_dir: RunDir, upstream: str,
                            data: dict[str, Any], is_main: bool = True) -> dict[str, Any]:
    """A fine-tune stage whose pre-training diverged: nothing to fine-tune, logged with the same status."""
    final = {"status": upstream, "steps_done": 0, "epochs_done": 0, "train_seconds": 0.0,
             "note": f"pre-training ended as {upstream}; not fine-tuned"}
    if not is_main:
        return final
    tracker = Tracker(cfg, identity, data, enabled=True, run_dir=run_dir.path)
    tracker.summary(final)
    tracker.finish()
    record_identity(run_dir, identity, data)
    run_dir.write_result({"run_id": identity.run_id, "name": identity.name, **final,
                          "experiment_digest": identity.digest, "data_fingerprint": data})
    log.info(f"[run] {identity.name}: {final['note']}.")
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


class RunClock:
    """Training seconds of the whole run: those of earlier launches (from the checkpoint) plus this one's."""

    def __init__(self, before: float = 0.0) -> None:
        self.before, self.started = before, time.perf_counter()

    def __call__(self) -> float:
        return self.before + time.perf_counter() - self.started


def image_folders(pieces: Pieces) -> list[SkippingImageFolder]:
    """The run's datasets that watch for unreadable images."""
    sets = (pieces.train_loader.dataset, pieces.val_loader.dataset)
    return [d for d in sets if isinstance(d, SkippingImageFolder)]


def collect_bad_images(pieces: Pieces, info: DistInfo, known: set[str]) -> set[str]:
    """Name in the log each unreadable image found since the last call (any rank's); returns all known ones."""
    local = [path for dataset in image_folders(pieces) for path in dataset.newly_bad()]
    everyone = set().union(*gather_objects(local, info))
    for path in sorted(everyone - known) if info.is_main else local:  # rank 0's log names every rank's
        log.warning(f"[data] unreadable image {path}: the next readable image takes its place "
                    "(runtime.on_bad_image=fail stops instead)")
    return known | everyone


def bad_image_error(pieces: Pieces) -> ConfigError | RunError:
    """Why reading the data stopped the run, naming the file or folder (data/bad_images.py)."""
    return stop_error(image_folders(pieces))


def _train(cfg: DictConfig, info: DistInfo, identity: RunIdentity, run_dir: RunDir,
           data: dict[str, Any]) -> dict[str, Any]:
    RunStreams(cfg.seed, info.rank).seed_init()  # the same initial weights on every rank
    set_cpu_threads(cfg.runtime.cpu_threads, info.device)
    plan = plan_batch(cfg, info.world_size)
    pieces = build_pieces(cfg, info, plan)  # every input error is raised by now, before anything is logged
    trainer = pieces.trainer
    start_epoch, best_top1, skip_batches, state = 0, 0.0, 0, {}
    resumed = resume_point(run_dir, info)
    if resumed is not None:
        resumed_from, state = resumed
        start_epoch, best_top1, skip_batches = ckpt.restore(trainer, state)
        for dataset in image_folders(pieces):
            dataset.mark_bad(state.get("bad_images", ()))
        where = "" if info.is_main else f" (rank {info.rank} on {info.host})"  # each rank's file says it resumed
        log.info(f"[run] resuming {identity.name} from {resumed_from}: epoch {start_epoch} (batch {skip_batches}), "
                 f"step {trainer.step}{where}")
    tracker = Tracker(cfg, identity, data, enabled=info.is_main, run_dir=run_dir.path)
    if info.is_main:
        record_identity(run_dir, identity, data)
    trainer.on_log = tracker.log
    try:
        with StopSignals(info, cfg.runtime.log_interval) as stop:
            final = _train_and_evaluate(cfg, info, identity, run_dir, pieces, tracker,
                                        (start_epoch, best_top1, skip_batches, state), stop)
    except BaseException:
        with contextlib.suppress(Exception):
            tracker.finish(exit_code=1)
        raise
    tracker.summary(final)
    tracker.finish(exit_code=0)
    if info.is_main:
        run_dir.write_result({"run_id": identity.run_id, "name": identity.name, **final,
                              "experiment_digest": identity.digest, "data_fingerprint": data})
        log_again_if_lost(cfg, identity, data, run_dir, "was removed while the run trained")
        print_summary(identity, final, run_dir.path)
    return broadcast_object(final, info)


def _train_and_evaluate(cfg: DictConfig, info: DistInfo, identity: RunIdentity, run_dir: RunDir, pieces: Pieces,
                        tracker: Tracker, start: tuple[int, float, int, dict[str, Any]],
                        stop: StopSignals) -> dict[str, Any]:
    """The epochs left (or, when training is already complete, only the final evaluation); the run's summary."""
    trainer, plan = pieces.trainer, pieces.plan
    start_epoch, best_top1, skip_batches, state = start
    last_path, prev_path = run_dir.last_checkpoint, run_dir.previous_checkpoint
    arch = architecture(trainer.model, student_model_name(cfg))  # what was built, not what the config names
    if info.is_main:
        log_teacher(identity.teacher)
        log.info(f"[run] {identity.name}: {cfg.stage} at {cfg.resolution.train_size}px of {describe_architecture(arch)}"
                 f"{'' if pieces.recipe.train_mode else ' (in eval mode)'}, world size {info.world_size}, "
                 f"global batch {pieces.recipe.global_batch} = "
                 f"{info.world_size} x {plan.per_rank_batch} per rank ({plan.accum_steps} accumulation step(s) of "
                 f"{plan.micro_batch}), {pieces.steps_per_epoch} steps/epoch, {pieces.recipe.epochs} epochs, "
                 f"lr {trainer.optimizer.param_groups[0]['lr']:.2e} at step {trainer.step}, device {info.device}"
                 + (f", {torch.get_num_threads()} torch thread(s)" if info.device.type == "cpu" else ""))
    nodes = placement(info)  # host -> ranks, e.g. {"n1": [0..7], "n2": [8..15]}
    tracker.summary({"world_size": info.world_size, "nodes": nodes, "per_device_batch": plan.per_rank_batch,
                     "micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps,
                     "effective_batch": pieces.recipe.global_batch, "model_name": student_model_name(cfg),
                     "architecture": arch})
    status, metrics, ema_metrics = "finished", {}, {}
    clock = RunClock(float(state.get("train_seconds", 0.0)))
    epochs_done, bad_images = start_epoch, set(state.get("bad_images", ()))
    max_steps = cfg.train.max_steps

    def extra(complete: bool = False) -> dict[str, Any]:
        return {"train_seconds": clock(), "training_complete": complete, "bad_images": sorted(bad_images)}

    saver = ckpt.MidEpochSaver(trainer, last_path, cfg.runtime.checkpoint_every_steps,
                                cfg.runtime.checkpoint_every_minutes, info.is_main, keep_previous=prev_path,
                                extra=extra)

    def stop_if_asked(step: int | None = None, batches_in_loader: int | None = None) -> None:
        """Stop on an agreed signal: save the mid-epoch state first (the epoch-end one is written already)."""
        signum = stop.agreed(step)
        if signum is None:
            return
        if batches_in_loader is not None:
            saver.save(batches_in_loader)
        barrier(info)
        raise StopRequested(signum, f"at step {trainer.step}; the same command resumes it from {last_path}")

    def step_hook(batches_in_loader: int) -> None:
        saver(batches_in_loader)
        stop_if_asked(trainer.step, batches_in_loader)

    def evaluate_epoch(epoch: int, row: dict[str, Any], epoch_state: dict[str, Any]) -> None:
        """Evaluate the weights at an epoch's end, log the epoch, keep the best, mark the checkpoint evaluated."""
        nonlocal metrics, ema_metrics, bad_images, best_top1
        metrics, ema_metrics = evaluate_all(cfg, pieces)
        bad_images = collect_bad_images(pieces, info, bad_images)
        headline = ema_metrics["top1"] if ema_metrics else metrics["top1"]
        best_top1 = max(best_top1, headline)
        tracker.log({"epoch": epoch, **row, **{f"val/{k}": v for k, v in metrics.items()},
                     **{f"val_ema/{k}": v for k, v in ema_metrics.items()}}, trainer.step)
        if info.is_main:
            ema_text = f", EMA top-1 {ema_metrics['top1']:.2f}" if ema_metrics else ""
            loss_text = f"train loss {row['train/epoch_loss']:.4f} | " if row else ""
            log.info(f"[epoch {epoch}] {loss_text}val top-1 {metrics['top1']:.2f} "
                     f"top-5 {metrics['top5']:.2f}{ema_text} | step {trainer.step}")
            evaluated = {**epoch_state, "best_top1": best_top1, "evaluated": True, "bad_images": sorted(bad_images)}
            ckpt.save_atomic(evaluated, last_path)  # the epoch's state, now with its evaluation
            if headline >= best_top1:
                ckpt.save_atomic(evaluated, run_dir.best_checkpoint)
        barrier(info)

    try:
        if state.get("evaluated") is False and not skip_batches and start_epoch < pieces.recipe.epochs:
            evaluate_epoch(start_epoch - 1, {}, state)  # stopped between its epoch-end checkpoint and evaluation
        for epoch in range(start_epoch, pieces.recipe.epochs):
            if max_steps is not None and trainer.step >= max_steps:
                break
            pieces.streams.seed_epoch(epoch)  # this rank's Mixup/CutMix, erasing and drop path (streams.py)
            loader = pieces.train_loader
            if epoch == start_epoch and skip_batches:  # resumed mid-epoch (preemption): skip what was done
                loader = build_train_loader(pieces.train_loader.dataset,
                                            SkipFirst(pieces.train_sampler, skip_batches * plan.per_rank_batch),
                                            plan.per_rank_batch, cfg, info.device)
            seed_epoch_data(pieces.train_sampler, loader, pieces.streams, epoch)  # shared permutation, own augmentation
            skipped = skip_batches if epoch == start_epoch else 0
            saver.start_epoch(epoch, best_top1, skipped)
            steps_before = trainer.step
            train_loss = trainer.train_epoch(loader, epoch, max_steps, step_hook=step_hook)
            batches_done = skipped + trainer.step - steps_before
            complete = batches_done >= pieces.steps_per_epoch  # train.max_steps may stop an epoch part-way
            epochs_done = epoch + 1 if complete else epoch
            done = epochs_done >= pieces.recipe.epochs or (max_steps is not None and trainer.step >= max_steps)
            state = {}
            if info.is_main:  # the epoch's end is saved before its evaluation: a stop there loses no training
                state = ckpt.training_state(trainer, epochs_done, best_top1, 0 if complete else batches_done,
                                            evaluated=False, **extra(done))
                ckpt.save_atomic(state, last_path, keep_previous=prev_path)
            stop_if_asked()
            evaluate_epoch(epoch, {"train/epoch_loss": train_loss}, state)
            stop_if_asked()
        if not metrics:  # relaunched after the final checkpoint: training is complete, the evaluation is not
            if info.is_main:
                log.info(f"[run] training was complete at step {trainer.step} (epoch {epochs_done}); evaluating "
                         "the final weights")
            metrics, ema_metrics = evaluate_all(cfg, pieces)
            bad_images = collect_bad_images(pieces, info, bad_images)
    except Diverged as diverged:
        status = "diverged"
        if info.is_main:
            log.info(f"[run] {identity.name} diverged: {diverged}. Recorded as a result; the sweep goes on.")
    except BadImageError:
        raise bad_image_error(pieces) from None
    final = summarize(status, metrics, ema_metrics, best_top1, epochs_done, trainer.step, clock())
    final["model_name"] = student_model_name(cfg)
    final["architecture"] = arch
    if identity.teacher is not None:
        final["teacher"] = teacher_summary(identity.teacher)
    final["nodes"] = nodes
    final["streams"] = STREAMS_VERSION
    if pieces.layer_scale_from is not None:
        final["layer_scale_from"] = pieces.layer_scale_from
    if trainer.scaler is not None:
        final["amp_skipped_steps"] = trainer.amp_skipped_steps
    if bad_images or image_folders(pieces):
        final["data/bad_images"] = len(bad_images)
    return final


def evaluate_all(cfg: DictConfig, pieces: Pieces) -> tuple[dict[str, float], dict[str, float]]:
    """Top-1/top-5 of the model, and of its EMA when one is kept."""
    trainer = pieces.trainer
    settings = (pieces.val_loader, trainer.info, trainer.amp_dtype, cfg.train.eval_max_batches, cfg.distill.fusion)
    metrics = evaluate(trainer.model, *settings)
    ema_metrics = evaluate(trainer.ema.module, *settings) if trainer.ema is not None else {}
    return metrics, ema_metrics


def summarize(status: str, metrics: dict, ema_metrics: dict, best_top1: float, epochs_done: int, step: int,
              seconds: float) -> dict[str, Any]:
    """The run's summary: headline top-1 (EMA's when EMA is on), best and final values, status, the epochs
    completed, the optimizer steps and the training seconds of all its launches together."""
    final = {"status": status, "epochs_done": epochs_done, "steps_done": step,
             "train_seconds": round(seconds, 1)}
    if metrics:
        final.update(top1_final=metrics["top1"], top5_final=metrics["top5"], val_loss_final=metrics["loss"])
        if "top1_cls" in metrics:  # a model with a distillation token: both heads and both fusion rules
            final.update(top1_cls=metrics["top1_cls"], top1_dist=metrics["top1_dist"], top1_fused=metrics["top1"],
                         top1_fused_alt=metrics["top1_fused_alt"])
    if ema_metrics:
        final.update(top1_ema_final=ema_metrics["top1"], top5_ema_final=ema_metrics["top5"],
                     top1_ema_best=best_top1)
    headline = ema_metrics.get("top1", metrics.get("top1"))
    if headline is not None:
        final["top1"] = headline
        final["top1_best"] = best_top1
    return final


def print_summary(identity: RunIdentity, final: dict[str, Any], run_dir: Path) -> None:
    """A few lines a person reads at the end of a run (on the console and in train.log)."""
    lines = ["", "=" * 72, f"run       {identity.name}  (wandb id {identity.run_id})",
             f"status    {final['status']} after {final['steps_done']} steps, {final['train_seconds']:.0f}s"]
    if "top1" in final:
        lines.append(f"top-1     {final['top1']:.2f}% final, {final['top1_best']:.2f}% best   "
                     f"top-5 {final.get('top5_ema_final', final.get('top5_final', float('nan'))):.2f}%")
    if "top1_cls" in final:
        lines.append(f"heads     class {final['top1_cls']:.2f}%  distillation {final['top1_dist']:.2f}%  "
                     f"fused {final['top1_fused']:.2f}% (other rule {final['top1_fused_alt']:.2f}%)")
    if "amp_skipped_steps" in final:
        lines.append(f"fp16      {final['amp_skipped_steps']} optimizer step(s) skipped by the loss scaler")
    if final.get("data/bad_images"):
        lines.append(f"data      {final['data/bad_images']} unreadable image(s) replaced (named in train.log)")
    lines += [f"outputs   {run_dir}", "=" * 72]
    log.info("\n".join(lines))
