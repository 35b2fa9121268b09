"""One training run: build the pieces from the config, resume if a checkpoint exists, train, evaluate, log."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from timm.utils import ModelEmaV3

from deit_ablate import checkpoint as ckpt
from deit_ablate.data.datasets import build_dataset, data_fingerprint, dataset_root, describe_data
from deit_ablate.data.loader import ShardSampler, SkipFirst, build_loader, build_train_sampler, set_sampler_epoch
from deit_ablate.data.transforms import build_eval_transform, build_train_pipeline
from deit_ablate.distributed import DistInfo, barrier, broadcast_object, cleanup, init_distributed
from deit_ablate.engine import Diverged, Trainer, evaluate
from deit_ablate.errors import ConfigError
from deit_ablate.identity import RunIdentity, current_run_dir, identity_from_hydra
from deit_ablate.losses import TOKEN_KINDS, DistillationLoss
from deit_ablate.mixing import build_criterion, build_mixup
from deit_ablate.models import build_model, compile_in_place, student_model_name
from deit_ablate.optim import build_optimizer, build_scheduler, scaled_lr
from deit_ablate.rundir import RunDir
from deit_ablate.stages import StageRecipe, load_pretrained, pretrain_run_dir, pretrain_status, stage_recipe
from deit_ablate.teacher import build_teacher, teacher_forward
from deit_ablate.tracking import Tracker
from deit_ablate.validate import BatchPlan, plan_batch, validate_config


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (the CPU and every GPU)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def amp_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU under `auto`, full precision on CPU."""
    if setting == "bf16" or (setting == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


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


def build_pieces(cfg: DictConfig, info: DistInfo, plan: BatchPlan) -> Pieces:
    """Data, model, optimizer, schedule and loss for this stage of the run."""
    recipe = stage_recipe(cfg)
    root = dataset_root(cfg) if info.is_main else None
    barrier(info)
    root = dataset_root(cfg) if root is None else root
    train_transform, batch_transform = build_train_pipeline(cfg)
    train_set = build_dataset(cfg, "train", train_transform, root)
    val_set = build_dataset(cfg, "val", build_eval_transform(cfg), root)
    train_sampler = build_train_sampler(train_set, cfg.augment.repeated_aug, info.world_size, info.rank, cfg.seed)
    train_loader = build_loader(train_set, train_sampler, plan.per_rank_batch, cfg, train=True)
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
            print(f"[run] fine-tuning from {recipe.init_checkpoint}")
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
                      amp_dtype=amp_dtype(cfg.train.amp, info.device),
                      clip_grad=cfg.optimizer.clip_grad, log_interval=cfg.runtime.log_interval)
    return Pieces(trainer, train_loader, train_sampler, val_loader, steps_per_epoch, recipe, plan)


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


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Train one run to the end (or to divergence) and return its summary; rank 0 writes everything."""
    validate_config(cfg)
    identity = identity_from_hydra(cfg)
    run_dir = RunDir(current_run_dir())
    data = data_identity(cfg, run_dir)
    if cfg.runtime.dry_run:
        print(f"[dry run] {identity.name} (wandb id {identity.run_id}): {launch_plan(cfg, run_dir)}", flush=True)
        run_dir.discard_if_empty()
        return None
    result = run_dir.read_result()
    if result is not None:
        print(f"[run] {identity.name}: already {result['status']} (top-1 {result.get('top1', float('nan')):.2f}); "
              f"skipping. Delete {run_dir.result} to run it again.")
        return result
    if cfg.stage == "finetune":
        upstream = pretrain_status(cfg)
        if upstream != "finished":
            return record_without_training(cfg, identity, run_dir, upstream, data)
    info = init_distributed(cfg.runtime.device)
    try:
        return _train(cfg, info, identity, run_dir, data)
    finally:
        cleanup(info)


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
    result = run_dir.read_result()
    if result is not None:
        return f"skip (already {result['status']})"
    if cfg.stage == "finetune" and not cfg.finetune.init_checkpoint:
        upstream = pretrain_run_dir(cfg)
        upstream_result = upstream.read_result()
        if upstream_result is None:
            return f"wait for its pre-training {upstream.name}"
        if upstream_result["status"] != "finished":
            return f"record as {upstream_result['status']} without training (its pre-training {upstream.name})"
    if run_dir.last_checkpoint.exists():
        step = torch.load(run_dir.last_checkpoint, map_location="cpu", weights_only=True, mmap=True)["step"]
        return f"resume from step {step}"
    return "train from step 0" + (f", starting from {pretrain_run_dir(cfg).name}" if cfg.stage == "finetune"
                                  and not cfg.finetune.init_checkpoint else "")


def record_without_training(cfg: DictConfig, identity: RunIdentity, run_dir: RunDir, upstream: str,
                            data: dict[str, Any]) -> dict[str, Any]:
    """A fine-tune stage whose pre-training diverged: nothing to fine-tune, logged with the same status."""
    final = {"status": upstream, "steps_done": 0, "epochs_done": 0, "train_seconds": 0.0,
             "note": f"pre-training ended as {upstream}; not fine-tuned"}
    tracker = Tracker(cfg, identity, data, enabled=True)
    tracker.summary(final)
    tracker.finish()
    record_identity(run_dir, identity, data)
    run_dir.write_result({"run_id": identity.run_id, "name": identity.name, **final,
                          "experiment_digest": identity.digest, "data_fingerprint": data})
    print(f"[run] {identity.name}: {final['note']}.")
    return final


def record_identity(run_dir: RunDir, identity: RunIdentity, data: dict[str, Any]) -> None:
    """Write what this run is (its digest and its data) into its folder, once."""
    if run_dir.read_identity() is None:
        run_dir.write_identity({"name": identity.name, "run_id": identity.run_id, "digest": identity.digest,
                                "data": data})


def _train(cfg: DictConfig, info: DistInfo, identity: RunIdentity, run_dir: RunDir,
           data: dict[str, Any]) -> dict[str, Any]:
    seed_everything(cfg.seed)
    set_cpu_threads(cfg.runtime.cpu_threads, info.device)
    plan = plan_batch(cfg, info.world_size)
    pieces = build_pieces(cfg, info, plan)  # every input error is raised by now, before anything is logged
    tracker = Tracker(cfg, identity, data, enabled=info.is_main)
    if info.is_main:
        record_identity(run_dir, identity, data)
    trainer = pieces.trainer
    trainer.on_log = tracker.log
    start_epoch, best_top1, skip_batches = 0, 0.0, 0
    last_path = run_dir.last_checkpoint
    if last_path.exists():
        start_epoch, best_top1, skip_batches = ckpt.restore(trainer, ckpt.load(last_path))
        if info.is_main:
            print(f"[run] resuming {identity.name} from {last_path}: epoch {start_epoch} (batch {skip_batches}), "
                  f"step {trainer.step}")
    if info.is_main:
        print(f"[run] {identity.name}: {cfg.stage} at {cfg.resolution.train_size}px of {student_model_name(cfg)}"
              f"{'' if pieces.recipe.train_mode else ' (in eval mode)'}, world size {info.world_size}, "
              f"global batch {pieces.recipe.global_batch} = "
              f"{info.world_size} x {plan.per_rank_batch} per rank ({plan.accum_steps} accumulation step(s) of "
              f"{plan.micro_batch}), {pieces.steps_per_epoch} steps/epoch, {pieces.recipe.epochs} epochs, "
              f"lr {trainer.optimizer.param_groups[0]['lr']:.2e} at step {trainer.step}, device {info.device}"
              + (f", {torch.get_num_threads()} torch thread(s)" if info.device.type == "cpu" else ""))
    tracker.summary({"world_size": info.world_size, "per_device_batch": plan.per_rank_batch,
                     "micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps,
                     "effective_batch": pieces.recipe.global_batch, "model_name": student_model_name(cfg)})
    status, metrics, ema_metrics, final = "finished", {}, {}, {}
    started = time.perf_counter()
    epoch = start_epoch
    saver = ckpt.MidEpochSaver(trainer, last_path, cfg.runtime.checkpoint_every_steps,
                                cfg.runtime.checkpoint_every_minutes, info.is_main)
    try:
        for epoch in range(start_epoch, pieces.recipe.epochs):
            if cfg.train.max_steps is not None and trainer.step >= cfg.train.max_steps:
                break
            seed_everything(cfg.seed * 10_007 + epoch * 101 + info.rank)  # exact resume at epoch boundaries
            set_sampler_epoch(pieces.train_sampler, epoch, cfg.seed)
            loader = pieces.train_loader
            if epoch == start_epoch and skip_batches:  # resumed mid-epoch (preemption): skip what was done
                loader = build_loader(pieces.train_loader.dataset,
                                      SkipFirst(pieces.train_sampler, skip_batches * plan.per_rank_batch),
                                      plan.per_rank_batch, cfg, train=True)
            loader.generator = torch.Generator().manual_seed(cfg.seed * 10_007 + epoch)
            skipped = skip_batches if epoch == start_epoch else 0
            saver.start_epoch(epoch, best_top1, skipped)
            steps_before = trainer.step
            train_loss = trainer.train_epoch(loader, epoch, cfg.train.max_steps, step_hook=saver)
            batches_done = skipped + trainer.step - steps_before
            complete = batches_done >= pieces.steps_per_epoch  # train.max_steps may stop an epoch part-way
            metrics, ema_metrics = evaluate_all(cfg, pieces)
            headline = ema_metrics["top1"] if ema_metrics else metrics["top1"]
            best_top1 = max(best_top1, headline)
            row = {"epoch": epoch, "train/epoch_loss": train_loss, **{f"val/{k}": v for k, v in metrics.items()},
                   **{f"val_ema/{k}": v for k, v in ema_metrics.items()}}
            tracker.log(row, trainer.step)
            if info.is_main:
                ema_text = f", EMA top-1 {ema_metrics['top1']:.2f}" if ema_metrics else ""
                print(f"[epoch {epoch}] train loss {train_loss:.4f} | val top-1 {metrics['top1']:.2f} "
                      f"top-5 {metrics['top5']:.2f}{ema_text} | step {trainer.step}", flush=True)
                state = (ckpt.training_state(trainer, epoch + 1, best_top1) if complete
                         else ckpt.training_state(trainer, epoch, best_top1, batches_done))
                ckpt.save_atomic(state, last_path)
                if headline >= best_top1:
                    ckpt.save_atomic(state, run_dir.best_checkpoint)
            barrier(info)
    except Diverged as diverged:
        status = "diverged"
        if info.is_main:
            print(f"[run] {identity.name} diverged: {diverged}. Recorded as a result; the sweep goes on.")
    final = summarize(status, metrics, ema_metrics, best_top1, epoch, trainer.step, time.perf_counter() - started)
    final["model_name"] = student_model_name(cfg)
    tracker.summary(final)
    tracker.finish(exit_code=0)
    if info.is_main:
        run_dir.write_result({"run_id": identity.run_id, "name": identity.name, **final,
                              "experiment_digest": identity.digest, "data_fingerprint": data})
        print_summary(identity, final, run_dir.path)
    final = broadcast_object(final, info)
    return final


def evaluate_all(cfg: DictConfig, pieces: Pieces) -> tuple[dict[str, float], dict[str, float]]:
    """Top-1/top-5 of the model, and of its EMA when one is kept."""
    trainer = pieces.trainer
    settings = (pieces.val_loader, trainer.info, trainer.amp_dtype, cfg.train.eval_max_batches, cfg.distill.fusion)
    metrics = evaluate(trainer.model, *settings)
    ema_metrics = evaluate(trainer.ema.module, *settings) if trainer.ema is not None else {}
    return metrics, ema_metrics


def summarize(status: str, metrics: dict, ema_metrics: dict, best_top1: float, epoch: int, step: int,
              seconds: float) -> dict[str, Any]:
    """The run's summary: headline top-1 (EMA's when EMA is on), best and final values, status."""
    final = {"status": status, "epochs_done": epoch + 1 if metrics else epoch, "steps_done": step,
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
    """A few lines a person reads at the end of a run."""
    print("\n" + "=" * 72)
    print(f"run       {identity.name}  (wandb id {identity.run_id})")
    print(f"status    {final['status']} after {final['steps_done']} steps, {final['train_seconds']:.0f}s")
    if "top1" in final:
        print(f"top-1     {final['top1']:.2f}% final, {final['top1_best']:.2f}% best   "
              f"top-5 {final.get('top5_ema_final', final.get('top5_final', float('nan'))):.2f}%")
    if "top1_cls" in final:
        print(f"heads     class {final['top1_cls']:.2f}%  distillation {final['top1_dist']:.2f}%  "
              f"fused {final['top1_fused']:.2f}% (other rule {final['top1_fused_alt']:.2f}%)")
    print(f"outputs   {run_dir}")
    print("=" * 72, flush=True)
