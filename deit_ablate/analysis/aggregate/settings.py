"""A run's experiment settings: its config without the seed and without execution settings.

Two runs belong in one cell only when their settings are equal. Where runs under one row key differ, they
are split into sub-rows, each labelled by what differs from the row's main setting (`baseline · mix=none`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from deit_ablate.config.keys import (
    LEGACY_CHOICE_KEYS,
    inherited_lr_rules,
    is_default_leaf,
    is_execution_key,
    leaves,
    unused_by_stage,
    unused_teacher,
)
from deit_ablate.config.studies import default_choices, preset_choices

from .paper import default_table, paper_table
from .select import format_value

# Keys that name one run rather than its experiment (the stage is the table's column).
RUN_KEYS = ("seed", "run_id", "run_name", "experiment_digest", "choices", "stage")
# What makes a setting a row's main one when its runs differ: Table 8's baseline, no distillation, and the
# recipe's default group options (the resolution group's default is `<preset>_<stage>`).
PREFERRED = {table.rows_key: table.baseline
             for table in (paper_table(str(default_table(key))) for key in (*LEGACY_CHOICE_KEYS, "distill.type"))}
# The recipe's default group options (conf/config.yaml, the studies' default rows) and each preset's own (its model:
# the demo's ViT, not the CNN teacher trained beside it), read from the config folders.
DEFAULT_CHOICES = default_choices()
PRESET_CHOICES = preset_choices()
# Groups that set many others (`@package _global_`): named first in a sub-row label.
LEADING_GROUPS = ("preset", "recipe", *LEGACY_CHOICE_KEYS, "stage")
LABEL_ITEMS = 3  # settings named in a sub-row label before `+k more`


def _ignored(key: str, value: Any) -> bool:
    """Keys left out of a run's settings: execution keys, run names, and defaults the run's identity leaves out
    (`data.backend=pil`, which runs from before the key do not have)."""
    return (is_execution_key(key) or any(key == k or key.startswith(k + ".") for k in RUN_KEYS)
            or is_default_leaf(key, value))


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as `{dotted key: leaf}`; lists become JSON text so that values compare and hash."""
    return {dotted: json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value
            for dotted, value in leaves(config, prefix).items()}


def experiment_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that decide a run's result: the flat config without seed, run names and execution keys (nor
    the transfer recipe outside the transfer stage, nor a teacher in a run that does not distil)."""
    stage = config.get("stage", "pretrain")
    distill_type = (config.get("distill") or {}).get("type")
    flat = flatten(config)
    inherited = inherited_lr_rules(flat.get)
    return {k: v for k, v in flat.items() if not _ignored(k, v) and k not in inherited
            and not unused_by_stage(k, stage) and not unused_teacher(k, distill_type)}


def signature(settings: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A hashable form of a settings dict."""
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))


def choices_of(config: dict[str, Any]) -> dict[str, str]:
    """The Hydra group choices logged with a run (empty for runs logged before they were)."""
    choices = config.get("choices")
    return {str(k): str(v) for k, v in choices.items()} if isinstance(choices, dict) else {}


_MISSING = object()


def varied_keys(settings: Iterable[dict[str, Any]]) -> list[str]:
    """Keys whose value is not the same in every settings dict (a key absent from some counts as varied)."""
    group = list(settings)
    keys = sorted({k for s in group for k in s})
    return [k for k in keys if len({json.dumps(s.get(k, "\0missing"), default=str) for s in group}) > 1]


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in sorted(set(a) | set(b)) if a.get(k, _MISSING) != b.get(k, _MISSING)]


def _cap(items: list[str]) -> str:
    shown = items[:LABEL_ITEMS]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f" +{more} more" if more else "")


def describe_difference(
    settings: dict[str, Any], choices: dict[str, str], ref: dict[str, Any], ref_choices: dict[str, str], full: bool
) -> str:
    """What a setting changes from the reference: differing group choices (`mix=none`) first, else keys."""
    keys = _diff(settings, ref)
    groups = sorted(
        (g for g in set(choices) & set(ref_choices) if choices[g] != ref_choices[g]),
        key=lambda g: (g not in LEADING_GROUPS, g),
    )
    named = [f"{g}={choices[g]}" for g in groups]
    rest = [k for k in keys if k not in groups and k.split(".")[0] not in groups]
    plain = [f"{k}={format_value(settings.get(k))}" for k in rest]
    if named and not full:
        return _cap(named)
    return _cap(named + plain) if named or plain else "(same settings)"


def default_options(settings: dict[str, Any], choices: dict[str, str]) -> int:
    """How many of a setting's group options are the recipe's defaults (Table 8's baseline, no distillation, the
    preset's model...)."""
    preset = settings.get("preset")
    defaults = {**DEFAULT_CHOICES, **PRESET_CHOICES.get(str(preset), {}),
                "resolution": f"{preset}_{choices.get('stage', 'pretrain')}"}
    by_choice = sum(1 for g, v in defaults.items() if choices.get(g) == v)
    return by_choice + sum(1 for k, v in PREFERRED.items() if settings.get(k) == v)


def pick_main(
    candidates: list[tuple[dict[str, Any], dict[str, str]]],
    population: list[dict[str, Any]],
    baseline: dict[str, Any] | None,
) -> int:
    """Index of a row's main (settings, choices): most default options, closest to the baseline row's, fewest
    keys set that others leave unset (a plain run over its `train.max_steps=3` smoke tests), most common."""
    keys = varied_keys(s for s, _ in candidates)
    counts = value_counts(population, keys)

    def rank(i: int) -> tuple[int, int, int, int]:
        s, choices = candidates[i]
        distance = sum(1 for k in keys if baseline is not None and s.get(k, _MISSING) != baseline.get(k, _MISSING))
        given = sum(1 for k in keys if s.get(k) is not None and any(o.get(k) is None for o, _ in candidates))
        common = sum(counts.get(k, Counter())[_hashable(s.get(k))] for k in keys)
        return (-default_options(s, choices), distance, given, -common)

    return min(range(len(candidates)), key=rank)


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str)


def value_counts(settings: Iterable[dict[str, Any]], keys: list[str]) -> dict[str, Counter]:
    """How many runs have each value of each of `keys` (the basis of "most common")."""
    counts: dict[str, Counter] = {k: Counter() for k in keys}
    for s in settings:
        for k in keys:
            counts[k][_hashable(s.get(k))] += 1
    return counts
