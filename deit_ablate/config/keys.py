"""Which config keys make a run's identity and which only say how it executes, in one place: the run's digest
(identity.py) and the aggregator's "same setting" (aggregate/settings.py) both read them from here."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from deit_ablate.config.schema import Config

# Top-level nodes that are not the experiment: how it runs, and Hydra's own settings.
# `sharpness` measures a finished model (an evaluation, recorded with its settings beside the figures), never
# what it trains.
NOT_EXPERIMENT = ("runtime", "hydra", "sharpness")
# Where the data lies is not which data it is: the data's fingerprint (recorded in the run folder) stands for it.
DATA_LOCATION = "data.root"
# Keys added after runs were written, with the default that stands for "as before": a leaf at that default is left
# out of the identity (runs from before the key keep their folder and wandb id); any other value is another run.
ADDED_KEYS: dict[str, object] = {
    "data.backend": "pil",  # the input pipeline; dali is another run
    "optimizer.sam_rho": 0.0,  # SAM's radius (Foret et al. 2021); 0 = plain AdamW/SGD
    "augment.crop": "rrc",  # DeiT III's simple random crop is another run
    "augment.three_augment": False,
    "mix.criterion": "ce",
    "distill.teacher_view": "same",
    "finetune.layer_decay": None,
    "finetune.pretrain_size": None,  # a row's own pre-training size, named in its fine-tune's identity
    "data.fraction": 1.0,  # the whole training split; a share of it (a tenth of ImageNet) is another run
    "data.builtin.classes": "shapes",  # the built-in set's shapes; shapes_b (the demo's transfer data) is other data
    "distill.teacher.chain": None,
    "distill.teacher.sizes": None,  # the teacher at the batch's own size alone
    # the recipe's micro-batch: the paper's 128 per GPU (pre-training) and 32 per GPU (the released fine-tune)
    "train.micro_batch": 128,
    "finetune.micro_batch": 32,
    "transfer.micro_batch": None,  # a teacher trained in the same sweep (Table 2); its weights' digest stands for it
    # a later stage's override set (stage_config.py): none is the stage as it ran before sets existed
    "finetune.overrides": {},
    "transfer.overrides": {},
    "model.head": "linear",  # DeiT's single linear classifier; the original ViT's MLP head (mlp_tanh) is another run
    # the schedule moved after every update; epoch (the released main.py's per-epoch step, one epoch late) is another
    "optimizer.sched_on": "update",
    "optimizer.decay_epochs": 30.0,  # sched=step's interval and factor (main.py's defaults); cosine reads neither
    "optimizer.decay_rate": 0.1,
    "train.eval_max_images": None,  # the whole eval split; the first N images of it are another run
}
# A later stage's own lr rule, added when it stopped following the pre-training's: left out while it equals
# optimizer.lr_base_batch (what every stage read before), so earlier runs keep their identity; any other value is
# another run, as its lr is another.
STAGE_LR_RULES = ("finetune.lr_base_batch", "transfer.lr_base_batch")
PRETRAIN_LR_RULE = "optimizer.lr_base_batch"
# The transfer recipe (DeiT Table 7), which only the transfer stage reads: runs of the other stages leave it out of
# their identity and their settings (logs from before it have none).
TRANSFER_ONLY = "transfer"
# A permission, not the experiment: the teacher's weights (recorded in the run folder) stand for it.
TEACHER_PERMISSION = "distill.teacher.allow_unfinished"
# A factor that only CaiT's transfer rule reads (conf/transfer_recipe/cait.yaml), and only to give transfer.lr: the
# identity holds that lr, so the factor would only tell apart transfers under DeiT's rule that compute the same.
CAIT_LR_DIVISOR = "transfer.cait_lr_divisor"
# Leaves of the experiment that never enter its identity.
NOT_IDENTITY = (DATA_LOCATION, TEACHER_PERMISSION, CAIT_LR_DIVISOR)
# The teacher of a distillation: no part of a run that does not distil (distill.type=none), whatever a sweep names
# for it (`-m ablation=baseline,no_mixup distill.teacher.checkpoint=...`). Such a run's identity holds its preset's
# teacher as if no teacher key were given (config.preset_teacher), and its folder name no teacher override.
TEACHER_KEYS = "distill.teacher"
NO_DISTILLATION = "none"
# Execution settings as logs written before they moved under `runtime` have them (the aggregator still reads those).
LEGACY_EXECUTION_KEYS = (
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
# Config keys that never change a result, for the aggregator: the above and the old spellings of execution keys.
EXECUTION_KEYS = (*NOT_EXPERIMENT, *NOT_IDENTITY, *LEGACY_EXECUTION_KEYS)

# Legacy: Table 8 was a schema key `ablation: <row>` (default `baseline`) before it became a Hydra choice like the
# other studies, and every run's digest and logged config carried it (a CaiT run's too, as `baseline`). The row
# is put back from Hydra's choices, so run folders, wandb ids and groups stay what they were and old and new logs
# compare equal: group -> the value when the group has no row chosen.
LEGACY_CHOICE_KEYS = {"ablation": "baseline"}


def legacy_keys(choices: dict[str, Any]) -> dict[str, str]:
    """The top-level keys the old schema had and Hydra's `choices` now give (`{"ablation": "no_mixup"}`)."""
    return {group: str(choices.get(group) or unset) for group, unset in LEGACY_CHOICE_KEYS.items()}


