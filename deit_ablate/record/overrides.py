"""The overrides of the runs a run starts from, derived from its own: a fine-tune's pre-training, a transfer's source
run, a chained student's teacher run; and the command that trains a run."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

from deit_ablate.config.keys import TRANSFER_ONLY
from deit_ablate.config.studies import study_names

# Overrides that pick the stage of a run rather than the experiment it continues.
STAGE_OVERRIDES = ("stage", "resolution")

# The keys that name the dataset a transfer moves to (its source run trained on another).
TRANSFER_DATA_KEYS = ("data", "data.name", "data.root", "data.num_classes", "data.mean", "data.std",
                      "data.builtin.classes")

# The overrides a chained teacher run leaves out besides every study row (Table 2's, Table 5's ⚗ rows): the student's
# distillation and its model's keys (the teacher is conf/model/<chain>.yaml as it stands, with the DeiT recipe), and
# its layout (layout=released is the released DeiT commands' per-GPU batch; a teacher has no such command).
CHAIN_DROPPED = ("distill", "model", "layout")
# What a transfer run sets that its source run never had: its study row and recipe, and the rule of that recipe.
TRANSFER_OVERRIDES = (TRANSFER_ONLY, "transfer_recipe")


def override_key(item: str) -> str:
    """The key or group an override sets (`mix.prob` of `++mix.prob=0`)."""
    return item.split("=", 1)[0].lstrip("+~")


def pretrain_overrides(overrides: list[str]) -> list[str]:
    """The overrides of the pre-training run that a fine-tune launched with `overrides` continues."""
    return [item for item in overrides
            if override_key(item) not in STAGE_OVERRIDES and override_key(item).split(".", 1)[0] != "finetune"]


def named_by_finetune(stage: str, overrides: list[str]) -> list[str] | None:
    """The overrides a fine-tune names this pre-training by (its own without the stage, the resolution and
    finetune.*), when they compose the same run: its own without `stage=pretrain`, the default; else None."""
    named = pretrain_overrides(overrides)
    return named if stage == "pretrain" and sorted(set(overrides) - {"stage=pretrain"}) == sorted(named) else None


def transfer_source_overrides(overrides: list[str], source_stage: str) -> list[str]:
    """The overrides of the run that a transfer launched with `overrides` fine-tunes on its new data: the same
    without the stage, resolution, the transfer row and recipe and the new dataset's keys, at `source_stage`."""
    kept = [item for item in overrides if override_key(item) not in (*STAGE_OVERRIDES, *TRANSFER_DATA_KEYS)
            and override_key(item).split(".", 1)[0] not in TRANSFER_OVERRIDES]
    return kept if source_stage == "pretrain" else [f"stage={source_stage}", *kept]


def swap_overrides(overrides: list[str], choice: str, drop_keys: tuple[str, ...] = ()) -> list[str]:
    """`overrides` with `choice` (`group=option`) in place of that group's own, and without those of `drop_keys`."""
    group = override_key(choice)
    return [choice, *(item for item in overrides if override_key(item) not in (group, *drop_keys))]


def train_command(overrides: list[str]) -> str:
    """The command line that trains the run of `overrides`."""
    return " ".join(["python train.py", *(shlex.quote(item) for item in overrides)])


def chained_teacher_overrides(chain: str, kwargs: Mapping[str, Any], overrides: list[str]) -> list[str]:
    """The overrides of the teacher run a student launched with `overrides` distils from (distill.teacher.chain):
    the student's pre-training overrides without study rows, distill.* and model.* ones, plus model=<chain> and
    distill.teacher.kwargs (`kwargs`) as its model.kwargs (Table 2's demo CNNs of three sizes)."""
    dropped = (*CHAIN_DROPPED, *study_names())
    sized = [f"++model.kwargs.{key}={json.dumps(value, separators=(',', ':'))}"
             for key, value in sorted(kwargs.items())]
    return [f"model={chain}", *sized,
            *(item for item in pretrain_overrides(overrides) if override_key(item).split(".", 1)[0] not in dropped)]
