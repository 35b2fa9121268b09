"""Build what a run trains with from its plan: the data loaders, then the model, optimizer, schedule and loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from timm.utils import ModelEmaV3

from deit_ablate.config.schema import (
    DistillConfig,
    DistillKind,
    OptimizerConfig,
    Precision,
    RuntimeConfig,
    TeacherView,
)
from deit_ablate.core.distributed import DistInfo, barrier
from deit_ablate.core.errors import ConfigError
from deit_ablate.core.logs import log
from deit_ablate.core.streams import RunStreams
from deit_ablate.data.datasets import build_dataset, dataset_root, training_split
from deit_ablate.data.loader import (
    SeededSamples,
    ShardSampler,
    build_loader,
    build_train_loader,
    build_train_sampler,
    rank_loader_settings,
    worker_niceness,
)
from deit_ablate.data.transforms import BatchNormalize, build_eval_transform, build_train_pipeline
from deit_ablate.run.plan import RunPlan
from deit_ablate.run.stages import (
    StageRecipe,
    classifier_names,
    fix_layer_scale,
    load_backbone,
    load_pretrained,
)
from deit_ablate.run.student import build_stage_model
from deit_ablate.run.teacher import TeacherSource, build_teacher
from deit_ablate.run.teacher_cache import FixedView, WithIndex, build_fixed_teacher_table
from deit_ablate.train.losses import TOKEN_KINDS, DistillationLoss, FixedTeacherLoss, build_criterion, build_mixup
from deit_ablate.train.models import compile_in_place
from deit_ablate.train.optim import EpochStepped, build_optimizer, build_scheduler, describe_layer_decay, scaled_lr
from deit_ablate.train.teacher import teacher_forward
from deit_ablate.train.trainer import Trainer


def amp_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on GPU under `auto`, full precision on CPU; fp16 under `fp16` (with grad_scaler's scaler)."""
    if setting == Precision.fp16:
        return torch.float16
    if setting == Precision.bf16 or (setting == Precision.auto and device.type == "cuda"):
        return torch.bfloat16
    return None


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """DDP's device_ids: the one GPU this process drives, None on the CPU."""
    return [device.index] if device.type == "cuda" else None


def grad_scaler(setting: str, device: torch.device) -> torch.amp.GradScaler | None:
    """The dynamic loss scaler of `fp16` (torch's defaults: 2**16, halved on a skipped step, doubled after 2000
    good ones); None for every other precision."""
    return torch.amp.GradScaler(device.type) if setting == Precision.fp16 else None


def set_cpu_threads(runtime: RuntimeConfig, device: torch.device) -> None:
    """Hold torch to the training process's intra-op threads on `device` (data.loader.loader_settings: on a CPU
    runtime.cpu_threads or torch's default, on a GPU the cores the loader workers leave)."""
    threads = rank_loader_settings(runtime, device.type).main_threads
    if threads is not None:
        torch.set_num_threads(threads)


@dataclass
class Loaders:
    """The run's data: the training set, loader and sampler (per rank), the validation loader, the batch transform."""

    train_set: Any
    train_loader: Any
    train_sampler: Any
    val_loader: Any
    batch_transform: BatchNormalize
    steps_per_epoch: int


@dataclass
class Pieces:
    """Everything a run builds before its first step."""

    trainer: Trainer
    loaders: Loaders
    layer_scale_from: dict[str, str] | None = None  # the run whose learned LayerScale diagonal it fixes
    transfer_from: dict[str, Any] | None = None  # a transfer's source: its run, checkpoint and the new head(s)