def is_default_leaf(dotted: str, value: Any) -> bool:
    """Whether a leaf holds a default that the identity leaves out (`data.backend=pil`), as if it were unset (an
    empty mapping also as the JSON text a flattened config holds)."""
    if dotted not in ADDED_KEYS:
        return False
    default = ADDED_KEYS[dotted]
    return value == default or (isinstance(default, dict) and value == json.dumps(default))


def inherited_lr_rules(get: Callable[[str], Any]) -> list[str]:
    """The stage lr rules (STAGE_LR_RULES) that equal the pre-training's, by `get` (dotted key -> value or None):
    what the identity and the aggregator's settings leave out."""
    return [key for key in STAGE_LR_RULES if get(key) is not None and get(key) == get(PRETRAIN_LR_RULE)]


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as `{dotted key: value}`; an empty mapping is a leaf."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def is_teacher_key(dotted: str) -> bool:
    """Whether a dotted key names the teacher of a distillation (`distill.teacher.checkpoint`)."""
    return dotted == TEACHER_KEYS or dotted.startswith(TEACHER_KEYS + ".")


def unused_teacher(dotted: str, distill_type: Any) -> bool:
    """Whether a dotted key names a teacher that a run of `distill_type` never has (any teacher key, distill=none)."""
    return str(distill_type) == NO_DISTILLATION and is_teacher_key(dotted)


def unused_by_stage(dotted: str, stage: Any) -> bool:
    """Whether a dotted key belongs to a stage block the run's stage never reads (`transfer.*` outside transfer)."""
    return str(stage) != TRANSFER_ONLY and (dotted == TRANSFER_ONLY or dotted.startswith(TRANSFER_ONLY + "."))


def is_execution_key(dotted: str) -> bool:
    """Whether a dotted config key only says how a run executes (never what it computes)."""
    return any(dotted == k or dotted.startswith(k + ".") for k in EXECUTION_KEYS)


# --- settings a stage never reads -------------------------------------------------------------------------------
# A setting the computation cannot read under some other setting (colour jitter beside RandAugment) changes nothing
# there: such a run's identity holds the schema's default in its place (identity.py), so it keeps the identity of the
# run that computes the same, and the dry run names the setting when two runs of a sweep compute the same. Each rule
# is read off the code that computes: timm's create_transform and Mixup, data/transforms.py, train/losses.py,
# train/optim.py.
Getter = Callable[[str], Any]  # a stage's value of a dotted key (None: unset)
HARD_KINDS = ("hard", "hard_token")  # distil towards the teacher's arg-max label: no temperature, no KL


def is_adam_like(optimizer: str) -> bool:
    """Whether timm's optimizer `optimizer` takes Adam's betas and eps (else SGD's momentum): train/optim.py."""
    return optimizer.startswith("adam") or optimizer == "lamb"


def _auto_policy(get: Getter) -> str | None:
    """The auto-augment policy create_transform is given (data/transforms.py: 3-Augment is timm's policy "3a")."""
    return "3a" if get("augment.three_augment") else get("augment.auto_augment")


def _sched(get: Getter) -> str:
    """The schedule a stage runs (optimizer.sched; cosine where a log predates the key)."""
    return str(get("optimizer.sched") or "cosine")


def _on(get: Getter, dotted: str) -> bool:
    """Whether a rate or Beta alpha is above 0 (unset: 0)."""
    return (get(dotted) or 0) > 0


@dataclass(frozen=True)
class Unread:
    """Settings a stage never reads while `when` holds of its config, and why (`because`, for people). In the
    identity such a setting holds the schema's default, or (`canonical="options"`, rules added after runs were
    written) the value the run's group options compose: a run that never set it keeps its identity."""

    settings: tuple[str, ...]
    when: Callable[[Getter], bool]
    because: str
    canonical: str = "schema"


TOKEN_KINDS = ("hard_token", "soft_token")  # distil through a distillation token: the model's distilled twin trains


def _distilled_student(get: Getter) -> bool:
    """Whether the network a stage trains has a distillation head (train/models.py student_name)."""
    token = str(get("distill.type")) in TOKEN_KINDS
    return "_distilled_" in str(get("model.name")) or (token and bool(get("model.distilled_name")))


