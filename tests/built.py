"""What a run builds, as plain data to compare: the reference the generated identity test holds the identity to.

Built from the code that trains, never from the identity's rules: each stage's transforms applied to a fixed image,
its Mixup/CutMix draws on a fixed batch, the loss on fixed outputs, the model and teacher on the meta device, the
optimizer's groups, the schedule's lr at sampled updates, the sampler's order, the loop's length and evaluation; a
fine-tune also what its pre-training builds, a transfer its source run's, a chained student its teacher run's.
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from deit_ablate.config.compose import compose_run_config
from deit_ablate.config.schema import DistillKind, Stage
from deit_ablate.config.stage_config import stage_config
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.streams import RunStreams
from deit_ablate.data.loader import SeededSamples, build_train_sampler
from deit_ablate.data.transforms import TransformSpec, build_eval_transform, build_train_pipeline
from deit_ablate.record.overrides import pretrain_overrides, transfer_source_overrides
from deit_ablate.record.rundir import RunDir
from deit_ablate.run.architecture import meta_model
from deit_ablate.run.assemble import stage_optimizer, stage_scheduler
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.stages import stage_recipe, teacher_run_overrides
from deit_ablate.run.student import student_spec
from deit_ablate.run.validate import plan_batch
from deit_ablate.train.losses import DistillationLoss, build_criterion, build_mixup

IMAGENET_TRAIN = 1_281_167  # a dataset's size stands for what the sampler deals (no folder is read here)
DRAWS = 8  # an augmentation's draws on the fixed image: enough to see a probability moved to 0 or 1
MIX_DRAWS = 32  # Mixup/CutMix's draws on a tiny batch (cheap): enough to see a probability moved by 0.3
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_CACHE: dict[tuple[str, ...], dict[str, Any]] = {}


def digest(value: Any) -> str:
    """A short hash of a tensor, an array or any printable value."""
    if isinstance(value, torch.Tensor):
        value = value.detach().float().numpy()
    if isinstance(value, np.ndarray):
        return hashlib.sha1(np.ascontiguousarray(value.round(5)).tobytes() + str(value.shape).encode()).hexdigest()[:12]
    return hashlib.sha1(_ADDRESS.sub("", repr(value)).encode()).hexdigest()[:12]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fixed_image(size: int = 40) -> Image.Image:
    """The image every transform is applied to."""
    pixels = np.random.default_rng(0).integers(0, 256, (size, size + 8, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def transforms_built(settings: DictConfig) -> dict[str, Any]:
    """The stage's training and evaluation transforms: their structure and their outputs on the fixed image."""
    spec = TransformSpec(settings.data, settings.augment, settings.resolution)
    per_image, per_batch = build_train_pipeline(spec)
    out: dict[str, Any] = {"train": repr(per_image), "batch": repr(per_batch), "backend": str(settings.data.backend)}
    image = fixed_image()
    if per_image is not None:
        draws = []
        for draw in range(DRAWS):
            seed_everything(draw)
            pixels = per_image(image)
            pixels = torch.as_tensor(np.asarray(pixels)) if not isinstance(pixels, torch.Tensor) else pixels
            draws.append(digest(per_batch(pixels.unsqueeze(0)) if pixels.dim() == 3 else pixels))
        out["train_draws"] = draws
    seed_everything(0)
    out["eval"] = digest(build_eval_transform(spec)(image))
    return out


def mixing_built(settings: DictConfig, distils: bool) -> dict[str, Any]:
    """Mixup/CutMix draws on a fixed batch and the loss (with the teacher term when distilling) on fixed outputs."""
    classes = int(settings.data.num_classes)
    mixup = build_mixup(settings.mix, classes)
    criterion = build_criterion(settings.mix, mixup)
    loss = DistillationLoss(criterion, settings.distill.type, settings.distill.alpha, settings.distill.tau,
                            settings.distill.kl_normalization) if distils else None
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 8, 8, generator=generator)
    labels = torch.arange(4) % classes
    outputs = torch.randn(4, classes, generator=generator)
    teacher = torch.randn(4, classes, generator=generator)
    draws = []
    for draw in range(MIX_DRAWS):
        seed_everything(draw)
        mixed, targets = mixup(images.clone(), labels.clone()) if mixup is not None else (images, labels)
        student = (outputs, outputs.flip(0)) if distils and settings.distill.type in ("hard_token", "soft_token") \
            else outputs
        value = loss(student, teacher, targets) if loss is not None else criterion(outputs, targets)
        draws.append((digest(mixed), digest(targets), round(float(value), 5)))
    return {"criterion": repr(criterion), "mix_draws": draws}


def model_built(settings: DictConfig) -> dict[str, Any]:
    """The network the stage trains (on meta): its modules, drop rates included, and its weights' shapes."""
    model = meta_model(student_spec(settings), int(settings.resolution.train_size))
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    out = {"modules": digest(repr(model)), "shapes": digest(shapes)}
    if hasattr(model, "head_dist"):  # a distilled ViT is scored by fusing its two heads (trainer._head_scores)
        out["fusion"] = str(settings.distill.fusion)
    return out


