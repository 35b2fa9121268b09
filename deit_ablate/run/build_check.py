"""The launch check that builds the run's pipeline once, before any folder exists: the train and eval transforms
applied to one drawn image, one Mixup/CutMix draw and the loss on a tiny batch, the optimizer stepped and its
schedule evaluated on a stand-in parameter (the model and teacher are built on the meta device by validate.py). What
timm or torch would refuse mid-run is refused here as one line naming the keys that built it. Each piece takes the
config groups it reads, of the config the stage runs (stage_config.py)."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
import typing
import warnings
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from deit_ablate.config.ranges import POLICY_RANGES
from deit_ablate.config.schema import (
    AugmentConfig,
    Config,
    DataBackend,
    DataConfig,
    DistillConfig,
    DistillKind,
    MixConfig,
    OptimizerConfig,
    ResolutionConfig,
    TrainConfig,
)
from deit_ablate.core.errors import ConfigError

T = TypeVar("T")

# The groups check_build reads, in its order: validate.validate_launch hands them over from the stage's config.
BUILT_GROUPS = ("data", "augment", "resolution", "mix", "distill", "optimizer", "train")
# The side of the drawn image: any size works, as every transform resizes or crops to the stage's size.
DRAWN_SIDE = 40
# Optimizer updates per epoch of the stand-in schedule: enough for a warm-up and a decay to be evaluated.
STAND_IN_STEPS = 4


@functools.cache
def schema_arities(node: type = Config, prefix: str = "") -> tuple[tuple[str, int], ...]:
    """(dotted key, item count) of every fixed-length tuple key of the schema (data.mean, optimizer.betas, ...):
    OmegaConf stores them as lists of any length."""
    hints = typing.get_type_hints(node)
    found: list[tuple[str, int]] = []
    for item in fields(node):
        kind = hints[item.name]
        if is_dataclass(kind):
            found += schema_arities(kind, f"{prefix}{item.name}.")
            continue
        args = typing.get_args(kind)
        if typing.get_origin(kind) is tuple and args and Ellipsis not in args:
            found.append((prefix + item.name, len(args)))
    return tuple(found)


def check_arities(groups: dict[str, Any]) -> None:
    """Every fixed-length tuple key of `groups` (name: config group) holds as many items as its type says (three
    channels, Adam's two betas)."""
    for key, count in schema_arities():
        group, name = key.split(".", 1)
        value = OmegaConf.select(groups[group], name) if group in groups else None
        if isinstance(value, ListConfig | list | tuple) and len(value) != count:
            default = OmegaConf.select(OmegaConf.structured(Config), key)
            raise ConfigError(f"{key}=[{', '.join(map(str, value))}] has {len(value)} item(s) but takes {count} "
                              f"(e.g. the default {key}=[{', '.join(map(str, default))}]).")


def check_policy_counts(policy: str | None) -> None:
    """The loop counts of an auto-augment policy string (RandAugment's ops, AugMix's chains and depth) within
    config/ranges.py's POLICY_RANGES; its grammar is validate.check_auto_augment's."""
    kind, *sections = (policy or "").split("-")
    for section in sections:
        match = re.fullmatch(r"([a-z]+)(\d+)", section)
        bounds = POLICY_RANGES.get(kind, {}).get(match[1]) if match else None
        if bounds is not None and not bounds.holds(float(match[2])):
            raise ConfigError(f"augment.auto_augment={policy}: '{match[1]}' in section '{section}' must be {bounds}: "
                              f"{bounds.hint}.")


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """Run the block without moving Python's, numpy's or torch's global generators (the run draws after it)."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])


def flat(**groups: Any) -> dict[str, Any]:
    """`group.key`: value for every leaf key of `groups` (config groups by name), for refused's message."""
    return {f"{group}.{key}": value for group, node in groups.items() for key, value in node.items()
            if not isinstance(value, DictConfig)}


def refused(what: str, values: dict[str, Any], build: Callable[[], T]) -> T:
    """`build()`, or a ConfigError naming what failed to build and the keys of `values` (flat) whose value the error
    names (the groups of `values` where none is named)."""
    try:
        with warnings.catch_warnings():  # the run says its own warnings (e.g. a floor above the peak lr) once
            warnings.simplefilter("ignore")
            return build()
    except ConfigError:
        raise
    except Exception as error:  # whatever timm or torch raise for a value they cannot take: KeyError, ValueError, ...
        text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}"
        named = [f"{key}={value}" for key, value in values.items()
                 if value is not None and not isinstance(value, bool) and str(value) and str(value) in text]
        groups = sorted({key.split(".")[0] for key in values})
        culprits = f"the value it names: {', '.join(named)}" if named else f"the keys it reads ({', '.join(groups)})"
        raise ConfigError(f"{what} cannot be built from this config: timm/torch refuse it ({text}). Change "
                          f"{culprits}.") from None


def _spec_key(**groups: Any) -> str:
    """The groups' values as one string, for the cache below (a sweep's runs mostly share their transforms)."""
    return json.dumps({name: OmegaConf.to_container(node, resolve=True, enum_to_str=True)
                       for name, node in groups.items()}, sort_keys=True, default=str)


# The filters timm's train and eval transforms both resize with (timm.data.transforms.str_to_pil_interp).
RESIZE_FILTERS = ("bicubic", "bilinear", "nearest", "box", "hamming", "lanczos")


