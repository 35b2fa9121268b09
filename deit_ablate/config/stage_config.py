"""A stage's config: the pre-training's, with the stage's own keys and its override set applied.

A row, recipe or preset says how a fine-tune or a transfer differs from the pre-training in that stage's block:
its named keys (`finetune.lr`, `transfer.global_batch`, ...: each sets one key of the run, NAMED_KEYS) and
`<stage>.overrides`, any other key nested as in the config (`finetune.overrides: {mix: {criterion: ce}}`). The
config a stage runs is the composed one with both applied (`stage_config`), once in the plan (plan.make_plan) and
in every check of a launch; `python train.py ... stage=finetune --cfg job` prints it.

A run's identity stays the composed config (identity.py): the pre-training's keys plus the stage's block. That
fixes what the stage computes and the weights it starts from; the applied config alone would not, since two
pre-trainings that differ only in a key the stage overrides fine-tune to one config.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf, read_write
from omegaconf.errors import OmegaConfBaseException

from deit_ablate.config.keys import leaves, unread_settings
from deit_ablate.config.schema import FinetuneConfig, Stage, TransferConfig
from deit_ablate.core.errors import ConfigError

# The block of each stage after pre-training.
STAGE_BLOCKS = {str(Stage.finetune): "finetune", str(Stage.transfer): "transfer"}
# A stage block's named keys and the key of the run each one sets in that stage (a null one leaves it as it is).
NAMED_KEYS = {
    "optimizer": "optimizer.name",
    "global_batch": "train.global_batch",
    "micro_batch": "train.micro_batch",
    "lr": "optimizer.lr",
    "lr_base_batch": "optimizer.lr_base_batch",
    "weight_decay": "optimizer.weight_decay",
    "epochs": "train.epochs",
    "warmup_epochs": "optimizer.warmup_epochs",
    "warmup_lr": "optimizer.warmup_lr",
    "min_lr": "optimizer.min_lr",
    "drop_path": "model.drop_path",  # transfer.drop_path (issue #45: stochastic depth removed)
    "reprob": "augment.reprob",  # transfer.reprob (issue #45: random erasing removed)
}
# The nodes an override set may change: what a stage computes. Not the stage, preset or seed, the stage blocks,
# nor how the run executes (runtime) or is measured (sharpness).
OVERRIDABLE = ("model", "data", "augment", "mix", "distill", "optimizer", "resolution", "train")
_APPLIED = "deit_stage_applied"  # an OmegaConf flag on a config stage_config returned


def is_applied(cfg: DictConfig) -> bool:
    """Whether `cfg` is a stage's applied config (stage_config's), not the composed one a run's identity reads."""
    return bool(cfg._get_flag(_APPLIED))


def named_settings(node: FinetuneConfig | TransferConfig) -> dict[str, Any]:
    """`{key of the run: value}` that the named keys of a stage block set (those that are not null)."""
    return {target: node[key] for key, target in NAMED_KEYS.items() if key in node and node[key] is not None}


def override_leaves(node: FinetuneConfig | TransferConfig, block: str) -> dict[str, Any]:
    """`<block>.overrides` of the stage block `node` as `{dotted key of the run: value}`, resolved, checked against
    what a stage may set; a ConfigError naming the override and the fix otherwise."""
    overrides = OmegaConf.to_container(node.overrides, resolve=True, enum_to_str=True)
    found = leaves(overrides)
    named = {target: key for key, target in NAMED_KEYS.items() if key in node}
    for dotted in found:
        top = dotted.split(".", 1)[0]
        if top not in OVERRIDABLE:
            raise ConfigError(f"{block}.overrides.{dotted}: a stage's override set changes what it computes, one of "
                              f"{', '.join(OVERRIDABLE)}; `{top}` is not one of them. Set {top} for the whole run, "
                              "outside the override set.")
        for target, key in named.items():
            if dotted == target or dotted.startswith(target + ".") or target.startswith(dotted + "."):
                raise ConfigError(f"{block}.overrides.{dotted}: the stage sets {target} through {block}.{key}; "
                                  f"set {block}.{key} instead (one key per setting).")
    return found


def _refused(block: str, dotted: str, cfg: DictConfig, error: OmegaConfBaseException) -> ConfigError:
    """The ConfigError for an override the schema refuses: a key it lacks (with the nearest keys) or a bad value."""
    parent, _, leaf = dotted.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if node is None:
        return ConfigError(f"{block}.overrides.{dotted}: the run has no node {parent}. Name a key the run has "
                           "(python train.py --cfg job lists them).")
    if isinstance(node, DictConfig) and leaf not in node:
        near = difflib.get_close_matches(leaf, [str(k) for k in node], n=3)
        hint = f" Did you mean {', '.join(f'{parent}.{k}' for k in near)}?" if near else ""
        return ConfigError(f"{block}.overrides.{dotted}: the run has no key {dotted}.{hint}")
    problem = str(error).splitlines()[0]
    return ConfigError(f"{block}.overrides.{dotted}: {problem}. Give it a value of the key's type.")


def check_stage_overrides(cfg: DictConfig) -> None:
    """Every stage block's override set names keys the run has, with values of their types (whatever the stage a
    launch runs: a sweep's pre-training is refused for its fine-tune's typo); a ConfigError otherwise."""
    for block in STAGE_BLOCKS.values():
        if cfg[block].overrides:
            _apply(copy.deepcopy(cfg), block)