def build_loaders(plan: RunPlan, info: DistInfo) -> Loaders:
    """Training and validation loaders for this rank; a ConfigError when an epoch holds no full batch."""
    cfg, per_rank = plan.settings, plan.batch.per_rank_batch
    # the first rank of every node draws the built-in set if its cache lacks it (a node-local cache is filled
    # on each node; on a shared file system the second finds it there or loses the atomic rename harmlessly)
    root = dataset_root(cfg.data) if info.local_rank == 0 else None
    barrier(info)
    root = dataset_root(cfg.data) if root is None else root
    spec = plan.transforms
    train_transform, batch_transform = build_train_pipeline(spec)
    train_set = training_split(cfg.data, train_transform, root, on_bad_image=cfg.runtime.on_bad_image)
    if cfg.data.fraction < 1 and info.is_main:
        log.info(f"[data] data.fraction={cfg.data.fraction}: training on {len(train_set)} of the "
                 f"{len(train_set.dataset)} training images (a share of each class); evaluating on all of val/")
    if cfg.distill.type != DistillKind.none and cfg.distill.teacher_view == TeacherView.fixed:
        train_set = WithIndex(train_set)  # the loss looks up each image's cached teacher outputs by its index
    val_set = build_dataset(cfg.data, "val", build_eval_transform(spec), root, on_bad_image=cfg.runtime.on_bad_image)
    batch = plan.batch
    slots = build_train_sampler(len(train_set), cfg.augment.repeated_aug, batch.slots, batch.slots_of(info.rank),
                                batch.micro_batch)
    train_sampler = SeededSamples(slots, RunStreams(cfg.seed, info.rank))
    train_loader = build_train_loader(train_set, train_sampler, per_rank, spec, cfg.runtime, info.device,
                                      erasing=batch_transform.erasing)
    # the first train.eval_max_images images of the split, all ranks together: the same images on any layout
    scored = len(val_set) if cfg.train.eval_max_images is None else min(cfg.train.eval_max_images, len(val_set))
    val_loader = build_loader(val_set, ShardSampler(scored, info.world_size, info.rank),
                              cfg.runtime.eval_batch, cfg.runtime, train=False, device_type=info.device.type,
                              niceness=worker_niceness(cfg.runtime.worker_nice, info.device.type,
                                                       spec.resolution.eval_size))
    if len(train_loader) == 0:
        raise ConfigError(f"an epoch of {len(train_set)} images (x{cfg.augment.repeated_aug} repeats) dealt to "
                          f"{batch.slots} micro-batches of {batch.micro_batch} holds no full step; lower the global "
                          "batch or use more data.")
    return Loaders(train_set, train_loader, train_sampler, val_loader, batch_transform, len(train_loader))


def build_student(plan: RunPlan, info: DistInfo) -> tuple[torch.nn.Module, dict[str, str] | None]:
    """The student on this rank's device, from its pre-training's weights in a fine-tune, with a fixed LayerScale
    diagonal where the row asks for one; wrapped in DDP on several ranks."""
    cfg = plan.settings
    model = build_stage_model(plan.student)
    model = model.to(info.device)
    if plan.recipe.init_checkpoint is not None and plan.is_transfer:
        heads = load_backbone(model, plan.recipe.init_checkpoint)
        if info.is_main:
            log.info(f"[run] transferring from {plan.recipe.init_checkpoint}: new head(s) {', '.join(heads)} for "
                     f"{cfg.data.num_classes} classes")
    elif plan.recipe.init_checkpoint is not None:
        load_pretrained(model, plan.recipe.init_checkpoint)
        if info.is_main:
            log.info(f"[run] fine-tuning from {plan.recipe.init_checkpoint}")
    layer_scale = fix_layer_scale(model, plan.layer_scale_source)
    if layer_scale is not None and info.is_main:
        log.info(f"[run] LayerScale diagonal fixed at the values the run {layer_scale['run']} learned "
                 f"(digest {layer_scale['digest']})")
    if info.enabled:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ddp_device_ids(info.device))
    return model, layer_scale


def build_pieces(plan: RunPlan, info: DistInfo) -> Pieces:
    """Data, model, optimizer, schedule and loss for this stage of the run."""
    cfg, recipe = plan.settings, plan.recipe
    loaders = build_loaders(plan, info)
    model, layer_scale = build_student(plan, info)
    module = model.module if info.enabled else model
    optimizer = stage_optimizer(cfg.optimizer, recipe, module, info)
    scheduler = stage_scheduler(optimizer, recipe, loaders.steps_per_epoch)
    mixup = build_mixup(cfg.mix, cfg.data.num_classes)
    ema = ModelEmaV3(module, decay=cfg.train.ema_decay) if cfg.train.ema else None  # starts from the loaded weights
    if cfg.runtime.compile:
        compile_in_place(module)  # after the EMA copy, which is only evaluated and stays eager
    view = FixedView(plan.transforms, cfg.runtime)
    loss_fn = build_loss_fn(cfg.distill, view, plan.teacher, module, build_criterion(cfg.mix, mixup), info.device, info)
    precision = cfg.train.amp
    trainer = Trainer(model=model, optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn, info=info,
                      batch=plan.batch, mixup=mixup, ema=ema,
                      batch_transform=loaders.batch_transform, train_mode=recipe.train_mode,
                      amp_dtype=amp_dtype(precision, info.device), scaler=grad_scaler(precision, info.device),
                      clip_grad=cfg.optimizer.clip_grad, log_interval=cfg.runtime.log_interval,
                      sam_rho=recipe.sam_rho)
    if trainer.sam_rho and info.is_main:
        log.info(f"[run] SAM on: rho {trainer.sam_rho} around {recipe.optimizer} (Foret et al. 2021), two forward and "
                 f"backward passes per step, each chunk of {plan.batch.micro_batch} images perturbed by its own "
                 "gradient (m-sharpness)")
    return Pieces(trainer, loaders, layer_scale, transfer_source(plan, module))


