"""A run's identity changes if and only if what the run builds changes: generated from the schema, every key.

For each leaf of the schema (deit_ablate/config/schema.py) but the execution settings, and for each route a key
reaches a run by (the pre-training; a fine-tune, through the composed config or its override set; a transfer's
override set; a fixed and a chained teacher; a fine-tune that distils only through its override set), the key is
flipped to a valid value other than its own, and two things are compared with the run before: its identity digest
(record/identity.py) and what it builds (tests/built.py, built by the code that trains, from the run's own config and
the runs it starts from). A flip that changes the identity and nothing built splits one computation over two
folders; one that changes what is built and not the identity puts two computations under one identity. The default
suite runs a fixed sample of (key, route) pairs; the slow tier runs every pair.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import types
import typing
import zlib
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from built import differences, run_built

from deit_ablate.config import schema
from deit_ablate.config.compose import compose_run_config
from deit_ablate.config.keys import NOT_EXPERIMENT
from deit_ablate.config.stage_config import NAMED_KEYS, OVERRIDABLE, STAGE_BLOCKS
from deit_ablate.record.identity import composed_choices, run_identity
from deit_ablate.run.validate import validate_config

TEACHERS = Path(tempfile.mkdtemp(prefix="identity-teachers-"))  # the fixed teachers' checkpoints (teacher_files)
# A valid other value for each text key (the schema's type says nothing of which texts are valid): a new text key
# needs one here, and the test says so.
TEXT_VALUES: dict[str, list[Any]] = {
    "preset": ["paper"],
    "model.name": ["deit3_small_patch16_224"],  # a family whose defaults the kwargs leave
    "model.distilled_name": ["deit_small_distilled_patch16_224"],
    "data.builtin.classes": ["shapes_b"],
    "augment.auto_augment": ["rand-m7-mstd0.5-inc1", None],
    "augment.interpolation": ["bilinear"],
    "distill.teacher.model": ["resnet18"],
    "distill.teacher.checkpoint": [str(TEACHERS / "other.pt")],
    "distill.teacher.chain": ["cnn_demo"],
    "optimizer.name": ["sgd", "lamb"],
    "optimizer.sched": ["none", "step"],  # step: the demo fine-tune's flat lr decays in no 3 epochs
    "finetune.init_checkpoint": ["/weights/pretrained.pt"],
    "finetune.optimizer": ["sgd"],
    "transfer.init_checkpoint": ["/weights/source.pt"],
    "transfer.optimizer": ["adamw"],
    "data.root": ["/data/elsewhere"],
    "train.micro_batch": [64],  # a divisor of the demo's global batch of 128 (the schema's 128 has no other)
    "finetune.pretrain_size": [32],  # the demo's pre-training size: any other is refused (validate.py)
}
# Mappings: one entry added (a route's override sets are the routes themselves, not keys to flip).
MAPPING_VALUES: dict[str, list[tuple[str, Any]]] = {
    "model.kwargs": [("depth", 2)],
    "distill.teacher.kwargs": [("global_pool", "max")],  # no weights of its own: the checkpoint still loads
}
ROUTE_KEYS = ("finetune.overrides", "transfer.overrides")
# The settings that need another one beside them to make a valid run (the launch refuses either alone).
COMPANIONS: dict[str, Any] = {
    "mix.criterion": lambda value: ["++mix.label_smoothing=0.0"],  # BCE takes no smoothing (DeiT III)
    "augment.three_augment": lambda value: ["++augment.auto_augment=null"],  # it replaces the policy
    "resolution.train_size": lambda value: [f"++resolution.eval_size={value}"],  # a ViT takes one size
    "resolution.eval_size": lambda value: [f"++resolution.train_size={value}"],
    "distill.type": lambda value: [f"++distill.teacher.checkpoint={TEACHERS / 'teacher.pt'}"],
}
# Keys no flip here can reach, and why.
NOT_FLIPPED = {
    "preset": "the paper preset trains on ImageNet: a launch needs its folder on disk",
    "data.name": "every other dataset needs its files on disk",
    "stage": "the routes are the stages",
    "train.eval_max_batches": "refused whatever its value (replaced by train.eval_max_images)",
}
# Flips that change the identity and nothing built, kept so, and why (each must still split: the test says when one
# stops, so that it leaves this list).
KNOWN_SPLITS = {
    ("finetune.pretrain_size", "finetune"): "it names the size the row's pre-training trains at (held to the "
    "pre-training's own, validate.check_upstream_size): the rows whose pre-trainings differ only in size need it, and "
    "a fine-tune of the default size that spells it out is another folder",
    ("finetune.pretrain_size", "finetune_distils_by_set"): "as on the finetune route",
    ("data.builtin.classes", "transfer_set"): "an override-set entry equal to the value the stage has without it "
    "stays (recipes spell their stages' values out, and their runs keep their identity)",
}
ROUTES: dict[str, tuple[list[str], str]] = {
    # name: (the run's overrides, how a flip reaches it: "key" sets the key, "finetune"/"transfer" the stage's set)
    "pretrain": ([], "key"),
    "finetune": (["stage=finetune"], "key"),
    "finetune_set": (["stage=finetune"], "finetune"),
    "transfer_set": (["stage=transfer", "transfer=builtin_b"], "transfer"),
    "fixed_teacher": (["distill=soft", f"distill.teacher.checkpoint={TEACHERS / 'teacher.pt'}"], "key"),
    "chained_teacher": (["ablation=no_mixup_cutmix", "model=vit_demo_distilled", "distill=hard_token",
                         "distill.teacher.chain=cnn_demo"], "key"),
    "finetune_distils_by_set": (["stage=finetune", "++finetune.overrides.distill.type=soft",
                                 "++finetune.overrides.distill.alpha=0.5",
                                 f"distill.teacher.checkpoint={TEACHERS / 'teacher.pt'}"], "key"),
}
SAMPLE = 20  # (key, route) pairs in the default suite (the slow tier flips every one)


def schema_leaves(node: type = schema.Config, prefix: str = "") -> dict[str, tuple[Any, Any, Any]]:
    """`{dotted key: (type, default, range)}` of every schema leaf."""
    out: dict[str, tuple[Any, Any, Any]] = {}
    hints = typing.get_type_hints(node)
    for field in dataclasses.fields(node):
        kind = hints[field.name]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if dataclasses.is_dataclass(kind):
            out.update(schema_leaves(kind, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = (kind, default, field.metadata.get("range"))
    return out


def experiment_keys() -> list[str]:
    """The schema's keys that could be the experiment: all but the execution settings and the route keys."""
    return [key for key in schema_leaves() if key.split(".")[0] not in NOT_EXPERIMENT and key not in ROUTE_KEYS]