def optimization_built(settings: DictConfig, declared: DictConfig, steps_per_epoch: int) -> dict[str, Any]:
    """The optimizer's class and groups (each group's settings and parameters) and the lr at sampled updates."""
    recipe = stage_recipe(declared, RunDir(Path("/nonexistent/upstream")))
    model = meta_model(student_spec(settings), int(settings.resolution.train_size))
    optimizer = stage_optimizer(settings.optimizer, recipe, model, DistInfo())
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [({k: v for k, v in group.items() if k != "params"}, [names[id(p)] for p in group["params"]])
              for group in optimizer.param_groups]
    scheduler = stage_scheduler(optimizer, recipe, steps_per_epoch)
    total = max(recipe.epochs * steps_per_epoch, 1)
    marks = sorted({0, 1, 2, total - 1, *np.linspace(0, total - 1, 41).astype(int).tolist(),
                    *(round(recipe.warmup_epochs * steps_per_epoch) + d for d in (-1, 0, 1))})
    curve = []  # (update, the groups' lr) where the lr moves: a flat schedule is one point, wherever sampled
    for step in (m for m in marks if 0 <= m < total):
        scheduler.step_update(num_updates=step)
        lrs = tuple(round(g["lr"], 12) for g in optimizer.param_groups)
        if not curve or curve[-1][1] != lrs:
            curve.append((step, lrs))
    return {"optimizer": type(optimizer).__name__, "groups": digest(groups), "lr": digest(curve),
            "sam_rho": recipe.sam_rho, "train_mode": recipe.train_mode, "clip": settings.optimizer.clip_grad}


def data_built(settings: DictConfig) -> tuple[dict[str, Any], int]:
    """What the stage trains on (the built-in set by what draws it; other data by name and size) and its size."""
    data = settings.data
    if str(data.name) == "builtin":
        drawn = OmegaConf.to_container(data.builtin, resolve=True)
        size = int(data.builtin.train_per_class) * int(data.num_classes)
    else:
        drawn = {"name": str(data.name)}
        size = IMAGENET_TRAIN if str(data.name) == "imagenet" else 50_000
    size = max(int(size * float(data.fraction)), 1)
    return {"drawn": drawn, "classes": int(data.num_classes), "fraction": float(data.fraction),
            "fast_jpeg": bool(data.fast_jpeg)}, size


def loop_built(settings: DictConfig, size: int) -> tuple[dict[str, Any], int]:
    """The batch plan, the sampler's first-epoch order and seeds, the loop's length, EMA, precision, evaluation."""
    batch = plan_batch(settings, 1)
    sampler = build_train_sampler(min(size, 4096), int(settings.augment.repeated_aug), batch.slots,
                                  batch.slots_of(0), batch.micro_batch)
    samples = SeededSamples(sampler, RunStreams(int(settings.seed), 0))
    samples.set_epoch(0)
    order = list(samples)[:64]
    full = build_train_sampler(size, int(settings.augment.repeated_aug), batch.slots, batch.slots_of(0),
                               batch.micro_batch)
    steps = len(full) // batch.per_rank_batch
    train = settings.train
    return {"slots": batch.slots, "micro": batch.micro_batch, "order": digest(order), "steps": steps,
            "epochs": int(train.epochs), "max_steps": train.max_steps, "ema": train.ema_decay if train.ema else None,
            "amp": str(train.amp), "eval_max_batches": train.eval_max_batches,
            "eval_max_images": train.get("eval_max_images"),
            "eval_size": int(settings.resolution.eval_size)}, max(steps, 1)


def teacher_built(settings: DictConfig, overrides: list[str]) -> dict[str, Any] | None:
    """The teacher the stage distils from: its network (meta) and how it is applied; a chained teacher is its own
    run, built in full; a fixed one its checkpoint file."""
    distill = settings.distill
    teacher = distill.teacher
    kwargs = OmegaConf.to_container(teacher.kwargs, resolve=True)
    out: dict[str, Any] = {"view": str(distill.teacher_view), "sizes": OmegaConf.to_container(teacher.sizes)
                           if teacher.sizes is not None else None}
    chained = teacher_run_overrides(Lineage.of(settings, overrides))
    if chained is not None:
        out["run"] = run_built(chained)
        return out
    with torch.device("meta"):
        network = timm.create_model(str(teacher.model), num_classes=int(settings.data.num_classes), **kwargs)
    out.update(network=digest(repr(network)), checkpoint=teacher.checkpoint)
    return out


def stage_built(declared: DictConfig, overrides: list[str]) -> dict[str, Any]:
    """Everything one stage builds (the config its stage runs: stage_config)."""
    settings = stage_config(declared)
    distils = str(settings.distill.type) != str(DistillKind.none) and settings.stage != Stage.transfer
    data, size = data_built(settings)
    loop, steps_per_epoch = loop_built(settings, size)
    return {"stage": str(settings.stage), "data": data, "transforms": transforms_built(settings),
            "mixing": mixing_built(settings, distils), "model": model_built(settings),
            "optimization": optimization_built(settings, declared, steps_per_epoch), "loop": loop,
            "teacher": teacher_built(settings, overrides) if distils else None}


def run_built(overrides: list[str]) -> dict[str, Any]:
    """What `python train.py <overrides>` builds, with the runs it starts from (composed here, cached)."""
    key = tuple(overrides)
    if key not in _CACHE:
        declared = compose_run_config(list(overrides))
        built = {"self": stage_built(declared, list(overrides))}
        stage = str(declared.stage)
        if stage == "finetune" and not declared.finetune.init_checkpoint:
            built["pretraining"] = run_built(pretrain_overrides(list(overrides)))
        elif stage == "transfer" and not declared.transfer.init_checkpoint:
            built["source"] = run_built(transfer_source_overrides(list(overrides), str(declared.transfer.source_stage)))
        elif stage != "pretrain":
            block = declared.finetune if stage == "finetune" else declared.transfer
            built["init"] = str(block.init_checkpoint)
        _CACHE[key] = built
    return _CACHE[key]


def differences(first: Any, second: Any, prefix: str = "") -> list[str]:
    """The paths at which two built trees differ."""
    if isinstance(first, dict) and isinstance(second, dict):
        return [path for key in sorted({*first, *second}, key=str)
                for path in differences(first.get(key), second.get(key), f"{prefix}{key}.")]
    return [] if first == second else [prefix.rstrip(".")]
