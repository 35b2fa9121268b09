"""A run's identity: the resolved experiment (every key but `runtime`, the data by its fingerprint, a distilled
run's teacher by the digest of its weights).

The identity decides the run's folder, its wandb run id and its wandb group. It is a hash of the resolved
config, not of the command line, so an edited YAML value is another run; `runtime.*` never enters it, so a
relaunch with other execution settings resumes the same run. The folder name puts the overrides in front of
the hash so that people can read it. The data and the teacher are known only once the run looks at them: they
enter the wandb id and group (with_data, with_teacher), and the run folder records them (identity.json), so a
relaunch on other data or other teacher weights is refused rather than resumed or skipped (run.py, teacher.py).
A transfer's wandb id and group carry its source run's data and teacher the same way (with_source, transfer.py). A
run that does not distil carries no teacher: its identity is as if no `distill.teacher.*` key had been given. A
setting that no stage of the run reads (keys.UNREAD: colour jitter beside RandAugment) holds the schema's default in
it and leaves the folder name, so the run is the one that computes the same (canonical_experiment). Which keys enter
it is deit_ablate/config/keys.py's. Study rows are Hydra choices, not keys, so `run_identity` takes the choices too:
Table 8's row enters the digest as the schema key it once was (keys.LEGACY_CHOICE_KEYS), which keeps the folders and
wandb ids of runs from before it became a choice.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from deit_ablate.config.keys import (
    ADDED_KEYS,
    CANONICAL_BY_OPTIONS,
    NOT_EXPERIMENT,
    NOT_IDENTITY,
    inherited_lr_rules,
    is_default_leaf,
    is_teacher_key,
    leaves,
    legacy_keys,
    schema_default,
)
from deit_ablate.config.schema import preset_teacher
from deit_ablate.config.stage_config import (
    is_applied,
    run_distills,
    run_unread_settings,
    stage_named_unread,
    stage_sets_read,
)
from deit_ablate.config.studies import study_names
from deit_ablate.record.overrides import (
    TRANSFER_OVERRIDES,
    chained_teacher_overrides,
    override_key,
)

STAGE_SET_BLOCKS = ("finetune", "transfer")  # the stage blocks with an override set (config/stage_config.py)
# The digest of a chained student's teacher run, in the student's experiment (not a config key: the run it waits for)
CHAINED_TEACHER_RUN = "chained_teacher_run"
# What never changes a pre-training run: the fine-tune recipe. A fine-tune finds its pre-training by the rest.
FINETUNE_ONLY = ("finetune",)
# What a shortened folder name keeps in front after the study rows (all studies, Table 8's first): the seed.
KEPT_VISIBLE = ("seed",)

_UNSAFE = re.compile(r"[^A-Za-z0-9=,._+@-]+")
_MAX_READABLE = 100


@dataclass(frozen=True)
class RunIdentity:
    """Name (folder), wandb id, wandb group and experiment digest of a run; its teacher and a transfer's source,
    once known; and, in a dry run, what its wandb id still waits for (`pending`: the id is not final)."""

    name: str
    run_id: str
    group: str
    digest: str
    teacher: dict[str, Any] | None = field(default=None, hash=False)
    source: dict[str, Any] | None = field(default=None, hash=False)
    pending: str | None = field(default=None, hash=False, compare=False)


def _short_hash(text: str, length: int = 8) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:length]


def _pop(tree: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.get(key)
        if not isinstance(tree, dict):
            return
    tree.pop(leaf, None)


def _leaf(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def experiment(cfg: DictConfig, drop: tuple[str, ...] = (), choices: Mapping[str, Any] | None = None,
               canonical: bool = True, teacher_run: str | None = None) -> dict[str, Any]:
    """The resolved experiment part of `cfg` as plain data (top-level keys in `drop` left out too); with Hydra's
    group `choices`, also the legacy keys every digest carries (keys.legacy_keys: Table 8's row). A setting no stage
    of the run reads holds the schema's default (`canonical`; as declared with canonical=False). A student of a
    chained teacher run holds that run's digest (`teacher_run`: chained_teacher_digests), which stands for all the
    teacher reads, its own settings that the student ignores included."""
    if is_applied(cfg):
        raise ValueError("a run's identity is its composed config, not the config its stage runs (stage_config)")
    out: dict[str, Any] = {}
    for key in cfg:
        if key in NOT_EXPERIMENT or key in drop:
            continue
        value = cfg[key]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
        out[str(key)] = str(value) if hasattr(value, "value") else value  # an Enum leaf
    distill = out.get("distill")
    if isinstance(distill, dict) and not run_distills(out):
        distill["teacher"] = preset_teacher(out.get("preset", "demo"))  # as if the run were given no teacher
    if canonical:
        out = canonical_experiment(out, option_values(choices) if choices is not None else None)
    for dotted in (*NOT_IDENTITY, *inherited_lr_rules(lambda key: _leaf(out, key))):
        _pop(out, dotted)
    for block in STAGE_SET_BLOCKS:  # nor in a stage's override set
        node = out.get(block)
        if isinstance(node, dict) and isinstance(node.get("overrides"), dict) and node["overrides"]:
            node["overrides"] = _nested({key: value for key, value in leaves(node["overrides"]).items()
                                         if key not in NOT_IDENTITY})
    for dotted in ADDED_KEYS:  # runs from before a key keep their identity while it holds its default
        if is_default_leaf(dotted, _leaf(out, dotted)):
            _pop(out, dotted)
    if choices is not None:
        out.update({k: v for k, v in legacy_keys(choices).items() if k not in drop})
    if teacher_run is not None:
        out[CHAINED_TEACHER_RUN] = teacher_run
    return out


def canonical_experiment(tree: dict[str, Any], options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A copy of an experiment (plain data) whose settings no stage reads (stage_config.run_unread_settings) hold the
    schema's default, and whose stages' override sets hold only what the stage reads (stage_config.stage_sets_read):
    a run that computes the same as another has its identity, whatever it set them to. A setting of a rule
    added later (keys.CANONICAL_BY_OPTIONS) holds the value the run's group options give it (`options`:
    option_values; without them, a mark the same in every experiment)."""
    out = copy.deepcopy(tree)
    for block, read in stage_sets_read(tree).items():
        out[block]["overrides"] = _nested(read)
    unread = [*run_unread_settings(tree), *stage_named_unread(tree)]
    for dotted in unread:
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        if dotted not in CANONICAL_BY_OPTIONS:
            node[leaf] = schema_default(dotted)
        elif options is None:  # two experiments compared with each other: one mark for both
            node[leaf] = "(unread)"
        elif dotted in options:
            node[leaf] = options[dotted]
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """`{dotted key: value}` as a nested mapping (the shape of an override set)."""
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def same_computation(first: dict[str, Any], second: dict[str, Any]) -> str | None:
    """Why two experiments (plain data, `experiment(..., canonical=False)`) that differ compute the same: each
    setting that tells them apart and why no stage reads it; None when they compute differently or do not differ."""
    if canonical_experiment(first) != canonical_experiment(second):
        return None
    flat_first, flat_second = leaves(first), leaves(second)
    differ = sorted(key for key in {*flat_first, *flat_second} if flat_first.get(key) != flat_second.get(key))
    unread = {**run_unread_settings(second), **run_unread_settings(first)}
    return "; ".join(f"{key} is ignored because {unread.get(key, 'no stage reads it')}" for key in differ) or None


def experiment_digest(cfg: DictConfig, drop: tuple[str, ...] = (), choices: Mapping[str, Any] | None = None,
                      teacher_run: str | None = None) -> str:
    """A short stable hash of the experiment part of `cfg` (see `experiment`)."""
    tree = experiment(cfg, drop, choices, teacher_run=teacher_run)
    return _short_hash(json.dumps(tree, sort_keys=True, default=str), 10)


def _is_identity_override(item: str) -> bool:
    """Overrides that name the experiment: not runtime/Hydra settings, the data's location or a permission."""
    key = override_key(item)
    return not (key.split(".", 1)[0] in NOT_EXPERIMENT or key.startswith("hydra/") or key in NOT_IDENTITY
                or item == "stage=pretrain")


def _readable(item: str) -> str:
    """One override as it reads in a folder name: paths shortened to their last part plus a hash."""
    key, _, value = item.lstrip("+~").partition("=")
    value = value.strip("'\"")
    if "/" not in value:
        return f"{key}={value}"
    parts = key.split(".")
    label = parts[-2] if parts[-1] == "checkpoint" and len(parts) > 1 else parts[-1]  # teacher=..., init_checkpoint=
    return f"{label}={Path(value.rstrip('/')).name[:24]}@{_short_hash(value, 4)}"


def readable_overrides(overrides: list[str], drop_keys: tuple[str, ...] = (),
                       keep_visible: tuple[str, ...] | None = None) -> str:
    """The experiment's overrides, sorted, comma-joined and folder-safe (empty when there are none); when too long,
    those of `keep_visible` (default: the study rows, then the seed: they tell a sweep's runs apart) go first and
    the rest is cut, marked by `~`."""
    items = sorted(_readable(item) for item in overrides if _is_identity_override(item)
                   and override_key(item).split(".", 1)[0] not in drop_keys)
    text = _UNSAFE.sub("_", ",".join(items))
    if len(text) <= _MAX_READABLE:
        return text
    keep_visible = (*study_names(), *KEPT_VISIBLE) if keep_visible is None else keep_visible
    first = [item for key in keep_visible for item in items if item.split("=", 1)[0] == key]
    text = _UNSAFE.sub("_", ",".join(first + [item for item in items if item not in first]))
    return f"{text[:_MAX_READABLE]}~"


def stage_drop(stage: str) -> tuple[str, ...]:
    """A run's identity leaves out the recipes of later stages, which it never uses: a pre-training both the
    fine-tune and the transfer recipe (with its rule, `transfer_recipe=`), a fine-tune the transfer recipe. A
    transfer keeps the fine-tune recipe, which names its source run."""
    if stage == "pretrain":
        return (*FINETUNE_ONLY, *TRANSFER_OVERRIDES)
    return TRANSFER_OVERRIDES if stage == "finetune" else ()


def run_identity(cfg: DictConfig, overrides: list[str], choices: Mapping[str, Any]) -> RunIdentity:
    """The identity of the run `cfg` describes, launched with `overrides` (Hydra's task overrides), whose group
    options are `choices` (Hydra's `runtime.choices`; see `composed_choices`). A run that does not distil is named
    without the teacher overrides a sweep gave it (keys.TEACHER_KEYS), and a run without the overrides of settings
    no stage of it reads (keys.UNREAD)."""
    drop = stage_drop(str(cfg.stage))
    declared = experiment(cfg, drop, canonical=False)
    teacher = chained_teacher_digests(overrides, declared)
    unread = run_unread_settings(declared) if teacher is None else {}  # a chained teacher may read them
    distills = run_distills(declared)
    overrides = [item for item in overrides
                 if not (is_teacher_key(override_key(item)) and not distills) and override_key(item) not in unread]
    digest = experiment_digest(cfg, drop, choices, teacher[0] if teacher else None)
    name = f"{readable_overrides(overrides, drop) or 'default'}-{digest}"
    # groups keep the names they had (no key put first), so the seeds of one setting stay in one wandb group
    group_readable = readable_overrides([o for o in overrides if override_key(o) != "seed"], drop, ()) or "default"
    group = f"{group_readable}-{experiment_digest(cfg, drop + ('seed',), choices, teacher[1] if teacher else None)}"
    # The wandb id follows the experiment, not the spelling of its overrides (ablation=baseline = no override).
    return RunIdentity(name=name, run_id=_short_hash(digest, 16), group=group, digest=digest)


def option_values(choices: Mapping[str, Any]) -> dict[str, Any]:
    """`{dotted key: value}` that the group options `choices` (Hydra's) compose without any other override, for the
    settings whose unread value in an identity is the options' (keys.CANONICAL_BY_OPTIONS)."""
    chosen = tuple(sorted(f"{group}={option}" for group, option in choices.items()
                          if option is not None and not str(group).startswith("hydra")))
    try:
        return dict(_option_values(chosen))
    except Exception:  # noqa: BLE001 -- options this search path cannot compose: the settings stay as set
        return {}


@functools.lru_cache(maxsize=64)
def _option_values(chosen: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    from deit_ablate.config.compose import compose_run_config

    composed = compose_run_config(list(chosen))
    return tuple((key, OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)
                 for key in sorted(CANONICAL_BY_OPTIONS)
                 for value in [OmegaConf.select(composed, key, default=None)])


def chained_teacher_digests(overrides: list[str], declared: dict[str, Any]) -> tuple[str, str] | None:
    """The experiment digest of the chained teacher run a student (launched with `overrides`; `declared`: its
    experiment as declared) distils from, and that run's digest without the seed (its group's); None without one.
    The teacher run is composed from the student's overrides, so a setting the student ignores (`mix.switch_prob`
    under `ablation=no_mixup_cutmix`) or spells as its row does can still change the teacher."""
    chain = declared["distill"]["teacher"].get("chain")
    if chain is None or str(declared.get("stage")) == "transfer" or not run_distills(declared):
        return None
    kwargs = declared["distill"]["teacher"].get("kwargs") or {}
    return _teacher_digests(tuple(chained_teacher_overrides(str(chain), kwargs, list(overrides))))


@functools.lru_cache(maxsize=64)
def _teacher_digests(teacher_overrides: tuple[str, ...]) -> tuple[str, str]:
    from deit_ablate.config.compose import compose_run_config

    teacher = compose_run_config(list(teacher_overrides))
    identity = run_identity(teacher, list(teacher_overrides), composed_choices(teacher))
    return identity.digest, identity.group.rsplit("-", 1)[-1]


def composed_choices(cfg: DictConfig) -> dict[str, Any]:
    """The group options of a config composed with Hydra's node (`compose(..., return_hydra_config=True)`, or the
    `_root_` of a resolver); a ValueError for a config without it, whose study rows are unknown."""
    if "hydra" not in cfg:
        raise ValueError("the config has no `hydra` node, so its study rows (Hydra's choices) are unknown: compose it "
                         "with return_hydra_config=True")
    return dict(OmegaConf.to_container(cfg.hydra.runtime.choices, resolve=False))


def with_data(identity: RunIdentity, data: dict[str, Any]) -> RunIdentity:
    """The identity once its data is known: the wandb id and group carry the data's fingerprint too, so the same
    settings on two datasets (under two output roots) never write to one wandb run."""
    digest = str(data.get("digest", ""))
    return replace(identity, run_id=_short_hash(f"{identity.digest}:{digest}", 16),
                   group=f"{identity.group}@{digest[:6]}" if digest else identity.group)


def with_teacher(identity: RunIdentity, teacher: dict[str, Any] | None,
                 recorded: dict[str, Any] | None = None) -> RunIdentity:
    """The identity once its teacher is known (None: no distillation): the wandb id and group carry the digest of
    the teacher's weights, so students of other teacher weights never write to one wandb run. A run folder whose
    identity.json (`recorded`) predates teacher records keeps the wandb id it has."""
    if teacher is None:
        return identity
    if recorded is not None and "teacher" not in recorded:
        return replace(identity, teacher=teacher)
    digest = str(teacher["digest"])
    return replace(identity, run_id=_short_hash(f"{identity.run_id}:teacher:{digest}", 16),
                   group=f"{identity.group}+t{digest[:6]}", teacher=teacher)


def with_source(identity: RunIdentity, source: dict[str, Any] | None,
                recorded: dict[str, Any] | None = None) -> RunIdentity:
    """A transfer's identity once its source run is known (`source`: its folder, data fingerprint and teacher
    weights digest, transfer.source_identity; None: no source run): the wandb id and group carry the source's data
    and teacher, so transfers of sources trained on other data or distilled from other teacher weights never write
    to one wandb run. A run folder whose identity.json (`recorded`) predates source records keeps its wandb id."""
    if source is None:
        return identity
    if recorded is not None and "source" not in recorded:
        return replace(identity, source=source)
    key = f"{source['data']}:{source['teacher'] or ''}"
    return replace(identity, run_id=_short_hash(f"{identity.run_id}:source:{key}", 16),
                   group=f"{identity.group}+s{_short_hash(key, 6)}", source=source)


def _folders_of(digest: str, runs_root: Path) -> list[Path]:
    """The folders under `runs_root` that hold the experiment `digest`, by name."""
    return sorted(runs_root.glob(f"*-{digest}")) if runs_root.is_dir() else []


def folder_name(identity: RunIdentity, runs_root: Path) -> str:
    """The run's folder under `runs_root`: the one already holding its experiment, whatever overrides named it
    then, else `identity.name`."""
    existing = _folders_of(identity.digest, runs_root)
    return existing[0].name if existing else identity.name


def folder_now(planned: Path) -> Path:
    """The folder a launch would use now for the run planned in the folder `planned`: that one, or, where it was
    never made, the one another row's launch made for the same experiment since (folder_name's rule)."""
    if planned.exists():
        return planned
    existing = _folders_of(planned.name.rsplit("-", 1)[-1], planned.parent)
    return existing[0] if existing else planned


def task_overrides() -> list[str]:
    """The running Hydra job's overrides (empty outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def current_run_dir() -> Path:
    """The folder Hydra gave the running job (the current directory outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()


def task_choices() -> dict[str, Any]:
    """The running Hydra job's group options (empty outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    return dict(OmegaConf.to_container(HydraConfig.get().runtime.choices)) if HydraConfig.initialized() else {}