def _numbers(default: float, bounds: Any, integer: bool) -> list[float]:
    low = bounds.low if bounds is not None and bounds.low is not None else -math.inf
    high = bounds.high if bounds is not None and bounds.high is not None else math.inf
    if default is None:
        candidates = [low + 1 if integer and low > -math.inf else 2, 0.5]
    elif integer:
        candidates = [default * 2, default + 1, default - 1]
    else:
        candidates = [0.0, 1.0, default * 2, default / 2, default + 0.3]
    return [c for c in candidates if (c > low if bounds and bounds.low_open else c >= low)
            and (c < high if bounds and bounds.high_open else c <= high) and c != default
            and (not integer or float(c).is_integer())]


def flips(key: str) -> list[Any]:
    """Values of `key` other than its schema default, most telling first; a KeyError names a text key without
    TEXT_VALUES."""
    kind, default, bounds = schema_leaves()[key]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    inner = next((a for a in args if a is not type(None)), kind) if origin in (typing.Union, types.UnionType) \
        else kind
    if key in TEXT_VALUES:
        return TEXT_VALUES[key]
    if key in MAPPING_VALUES:
        return MAPPING_VALUES[key]
    if inner is bool:
        return [not default]
    if isinstance(inner, type) and issubclass(inner, Enum):
        return [member for member in inner if member != default]
    if inner in (int, float):
        return [int(c) if inner is int else c for c in _numbers(default, bounds, inner is int)]
    if typing.get_origin(inner) in (tuple, list):
        element = typing.get_args(inner)[0]
        first = default[0] if default else None
        if default is None:
            return [[16, 24]] if element is int else [[0.5]]
        return [[int(c) if element is int else c, *default[1:]] for c in _numbers(first, bounds, element is int)]
    raise KeyError(f"{key}: no valid other value is known for a key of type {kind}: add it to TEXT_VALUES or "
                   "MAPPING_VALUES in tests/test_identity_generated.py")