UNREAD = (
    Unread(("augment.color_jitter", "augment.auto_augment", "augment.scale", "augment.hflip", "augment.reprob",
            "augment.remode", "augment.recount"), lambda get: bool(get("augment.no_aug")),
           "augment.no_aug=true trains on a resized centre crop alone (timm's transforms_noaug_train)"),
    Unread(("augment.color_jitter",), lambda get: "3a" not in str(_auto_policy(get) or "3a"),
           "timm applies colour jitter only when no RandAugment/AutoAugment policy is on (create_transform; "
           "3-Augment keeps it), and augment.auto_augment sets one"),
    Unread(("augment.remode", "augment.recount"), lambda get: not _on(get, "augment.reprob"),
           "random erasing is off (augment.reprob=0)"),
    Unread(("augment.scale",), lambda get: str(get("augment.crop")) == "simple",
           "augment.crop=simple replaces the random-resized crop, which alone reads the scale"),
    Unread(("mix.switch_prob",),
           lambda get: not all(_on(get, key) for key in ("mix.mixup_alpha", "mix.cutmix_alpha", "mix.prob")),
           "timm's Mixup switches between Mixup and CutMix only when both are on (mix.mixup_alpha > 0 and "
           "mix.cutmix_alpha > 0) and it mixes at all (mix.prob > 0)"),
    Unread(("mix.prob", "mix.mode"), lambda get: not (_on(get, "mix.mixup_alpha") or _on(get, "mix.cutmix_alpha")),
           "no Mixup or CutMix runs (mix.mixup_alpha = mix.cutmix_alpha = 0)"),
    Unread(("distill.alpha", "distill.tau", "distill.kl_normalization", "distill.teacher_view"),
           lambda get: str(get("distill.type")) == NO_DISTILLATION,
           "the run does not distil (distill.type=none): it has no teacher term"),
    Unread(("distill.tau", "distill.kl_normalization"), lambda get: str(get("distill.type")) in HARD_KINDS,
           "a hard distillation (distill.type=hard, hard_token) takes the teacher's arg-max label: no temperature, "
           "no KL"),
    Unread(("distill.tau", "distill.kl_normalization"),
           lambda get: str(get("distill.type")) not in (NO_DISTILLATION, *HARD_KINDS) and not _on(get, "distill.alpha"),
           "distill.alpha=0 weighs the teacher's soft term by nothing: its temperature and KL scaling change no loss"),
    Unread(("transfer.source_stage",), lambda get: bool(get("transfer.init_checkpoint")),
           "a transfer from transfer.init_checkpoint starts from that file, not from a source run's stage"),
    Unread(("finetune.pretrain_size",), lambda get: bool(get("finetune.init_checkpoint")),
           "a fine-tune from finetune.init_checkpoint starts from that file, not from a pre-training run"),
    Unread(("optimizer.momentum",), lambda get: is_adam_like(str(get("optimizer.name"))),
           "an Adam-like optimizer (adam*, lamb) takes betas and eps, not momentum"),
    Unread(("optimizer.betas", "optimizer.eps"), lambda get: not is_adam_like(str(get("optimizer.name"))),
           "an SGD-like optimizer takes momentum, not Adam's betas and eps"),
    Unread(("model.distilled_name",),
           lambda get: str(get("distill.type")) not in TOKEN_KINDS or "_distilled_" in str(get("model.name")),
           "only a distillation-token kind (distill.type=hard_token, soft_token) of a model without a distillation "
           "token trains the model's distilled twin",
           canonical="options"),
    Unread(("distill.fusion",), lambda get: not _distilled_student(get),
           "only a model with a distillation head fuses two heads at evaluation", canonical="options"),
    Unread(("distill.teacher.model",), lambda get: get("distill.teacher.chain") is not None,
           "a chained teacher run (distill.teacher.chain) is its own model option", canonical="options"),
    Unread(("train.ema_decay",), lambda get: not get("train.ema"), "no EMA of the weights is kept (train.ema=false)",
           canonical="options"),
    Unread(("optimizer.decay_epochs", "optimizer.decay_rate"), lambda get: _sched(get) != "step",
           "only optimizer.sched=step decays the lr in steps (train/optim.py build_scheduler)"),
    Unread(("optimizer.min_lr",), lambda get: _sched(get) == "step", "timm's step schedule has no floor"),
    Unread(("optimizer.warmup_epochs", "optimizer.warmup_lr", "optimizer.min_lr", "optimizer.sched_on"),
           lambda get: _sched(get) == "none", "optimizer.sched=none trains at the peak lr throughout, no warm-up"),
)
# The settings whose unread value in the identity is the one the run's options compose (Unread.canonical).
CANONICAL_BY_OPTIONS = frozenset(key for rule in UNREAD if rule.canonical == "options" for key in rule.settings)


@functools.cache
def _schema_defaults() -> str:
    return json.dumps(OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True))


def schema_default(dotted: str) -> Any:
    """The schema's default of a dotted key (`mix.switch_prob` -> 0.5) as plain data, what an unread setting holds
    in a run's identity; a KeyError for a key the schema lacks."""
    node: Any = json.loads(_schema_defaults())
    for key in dotted.split("."):
        node = node[key]
    return node


def unread_settings(get: Getter) -> dict[str, str]:
    """`{setting: why}` of the settings a stage whose config `get` reads (dotted key -> value) never reads."""
    found: dict[str, str] = {}
    for rule in UNREAD:
        if rule.when(get):
            for setting in rule.settings:
                found.setdefault(setting, rule.because)
    return found