def _apply(cfg: DictConfig, block: str) -> DictConfig:
    """`cfg` (a copy, changed in place) with `block`'s named keys and override set applied."""
    settings = {**named_settings(cfg[block]), **override_leaves(cfg[block], block)}
    with read_write(cfg):
        # the block as the stage read it: a key derived from one the stage sets (CaiT's transfer.lr, from
        # optimizer.lr) must not be derived again from the stage's value
        OmegaConf.resolve(cfg[block])
        for dotted, value in settings.items():
            try:
                OmegaConf.update(cfg, dotted, value, merge=False)
            except OmegaConfBaseException as error:
                raise _refused(block, dotted, cfg, error) from None
    return cfg


def stage_config(cfg: DictConfig) -> DictConfig:
    """The config the run's stage runs: a pre-training's is `cfg`; a fine-tune's or transfer's is a copy of `cfg`
    with its block's named keys and override set applied (and marked so, `is_applied`; applying it again changes
    nothing). A ConfigError names an override the schema refuses."""
    block = STAGE_BLOCKS.get(str(cfg.stage))
    if block is None or is_applied(cfg):
        return cfg
    applied = _apply(copy.deepcopy(cfg), block)
    applied._set_flag(_APPLIED, True)
    return applied


def stage_changes(declared: DictConfig, applied: DictConfig) -> list[str]:
    """What the stage runs differently from its composed config, `key old -> new` per leaf (empty for a
    pre-training), for the run's log."""
    if applied is declared:
        return []
    before, after = (leaves({key: OmegaConf.to_container(cfg[key], resolve=True, enum_to_str=True)
                             for key in OVERRIDABLE}) for cfg in (declared, applied))
    return [f"{key} {before.get(key)} -> {value}" for key, value in after.items() if before.get(key) != value]


def _stage_blocks(tree: dict[str, Any]) -> list[str]:
    """The blocks of the stages after pre-training that a run of `tree` (plain data) trains through, in order."""
    stage = str(tree.get("stage"))
    if stage == str(Stage.finetune):
        return ["finetune"]
    if stage != str(Stage.transfer):
        return []
    through_finetune = str((tree.get("transfer") or {}).get("source_stage")) == str(Stage.finetune)
    return ["finetune", "transfer"] if through_finetune else ["transfer"]


def _block_settings(block: dict[str, Any]) -> dict[str, Any]:
    """`{key of the run: value}` a stage block (plain data) sets: its named keys, then its override set."""
    named = {target: block[key] for key, target in NAMED_KEYS.items() if block.get(key) is not None}
    return {**named, **leaves(block.get("overrides") or {})}


def run_unread_settings(tree: dict[str, Any]) -> dict[str, str]:
    """`{setting: why}` of the composed config's settings (`tree`: a run's experiment as plain data) that no stage
    of the run trains with: each stage never reads it (keys.UNREAD: why is the pre-training's) or sets its own."""
    composed = leaves(tree)
    unread = unread_settings(composed.get)
    for block in _stage_blocks(tree):
        sets = _block_settings(tree.get(block) or {})
        in_stage = unread_settings(lambda key, sets=sets: sets[key] if key in sets else composed.get(key))
        unread = {key: why for key, why in unread.items() if key in in_stage or key in sets}
    return unread


def run_distills(tree: dict[str, Any]) -> bool:
    """Whether a stage of a run of `tree` (plain data) learns from a teacher: its pre-training's distill.type, or a
    fine-tune's override set's (a transfer distils from no teacher: its distill keys name its source run)."""
    kinds = [leaves(tree).get("distill.type")]
    kinds += [_block_settings(tree.get(block) or {}).get("distill.type") for block in _stage_blocks(tree)
              if block == STAGE_BLOCKS[str(Stage.finetune)]]
    return any(kind is not None and str(kind) != "none" for kind in kinds)


def stage_named_unread(tree: dict[str, Any]) -> list[str]:
    """The named keys of a stage block (finetune.warmup_epochs, ...) whose setting that stage never reads, by
    keys.UNREAD evaluated on the stage's own values (a fine-tune's warm-up under optimizer.sched=none)."""
    composed, out = leaves(tree), []
    for block in _stage_blocks(tree):
        node = tree.get(block) or {}
        unread = unread_settings({**composed, **_block_settings(node)}.get)
        out += [f"{block}.{key}" for key, target in NAMED_KEYS.items()
                if node.get(key) is not None and target in unread]
    return out


# What a stage after pre-training never reads, whatever its override set says: SAM wraps the pre-training's optimizer
# alone (run/stages.py stage_recipe).
LATER_STAGES_IGNORE = ("optimizer.sam_rho",)


def stage_sets_read(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{block: the entries of its override set that the stage reads}` of a run of `tree` (plain data), by keys.UNREAD
    evaluated on the stage's own values. An entry the stage never reads computes nothing: no part of the experiment.
    (An entry equal to the value the stage takes without it stays: recipes spell their stage's values out, and
    their runs keep the identity they have.)"""
    composed = leaves(tree)
    read: dict[str, dict[str, Any]] = {}
    for block in _stage_blocks(tree):
        node = tree.get(block) or {}
        entries = leaves(node.get("overrides") or {})
        if not entries:
            continue
        stage = {**composed, **_block_settings(node)}
        unread = unread_settings(stage.get)
        ignored = [*LATER_STAGES_IGNORE]
        if block == STAGE_BLOCKS[str(Stage.transfer)]:  # a transfer distils from no teacher (run/stages.py)
            ignored.append("distill")
        elif str(stage.get("distill.type")) == "none":  # a stage that does not distil has no teacher
            ignored.append("distill.teacher")
        read[block] = {key: value for key, value in entries.items() if key not in unread
                       and not any(key == prefix or key.startswith(prefix + ".") for prefix in ignored)}
    return read