def override(key: str, value: Any, how: str) -> str:
    """The override that sets `key` to `value` on the route's way (`how`)."""
    if isinstance(value, tuple):  # a mapping's new entry
        entry, value = value
        key = f"{key}.{entry}"
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else \
        str(value.value) if isinstance(value, Enum) else str(list(value)).replace(" ", "") \
        if isinstance(value, list) else str(value)
    return f"++{key}={text}" if how == "key" else f"++{how}.overrides.{key}={text}"


def reaches(key: str, how: str) -> bool:
    """Whether a route can carry `key`: a stage's override set takes the groups a stage may change."""
    return how == "key" or key.split(".")[0] in OVERRIDABLE


def write_teachers() -> None:
    """Two checkpoints of the demo CNN teacher (resnet10t, 10 classes): the fixed teachers' files."""
    import timm
    import torch

    for seed, name in enumerate(("teacher.pt", "other.pt")):
        if not (TEACHERS / name).is_file():
            torch.manual_seed(seed)
            torch.save(timm.create_model("resnet10t", num_classes=10).state_dict(), TEACHERS / name)


def identity_and_built(overrides: list[str]) -> tuple[str, dict[str, Any]] | None:
    """The run's identity digest and what it builds; None when the launch would refuse the config or a run it starts
    from could not be built (a flip the pre-training of a fine-tune cannot take). Kept per overrides: a route's run
    is the base of every flip on it."""
    key = tuple(overrides)
    if key not in _BUILT:
        _BUILT[key] = _identity_and_built(list(overrides))
    return _BUILT[key]


_BUILT: dict[tuple[str, ...], tuple[str, dict[str, Any]] | None] = {}


def _identity_and_built(overrides: list[str]) -> tuple[str, dict[str, Any]] | None:
    try:
        cfg = compose_run_config(overrides)
        validate_config(cfg)
        built = run_built(overrides)
    except Exception:  # noqa: BLE001 -- an invalid flip (Hydra's, OmegaConf's, timm's or our own refusal) is not a run
        return None
    return run_identity(cfg, overrides, composed_choices(cfg)).digest, built


def check_pair(key: str, route: str) -> str | None:
    """The mismatch of one flip on one route (None: identity and what is built agree), or 'skip: ...'."""
    base, how = ROUTES[route]
    if not reaches(key, how):
        return "skip: the route cannot carry it"
    assert identity_and_built(base) is not None, f"route {route} is not a valid run"
    return check_flip(key, base, how, route)


def with_companions(key: str, value: Any, how: str) -> list[str]:
    """The override setting `key` to `value` on the route's way, and the settings it needs beside it."""
    extra = COMPANIONS.get(key, lambda value: [])(value)
    return [override(key, value, how), *(item if how == "key" else item.replace("++", f"++{how}.overrides.", 1)
                                         for item in extra)]


def check_flip(key: str, base: list[str], how: str, label: str, known: str | None = None) -> str | None:
    """The mismatch of flipping `key` on the run `base` (None: identity and what is built agree), or 'skip: ...';
    `known`: why the flip may be a known split on this run (KNOWN_SPLITS, where it must be, by default)."""
    required = known is None
    known = known or KNOWN_SPLITS.get((key, label))
    before = identity_and_built(base)
    if before is None:
        return "skip: the run it flips on is refused"
    for value in flips(key):
        flipped = [*base, *with_companions(key, value, how)]
        after = identity_and_built(flipped)
        if after is None:
            continue
        built = differences(before[1], after[1])
        changed = before[0] != after[0]
        flip = " ".join(flipped[len(base):])
        if known and changed and not built:
            return None
        if known and required:
            return f"{flip} ({label}): no longer a known split: leave KNOWN_SPLITS"
        if changed and not built:
            return f"{flip} ({label}): the identity changed, nothing built did"
        if built and not changed:
            return f"{flip} ({label}): the identity stayed, what is built changed at {', '.join(built[:4])}"
        return None
    return "skip: no valid other value"


def is_switch(key: str) -> bool:
    """Whether `key` picks among a few ways to compute (a bool, an enum, a text): another key may be read under one
    of its values only."""
    kind = schema_leaves()[key][0]
    args = typing.get_args(kind)
    inner = next((a for a in args if a is not type(None)), kind) \
        if typing.get_origin(kind) in (typing.Union, types.UnionType) else kind
    return inner is bool or (isinstance(inner, type) and issubclass(inner, Enum)) or key in TEXT_VALUES


