"""A stage's network checked before anything is written, built on the meta device (no memory, no initialisation):
that timm builds it from its arguments, and that a fine-tune or transfer builds the network whose weights it loads."""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from deit_ablate.config.schema import Stage
from deit_ablate.core.errors import ConfigError
from deit_ablate.run.stages import classifier_names
from deit_ablate.run.student import StudentSpec, build_stage_model


def meta_model(student: StudentSpec, img_size: int | None = None) -> torch.nn.Module:
    """The network `student` describes, built on the meta device (no memory, no initialisation); a ConfigError
    naming model.kwargs and the fix when timm refuses its arguments (num_heads that do not divide embed_dim, a
    negative size), so such a value stops the launch, not the run."""
    try:
        with torch.device("meta"):
            return build_stage_model(student, img_size)
    except ConfigError:
        raise
    except Exception as error:  # whatever timm raises for arguments it cannot build: AssertionError, RuntimeError, ...
        kwargs = OmegaConf.to_container(student.model.kwargs, resolve=True)
        given = ", ".join(f"model.kwargs.{key}={value}" for key, value in kwargs.items()) or "no model.kwargs"
        raise ConfigError(f"{student.name} cannot be built with {given}: timm refuses them ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else 'no message'}). Change the model.kwargs "
                          "value it names (e.g. model.kwargs.num_heads a divisor of model.kwargs.embed_dim, sizes "
                          "positive), or drop it to keep the model option's own (conf/model/).") from None


# Model settings a later stage may change without changing the weights it loads: how the network trains.
TRAINING_ONLY = ("drop_path", "dropout")


def _architecture(spec: StudentSpec) -> tuple:
    """What of a student's spec decides its weights' names and shapes (its model block but for drop rates)."""
    model = OmegaConf.to_container(spec.model, resolve=True, enum_to_str=True)
    return spec.name, spec.num_classes, {key: value for key, value in model.items() if key not in TRAINING_ONLY}


# The weights' names and shapes and the heads of each network built on meta, by its spec and size: a sweep's runs
# mostly share one, and a paper-scale build takes about 0.2 s.
_WEIGHTS: dict[str, tuple[dict[str, tuple[int, ...]], tuple[str, ...]]] = {}


def meta_weights(spec: StudentSpec, img_size: int | None = None) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """The names and shapes of the weights of the network `spec` describes (at `img_size`, else its training size),
    and its heads' names; built on meta (meta_model) once per spec and size."""
    model_block = OmegaConf.to_container(spec.model, resolve=True, enum_to_str=True)
    key = json.dumps([spec.name, spec.num_classes, img_size or spec.img_size, model_block], sort_keys=True, default=str)
    if key not in _WEIGHTS:
        model = meta_model(spec, img_size)
        _WEIGHTS[key] = {name: tuple(value.shape) for name, value in model.state_dict().items()}, \
            classifier_names(model)
    return _WEIGHTS[key]


def check_stage_architecture(block: str, stage: str, source: StudentSpec, target: StudentSpec,
                             changes: list[str]) -> None:
    """The network of the later stage `stage` (`target`) holds the weights of the run it starts from (`source`):
    its override set (`block`.overrides, whose `changes` stage_config.stage_changes lists) may change how it trains
    (drop rates, image size) but not the architecture, which would fail only when the weights load, after that run
    trained; a ConfigError naming the changed keys and weights otherwise. A transfer's heads start anew."""
    if _architecture(source) == _architecture(target):
        return
    heads_new = stage == str(Stage.transfer)  # a transfer's classifier starts anew for its classes
    before, source_heads = meta_weights(source, target.img_size)
    after, target_heads = meta_weights(target, target.img_size)
    heads = tuple(f"{head}." for head in (*source_heads, *target_heads)) if heads_new else ()
    kept = {key: shape for key, shape in before.items() if not key.startswith(heads)}
    now = {key: shape for key, shape in after.items() if not key.startswith(heads)}
    differ = sorted(kept.keys() ^ now.keys()) + sorted(k for k in kept.keys() & now.keys() if kept[k] != now[k])
    if not differ:
        return
    changed = [change for change in changes if change.startswith(("model.", "distill.type", "data.num_classes"))
               and not change.startswith(tuple(f"model.{key} " for key in TRAINING_ONLY))]
    starts = "its pre-training" if stage == str(Stage.finetune) else "its source run"
    shown = f"{', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}"
    raise ConfigError(f"{block}.overrides changes the network ({'; '.join(changed)}), but stage={stage} loads the "
                      f"weights of {starts} into it: {target.name} as the stage builds it has other weights than "
                      f"{starts}'s {source.name} ({shown}), so the stage would fail to load them after {starts} "
                      "trained. A stage may change how the network trains (drop path, dropout, the image size), not "
                      f"its architecture: drop the model keys from {block}.overrides, or set them for the whole run.")
