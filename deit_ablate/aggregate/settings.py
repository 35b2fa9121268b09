"""A run's experiment settings: its config without the seed and without execution settings.

Two runs belong in one cell only when their settings are equal. Where runs under one row key differ, they
are split into sub-rows, each labelled by what differs from the row's main setting (`baseline · mix=none`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from .select import format_value

# Config keys that never change a result: where and how a run executes (the run's identity leaves them out too).
EXECUTION_KEYS = (
    "runtime",
    "data.root",  # where the data lies; which data it is, is `data_fingerprint`
    "distill.teacher.allow_unfinished",  # a permission; which teacher weights were used is the summary's `teacher`
    # the same settings in logs written before they moved under `runtime`
    "tracking",
    "output_root",
    "data.num_workers",
    "data.worker_nice",
    "data.on_bad_image",
    "train.log_interval",
    "train.device",
    "train.compile",
    "train.max_batch_per_device",
    "train.eval_batch",
    "train.cpu_threads",
    "train.checkpoint_every_steps",
    "train.checkpoint_every_minutes",
    "train.wait_for_lock",
)
# Keys that name one run rather than its experiment (the stage is the table's column).
RUN_KEYS = ("seed", "run_id", "run_name", "experiment_digest", "choices", "stage")
# What makes a setting a row's main one when its runs differ: Table 8's baseline, no distillation, and the
# recipe's default group options (the resolution group's default is `<preset>_<stage>`).
PREFERRED = {"ablation": "baseline", "distill.type": "none"}
DEFAULT_CHOICES = {"preset": "demo", "ablation": "baseline", "distill": "none", "mix": "mixup_cutmix",
                   "augment": "randaugment", "optimizer": "adamw"}
# Each preset's own model (conf/preset/*.yaml): the demo's ViT, not the CNN teacher trained beside it.
PRESET_MODELS = {"demo": "vit_demo", "paper": "deit_base"}
# Groups that set many others (`@package _global_`): named first in a sub-row label.
LEADING_GROUPS = ("preset", "ablation", "stage")
LABEL_ITEMS = 3  # settings named in a sub-row label before `+k more`


def is_execution_key(key: str) -> bool:
    """Whether a dotted config key only says how a run executes (never what it computes)."""
    return any(key == k or key.startswith(k + ".") for k in EXECUTION_KEYS)


def _ignored(key: str) -> bool:
    return is_execution_key(key) or any(key == k or key.startswith(k + ".") for k in RUN_KEYS)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as `{dotted key: leaf}`; lists become JSON text so that values compare and hash."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        elif isinstance(value, (list, dict)):
            out[dotted] = json.dumps(value, sort_keys=True)
        else:
            out[dotted] = value
    return out


def experiment_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that decide a run's result: the flat config without seed, run names and execution keys."""
    return {k: v for k, v in flatten(config).items() if not _ignored(k)}


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
    defaults = {**DEFAULT_CHOICES, "resolution": f"{preset}_{choices.get('stage', 'pretrain')}"}
    if preset in PRESET_MODELS:
        defaults["model"] = PRESET_MODELS[preset]
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