def under_switch(switch: str, key: str) -> bool:
    """Whether `key` could be read under some values of `switch` only: a key of its group, or a stage block's key
    that sets one (finetune.warmup_epochs sets optimizer.warmup_epochs, which optimizer.sched=none leaves unread)."""
    group = switch.split(".")[0]
    if key == switch:
        return False
    if key.split(".")[0] == group:
        return True
    return key.split(".")[0] in STAGE_BLOCKS.values() and \
        NAMED_KEYS.get(key.split(".", 1)[1], "").startswith(f"{group}.")


def conditional_pairs() -> list[tuple[str, Any, str]]:
    """(switch, a value of it, key): every key flipped on a run whose switch of its group takes another value."""
    keys = [key for key in experiment_keys() if key not in NOT_FLIPPED]
    return [(switch, value, key) for switch in keys if is_switch(switch) for value in flips(switch)
            for key in keys if under_switch(switch, key)]


# What a switch's value needs beside it for the keys it reads to change a run of the demo's length.
SWITCH_COMPANIONS = {
    ("optimizer.sched", "step"): ["++optimizer.decay_epochs=1.0"],  # the default 30 epochs decay nothing in 3
}


def check_conditional(switch: str, value: Any, key: str) -> str | None:
    """check_flip of `key` on the run (of the stage that reads `key`) whose `switch` is `value`."""
    stage = key.split(".")[0] if key.split(".")[0] in STAGE_BLOCKS.values() else "pretrain"
    route = {"pretrain": "pretrain", "finetune": "finetune", "transfer": "transfer_set"}[stage]
    base = [*ROUTES[route][0], *with_companions(switch, value, "key"), *SWITCH_COMPANIONS.get((switch, value), [])]
    known = KNOWN_SPLITS.get((key, route))
    return check_flip(key, base, "key", f"{switch}={override(switch, value, 'key').split('=', 1)[1]}", known)


def all_pairs() -> list[tuple[str, str]]:
    return [(key, route) for key in experiment_keys() if key not in NOT_FLIPPED for route in ROUTES]


def sampled_pairs() -> list[tuple[str, str]]:
    """A fixed sample, spread over keys and routes (the same on every machine)."""
    pairs = all_pairs()
    return sorted(pairs, key=lambda pair: zlib.crc32(f"{pair[0]}@{pair[1]}".encode()))[:SAMPLE]


@pytest.fixture(scope="module", autouse=True)
def teacher_files():
    write_teachers()


def test_every_key_has_a_valid_other_value():
    missing = []
    for key in (key for key in experiment_keys() if key not in NOT_FLIPPED):
        try:
            assert flips(key), key
        except (KeyError, AssertionError) as error:
            missing.append(str(error))
    assert not missing, missing


def run_pairs(pairs: list[tuple[str, str]]) -> tuple[list[str], list[str], set[str]]:
    """Each pair's mismatch, the pairs skipped, and the keys checked on at least one route."""
    mismatches, skipped, checked = [], [], set()
    for key, route in pairs:
        found = check_pair(key, route)
        if found is None:
            checked.add(key)
        elif found.startswith("skip:"):
            skipped.append(f"{key} ({route}) {found}")
        else:
            mismatches.append(f"{key}: {found}")
    return mismatches, skipped, checked


def test_identity_changes_iff_what_is_built_changes_sampled():
    mismatches, skipped, checked = run_pairs(sampled_pairs())
    assert not mismatches, "\n".join(mismatches)
    assert len(checked) >= SAMPLE // 2, skipped


@pytest.mark.slow
def test_identity_changes_iff_what_is_built_changes_every_key():
    mismatches, skipped, checked = run_pairs(all_pairs())
    print(f"{len(checked)} of {len(experiment_keys())} keys checked on some route; {len(skipped)} pairs skipped")
    assert not mismatches, "\n".join(mismatches)
    unchecked = sorted(set(experiment_keys()) - checked - set(NOT_FLIPPED))
    assert not unchecked, f"keys no route could flip: {unchecked}"


def test_a_fine_tune_names_the_size_its_pre_training_trains_at():
    """finetune.pretrain_size only names the pre-training: a wrong one would file the fine-tune under another
    identity (before: accepted, a second folder for the same computation)."""
    from deit_ablate.core.errors import ConfigError

    validate_config(compose_run_config(["stage=finetune", "finetune.pretrain_size=32"]))
    with pytest.raises(ConfigError, match="pre-training this fine-tune starts from trains at"):
        validate_config(compose_run_config(["stage=finetune", "finetune.pretrain_size=2"]))
