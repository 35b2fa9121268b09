"""The launch check that builds the run's pipeline once, before any folder exists: the train and eval transforms
applied to one drawn image, one Mixup/CutMix draw and the loss on a tiny batch, the optimizer and its schedule on a
stand-in parameter (the model and teacher are built on the meta device by validate.py). What timm or torch would
refuse mid-run is refused here as one line naming the keys that built it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import random
import typing
import warnings
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from deit_ablate.config.schema import Config, DataBackend, DistillKind
from deit_ablate.core.errors import ConfigError

T = TypeVar("T")

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


def check_arities(cfg: DictConfig) -> None:
    """Every fixed-length tuple key holds as many items as its type says (three channels, Adam's two betas)."""
    for key, count in schema_arities():
        value = OmegaConf.select(cfg, key)
        if isinstance(value, ListConfig | list | tuple) and len(value) != count:
            default = OmegaConf.select(OmegaConf.structured(Config), key)
            raise ConfigError(f"{key}=[{', '.join(map(str, value))}] has {len(value)} item(s) but takes {count} "
                              f"(e.g. the default {key}=[{', '.join(map(str, default))}]).")


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


def _shown(cfg: DictConfig, keys: list[str]) -> str:
    """`key=value` for each of `keys`."""
    return ", ".join(f"{key}={OmegaConf.select(cfg, key)}" for key in keys)


def refused(what: str, cfg: DictConfig, groups: tuple[str, ...], build: Callable[[], T]) -> T:
    """`build()`, or a ConfigError naming what failed to build and the keys of `groups` whose value the error
    names (every key of `groups` where none is named)."""
    try:
        with warnings.catch_warnings():  # the run says its own warnings (e.g. a floor above the peak lr) once
            warnings.simplefilter("ignore")
            return build()
    except ConfigError:
        raise
    except Exception as error:  # whatever timm or torch raise for a value they cannot take: KeyError, ValueError, ...
        text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}"
        keys = [f"{group}.{key}" for group in groups for key, value in OmegaConf.select(cfg, group).items()
                if not isinstance(value, DictConfig)]
        named = [key for key in keys if str(OmegaConf.select(cfg, key)) and str(OmegaConf.select(cfg, key)) in text
                 and OmegaConf.select(cfg, key) is not None and not isinstance(OmegaConf.select(cfg, key), bool)]
        culprits = f"the value it names: {_shown(cfg, named)}" if named else f"the keys it reads ({', '.join(groups)})"
        raise ConfigError(f"{what} cannot be built from this config: timm/torch refuse it ({text}). Change "
                          f"{culprits}.") from None


def _spec_key(cfg: DictConfig, groups: tuple[str, ...]) -> str:
    """The groups' values as one string, for the caches below (a sweep's runs mostly share their transforms)."""
    return json.dumps({group: OmegaConf.to_container(cfg[group], resolve=True, enum_to_str=True) for group in groups},
                      sort_keys=True, default=str)