@functools.lru_cache(maxsize=32)
def _transforms_built(key: str) -> None:
    """Build the train and eval transforms of the config `key` (_spec_key) and apply them to one drawn image."""
    from PIL import Image

    from deit_ablate.data.batch import split_for_batches
    from deit_ablate.data.transforms import (
        TransformSpec,
        build_eval_transform,
        build_train_pipeline,
        build_train_transform,
    )

    groups = OmegaConf.create(json.loads(key))
    spec = TransformSpec(groups.data, groups.augment, groups.resolution)
    pixels = np.random.default_rng(0).integers(0, 256, (DRAWN_SIDE, DRAWN_SIDE + 8, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)

    def train() -> None:
        build_train_pipeline(spec)  # what the loader runs (the fast crop, or none under DALI)
        per_image, per_batch = split_for_batches(build_train_transform(spec))
        if groups.data.backend == DataBackend.dali:  # DALI augments on its own: only the batch part runs here
            size = groups.resolution.train_size
            batch = torch.zeros(2, size, size, 3, dtype=torch.uint8)
        else:
            batch = torch.stack([per_image(image), per_image(image)])
        per_batch(batch)

    def evaluate() -> None:
        out = build_eval_transform(spec)(image)
        size = groups.resolution.eval_size
        if tuple(out.shape) != (3, size, size):
            raise ValueError(f"the eval transform gives {tuple(out.shape)} images, not (3, {size}, {size})")

    values = flat(data=groups.data, augment=groups.augment, resolution=groups.resolution)
    refused("the training transform", values, train)
    refused("the evaluation transform", values, evaluate)


def check_interpolation(name: str) -> None:
    """augment.interpolation: a filter timm's train and eval resizes both take (its `random` only trains)."""
    if name not in RESIZE_FILTERS:
        raise ConfigError(f"augment.interpolation={name} is not a resize filter of timm's train and eval transforms: "
                          f"use one of {', '.join(RESIZE_FILTERS)} (DeiT: bicubic).")


def check_transforms(data: DataConfig, augment: AugmentConfig, resolution: ResolutionConfig) -> None:
    """The stage's train and eval transforms built and applied to one drawn image (once per distinct config)."""
    check_interpolation(augment.interpolation)
    _transforms_built(_spec_key(data=data, augment=augment, resolution=resolution))


def check_mix_and_loss(mix: MixConfig, distill: DistillConfig, num_classes: int) -> None:
    """One Mixup/CutMix draw on a batch of two tiny images and the stage's loss on it (with the teacher term of its
    distillation kind, on stand-in teacher logits)."""
    from deit_ablate.train.losses import TOKEN_KINDS, DistillationLoss, build_criterion, build_mixup

    classes = int(num_classes)
    images, targets = torch.zeros(2, 3, 8, 8), torch.tensor([0, 1 % classes])

    def draw() -> tuple[Any, torch.Tensor]:
        mixup = build_mixup(mix, classes)
        return mixup, (mixup(images, targets)[1] if mixup is not None else targets)

    mixup, mixed = refused("Mixup/CutMix", flat(mix=mix), draw)

    def loss() -> None:
        criterion = build_criterion(mix, mixup)
        logits = torch.zeros(2, classes)
        if distill.type == DistillKind.none:
            criterion(logits, mixed)
            return
        outputs = (logits, logits) if distill.type in TOKEN_KINDS else logits
        DistillationLoss(criterion, distill.type, distill.alpha, distill.tau, distill.kl_normalization)(
            outputs, torch.zeros(2, classes), mixed)

    refused("the loss", flat(mix=mix, distill=distill), loss)


def check_optimizer(opt: OptimizerConfig, train: TrainConfig) -> None:
    """The stage's optimizer (its `optimizer` and `train` blocks, as stages.stage_recipe reads them) built on a
    stand-in parameter and stepped once, and its warm-up + cosine schedule evaluated over a stand-in run of a few
    updates per epoch (as assemble.stage_scheduler builds it). A ViT's layer-wise lr decay is checked on the model
    (validate.check_layer_decay)."""
    from deit_ablate.train.optim import build_optimizer, build_scheduler, scaled_lr

    module = torch.nn.Linear(4, 4)  # a weight that decays and a bias that does not
    values = flat(optimizer=opt, train=train)

    def optimizer() -> torch.optim.Optimizer:
        lr = scaled_lr(opt.lr, train.global_batch, opt.lr_base_batch)
        built = build_optimizer(module, opt.name, lr, opt.weight_decay, opt.momentum, tuple(opt.betas), opt.eps)
        module(torch.ones(2, 4)).sum().backward()
        built.step()
        return built

    built = refused(f"the optimizer ({opt.name})", values, optimizer)

    def schedule() -> None:
        total = train.epochs * STAND_IN_STEPS
        warmup = min(round(opt.warmup_epochs * STAND_IN_STEPS), max(total - 1, 0))
        scheduler = build_scheduler(built, total, warmup, opt.min_lr, opt.warmup_lr)
        for step in sorted({0, 1, total // 2, max(total - 1, 0), total}):  # a few points: epochs may be many
            scheduler.step_update(num_updates=step)

    refused("the learning-rate schedule", values, schedule)


def check_build(data: DataConfig, augment: AugmentConfig, resolution: ResolutionConfig, mix: MixConfig,
                distill: DistillConfig, optimizer: OptimizerConfig, train: TrainConfig) -> None:
    """Build the stage's pipeline (the BUILT_GROUPS of the config the stage runs) once without moving the global
    random generators; a ConfigError naming the keys where timm or torch refuse a piece."""
    check_arities({"data": data, "augment": augment, "optimizer": optimizer})
    check_policy_counts(augment.auto_augment)
    with kept_random_state(), torch.device("cpu"):
        check_transforms(data, augment, resolution)
        check_mix_and_loss(mix, distill, data.num_classes)
        check_optimizer(optimizer, train)