def transfer_source(plan: RunPlan, module: torch.nn.Module) -> dict[str, Any] | None:
    """What a transfer started from, for its result: the source run's folder, the checkpoint, the new head(s) and
    their class count (None for the other stages)."""
    if not plan.is_transfer:
        return None
    return {"run": plan.upstream.name if plan.upstream is not None else None,
            "checkpoint": str(plan.recipe.init_checkpoint), "heads": list(classifier_names(module)),
            "num_classes": int(plan.settings.data.num_classes)}


def stage_optimizer(opt: OptimizerConfig, recipe: StageRecipe, module: torch.nn.Module, info: DistInfo
                    ) -> torch.optim.Optimizer:
    """This stage's optimizer at its batch-scaled lr (momentum, betas and eps from the stage's `opt` block); a
    fine-tune with finetune.layer_decay gets one lr scale per layer, logged."""
    lr = scaled_lr(recipe.lr, recipe.global_batch, recipe.lr_base_batch)
    layer_decay = recipe.layer_decay  # checked: validate.py
    optimizer = build_optimizer(module, recipe.optimizer, lr, recipe.weight_decay, opt.momentum,
                                tuple(opt.betas), opt.eps, layer_decay=layer_decay)
    if layer_decay is not None and info.is_main:
        log.info(f"[run] {describe_layer_decay(optimizer, layer_decay)}")
    return optimizer


def stage_scheduler(optimizer: torch.optim.Optimizer, recipe: StageRecipe, steps_per_epoch: int):
    """The stage's schedule (optimizer.sched: warm-up + cosine by default) in optimizer updates, or in epochs moved one
    epoch late as the released main.py moves it (optimizer.sched_on=epoch); train.max_steps never shortens it."""
    if recipe.sched_on == "epoch":
        schedule = build_scheduler(optimizer, recipe.epochs, recipe.warmup_epochs, recipe.min_lr, recipe.warmup_lr,
                                   recipe.sched, recipe.decay_epochs, recipe.decay_rate)
        return EpochStepped(schedule, steps_per_epoch)
    total_steps = recipe.epochs * steps_per_epoch
    warmup_steps = min(round(recipe.warmup_epochs * steps_per_epoch), max(total_steps - 1, 0))
    decay_steps = max(round(recipe.decay_epochs * steps_per_epoch), 1)
    return build_scheduler(optimizer, total_steps, warmup_steps, recipe.min_lr, recipe.warmup_lr, recipe.sched,
                           decay_steps, recipe.decay_rate)


def build_loss_fn(distill: DistillConfig, view: FixedView, teacher_source: TeacherSource | None,
                  model: torch.nn.Module, criterion: torch.nn.Module, device: torch.device,
                  info: DistInfo | None = None):
    """The loss of one (mixed) batch: the class criterion, plus the term of the plan's teacher when distilling
    (`view`: the stage's data, for the teacher's classes and a fixed teacher's table)."""
    # a transfer trains on its new labels only (stages.stage_distils, teacher.run_teacher): a distilled model's two
    # new heads learn them through the mean of their logits, timm's output when not distilling
    if teacher_source is None:
        return lambda images, outputs, targets: criterion(outputs, targets)
    teacher = build_teacher(teacher_source, view.spec.data.num_classes, device, distill.teacher.sizes)
    distill_loss = DistillationLoss(criterion, distill.type, distill.alpha, distill.tau, distill.kl_normalization)
    if hasattr(model, "set_distilled_training"):
        model.set_distilled_training(distill.type in TOKEN_KINDS)
    if distill.teacher_view == TeacherView.fixed:
        # Beyer et al. 2022's fixed teacher: its outputs on one view per image, computed once (teacher_cache.py).
        info = info if info is not None else DistInfo(device=device)
        return FixedTeacherLoss(distill_loss, build_fixed_teacher_table(teacher, view, info))
    # Consistent teaching (Beyer et al. 2022): the teacher sees exactly the student's batch, augmented, then mixed
    # by Mixup/CutMix.
    return lambda images, outputs, targets: distill_loss(outputs, teacher_forward(teacher, images), targets)