TRANSFORM_GROUPS = ("data", "augment", "resolution")
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

    cfg = OmegaConf.create(json.loads(key))
    spec = TransformSpec(cfg.data, cfg.augment, cfg.resolution)
    pixels = np.random.default_rng(0).integers(0, 256, (DRAWN_SIDE, DRAWN_SIDE + 8, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)

    def train() -> None:
        build_train_pipeline(spec)  # what the loader runs (the fast crop, or none under DALI)
        per_image, per_batch = split_for_batches(build_train_transform(spec))
        if cfg.data.backend == DataBackend.dali:  # DALI augments on its own: only the batch part runs here
            size = cfg.resolution.train_size
            batch = torch.zeros(2, size, size, 3, dtype=torch.uint8)
        else:
            batch = torch.stack([per_image(image), per_image(image)])
        per_batch(batch)

    def evaluate() -> None:
        out = build_eval_transform(spec)(image)
        size = cfg.resolution.eval_size
        if tuple(out.shape) != (3, size, size):
            raise ValueError(f"the eval transform gives {tuple(out.shape)} images, not (3, {size}, {size})")

    refused("the training transform", cfg, TRANSFORM_GROUPS, train)
    refused("the evaluation transform", cfg, TRANSFORM_GROUPS, evaluate)


def check_interpolation(name: str) -> None:
    """augment.interpolation: a filter timm's train and eval resizes both take (its `random` only trains)."""
    if name not in RESIZE_FILTERS:
        raise ConfigError(f"augment.interpolation={name} is not a resize filter of timm's train and eval transforms: "
                          f"use one of {', '.join(RESIZE_FILTERS)} (DeiT: bicubic).")


def check_transforms(cfg: DictConfig) -> None:
    """The stage's train and eval transforms built and applied to one drawn image (once per distinct config)."""
    check_interpolation(cfg.augment.interpolation)
    _transforms_built(_spec_key(cfg, TRANSFORM_GROUPS))


def check_mix_and_loss(cfg: DictConfig) -> None:
    """One Mixup/CutMix draw on a batch of two tiny images and the stage's loss on it (with the teacher term of its
    distillation kind, on stand-in teacher logits)."""
    from deit_ablate.train.losses import TOKEN_KINDS, DistillationLoss, build_criterion, build_mixup

    classes = int(cfg.data.num_classes)
    images, targets = torch.zeros(2, 3, 8, 8), torch.tensor([0, 1 % classes])

    def mix() -> tuple[Any, torch.Tensor]:
        mixup = build_mixup(cfg.mix, classes)
        return mixup, (mixup(images, targets)[1] if mixup is not None else targets)

    mixup, mixed = refused("Mixup/CutMix", cfg, ("mix",), mix)

    def loss() -> None:
        criterion = build_criterion(cfg.mix, mixup)
        logits = torch.zeros(2, classes)
        if cfg.distill.type == DistillKind.none:
            criterion(logits, mixed)
            return
        distill = cfg.distill
        outputs = (logits, logits) if distill.type in TOKEN_KINDS else logits
        DistillationLoss(criterion, distill.type, distill.alpha, distill.tau, distill.kl_normalization)(
            outputs, torch.zeros(2, classes), mixed)

    refused("the loss", cfg, ("mix", "distill"), loss)


def check_optimizer(cfg: DictConfig) -> None:
    """The stage's optimizer built on a stand-in parameter and stepped once, and its schedule evaluated over a
    stand-in run of a few updates per epoch."""
    from deit_ablate.core.distributed import DistInfo
    from deit_ablate.record.rundir import RunDir
    from deit_ablate.run.assemble import stage_optimizer, stage_scheduler
    from deit_ablate.run.stages import stage_recipe

    # a later stage's recipe names the checkpoint it starts from: a stand-in folder, as nothing is loaded here
    # (a ViT's layer-wise lr decay is checked on the model: validate.check_layer_decay)
    recipe = dataclasses.replace(stage_recipe(cfg, RunDir(Path("stand-in"))), layer_decay=None)
    module = torch.nn.Linear(4, 4)  # a weight that decays and a bias that does not

    def optimizer() -> torch.optim.Optimizer:
        built = stage_optimizer(cfg.optimizer, recipe, module, DistInfo())
        module(torch.ones(2, 4)).sum().backward()
        built.step()
        return built

    built = refused(f"the optimizer ({recipe.optimizer})", cfg, ("optimizer",), optimizer)

    def schedule() -> None:
        scheduler = stage_scheduler(built, recipe, STAND_IN_STEPS)
        total = recipe.epochs * STAND_IN_STEPS
        for step in sorted({0, 1, total // 2, max(total - 1, 0), total}):  # a few points: epochs may be many
            scheduler.step_update(num_updates=step)

    refused("the learning-rate schedule", cfg, ("optimizer", "train"), schedule)


def check_build(cfg: DictConfig) -> None:
    """Build the stage's pipeline (`cfg`: the config the stage runs, stage_config.py) once without touching the
    global random generators; a ConfigError naming the keys where timm or torch refuse a piece."""
    check_arities(cfg)
    with kept_random_state(), torch.device("cpu"):
        check_transforms(cfg)
        check_mix_and_loss(cfg)
        check_optimizer(cfg)
