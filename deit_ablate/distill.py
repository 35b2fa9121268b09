"""Knowledge distillation for DeiT: losses, late fusion of the two heads, teachers, pos-embed resize.

Where each constant comes from (Touvron et al. 2021, "Training data-efficient image transformers"):

* ``soft`` / ``soft_token``: the paper's Eq. 2,
  ``(1 - lambda) * CE(label) + lambda * tau^2 * KL(teacher || student)``, with ``lambda = 0.1`` and
  ``tau = 3`` (the values of the paper's soft-distillation runs).
* ``hard`` / ``hard_token``: the paper's Eq. 3, one half on the true label and one half on the teacher's
  arg-max label; the released DeiT code writes this as ``alpha = 0.5`` with
  ``base * (1 - alpha) + teacher_term * alpha``, which is the form used here for every kind.
  The teacher's label is never label-smoothed (paper and released code); only the class term is.
* KL direction: ``sum p_t * (log p_t - log p_s)`` on ``softmax(z / tau)``, i.e. KL(teacher || student),
  which is what the released code computes.
* KL normalization: the released code sums the KL over images and classes and divides by the number of
  elements ``B * K`` ("elements", the default here, faithful to the code); the textbook per-image form divides
  by ``B`` only ("batch"), which is K times larger. Both are multiplied by ``tau^2``.
* Inference: the paper fuses the heads by averaging their softmax outputs ("prob"); the released code, and
  timm's ``VisionTransformerDistilled`` in eval mode, average the logits ("logit"). Both are reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import nn

from deit_ablate.checkpoint import read_weights
from deit_ablate.errors import ConfigError

KINDS = ("none", "soft", "hard", "hard_token", "soft_token")
TOKEN_KINDS = ("hard_token", "soft_token")
SOFT_KINDS = ("soft", "soft_token")
HARD_KINDS = ("hard", "hard_token")
KL_NORMALIZATIONS = ("elements", "batch")
FUSION_RULES = ("prob", "logit")

# Paper constants (see the module docstring for their sources).
PAPER_SOFT_ALPHA = 0.1
PAPER_SOFT_TAU = 3.0
PAPER_HARD_ALPHA = 0.5

StudentOutputs = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _check_kind(kind: str) -> None:
    """Raise a clear error for an unknown distillation kind."""
    if kind not in KINDS:
        raise ConfigError(
            f"Unknown distillation kind {kind!r}. Choose one of {', '.join(KINDS)} (config group `distill=`)."
        )


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half-precision (autocast) logits to float32; float32/float64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def default_alpha(kind: str) -> float:
    """Weight of the teacher term the DeiT paper used for this kind (0 for "none")."""
    _check_kind(kind)
    if kind in SOFT_KINDS:
        return PAPER_SOFT_ALPHA
    if kind in HARD_KINDS:
        return PAPER_HARD_ALPHA
    return 0.0


def default_tau(kind: str) -> float:
    """Temperature the DeiT paper used for this kind (1 where no temperature enters the loss)."""
    _check_kind(kind)
    return PAPER_SOFT_TAU if kind in SOFT_KINDS else 1.0


def kl_teacher_student(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float, normalization: str = "elements"
) -> torch.Tensor:
    """tau^2 * KL(softmax(teacher/tau) || softmax(student/tau)), normalized per element or per image."""
    if normalization not in KL_NORMALIZATIONS:
        raise ConfigError(
            f"Unknown kl_normalization {normalization!r}; use 'elements' (released DeiT code: divide by B*K) "
            "or 'batch' (per image: divide by B)."
        )
    log_p_s = F.log_softmax(_at_least_f32(student_logits) / tau, dim=-1)
    log_p_t = F.log_softmax(_at_least_f32(teacher_logits) / tau, dim=-1)
    total = F.kl_div(log_p_s, log_p_t, reduction="sum", log_target=True)
    denom = student_logits.numel() if normalization == "elements" else student_logits.shape[0]
    return total * (tau * tau) / denom


class DistillationLoss(nn.Module):
    """The DeiT training loss for every distillation kind: ``(1 - alpha) * base + alpha * teacher_term``."""

    def __init__(
        self,
        base_criterion: nn.Module,
        kind: str = "none",
        alpha: float | None = None,
        tau: float | None = None,
        kl_normalization: str = "elements",
    ) -> None:
        """Store the class-head criterion and the teacher term's kind, weight and temperature."""
        super().__init__()
        _check_kind(kind)
        if kl_normalization not in KL_NORMALIZATIONS:
            raise ConfigError(
                f"Unknown distill.kl_normalization {kl_normalization!r}; use 'elements' (released DeiT code) "
                "or 'batch' (per image)."
            )
        alpha = default_alpha(kind) if alpha is None else float(alpha)
        tau = default_tau(kind) if tau is None else float(tau)
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"distill.alpha must lie in [0, 1], got {alpha}; it weights the teacher term.")
        if tau <= 0:
            raise ConfigError(f"distill.tau must be positive, got {tau}.")
        self.base_criterion = base_criterion
        self.kind = kind
        self.alpha = alpha
        self.tau = tau
        self.kl_normalization = kl_normalization

    def extra_repr(self) -> str:
        """Show the settings in the module's repr."""
        return (
            f"kind={self.kind}, alpha={self.alpha}, tau={self.tau}, kl_normalization={self.kl_normalization}"
        )

    def _heads(self, outputs: StudentOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (class-head logits, logits that receive the teacher term) for this kind."""
        if isinstance(outputs, (tuple, list)):
            if len(outputs) != 2:
                raise ValueError(
                    f"Expected the student to return logits or a (cls_logits, dist_logits) pair, got a "
                    f"{type(outputs).__name__} of length {len(outputs)}."
                )
            cls_logits, dist_logits = outputs
            if self.kind in TOKEN_KINDS:
                return cls_logits, dist_logits
            # Non-token kinds put every term on the class head; the distillation head is left untrained.
            return cls_logits, cls_logits
        if self.kind in TOKEN_KINDS:
            raise ConfigError(
                f"distill={self.kind} trains a distillation token, but the student returned a single logits "
                "tensor (no distillation head). Use a `*_distilled_*` model (e.g. model=deit_tiny_distilled) "
                "and call `model.set_distilled_training(True)` so that it returns (cls_logits, dist_logits) "
                "in train mode; or use distill=hard / distill=soft to distil into the class head."
            )
        return outputs, outputs

    def forward(
        self, student_outputs: StudentOutputs, teacher_logits: torch.Tensor | None, targets: torch.Tensor
    ) -> torch.Tensor:
        """Loss for one batch; ``targets`` are whatever ``base_criterion`` takes (integer or Mixup soft)."""
        cls_logits, kd_logits = self._heads(student_outputs)
        base = self.base_criterion(cls_logits, targets)
        if self.kind == "none":
            return base
        if teacher_logits is None:
            raise ValueError(
                f"distill={self.kind} needs the teacher's logits on the same (augmented, mixed) batch; "
                "got None."
            )
        teacher_logits = teacher_logits.detach()
        if teacher_logits.shape != kd_logits.shape:
            raise ValueError(
                f"Teacher logits have shape {tuple(teacher_logits.shape)} but the student's are "
                f"{tuple(kd_logits.shape)}; teacher and student must predict the same classes."
            )
        if self.kind in SOFT_KINDS:
            teacher_term = kl_teacher_student(kd_logits, teacher_logits, self.tau, self.kl_normalization)
        else:
            # The teacher's arg-max label, with no label smoothing (DeiT Eq. 3).
            teacher_term = F.cross_entropy(_at_least_f32(kd_logits), teacher_logits.argmax(dim=-1))
        return base * (1.0 - self.alpha) + teacher_term * self.alpha


def fuse_predictions(cls_logits: torch.Tensor, dist_logits: torch.Tensor, rule: str = "prob") -> torch.Tensor:
    """Late fusion of the two heads: "prob" = mean of softmaxes (paper), "logit" = mean of logits (code)."""
    if rule == "prob":
        return (_at_least_f32(cls_logits).softmax(dim=-1) + _at_least_f32(dist_logits).softmax(dim=-1)) / 2
    if rule == "logit":
        return (_at_least_f32(cls_logits) + _at_least_f32(dist_logits)) / 2
    raise ConfigError(
        f"Unknown distill.fusion {rule!r}; use 'prob' (the paper's average of softmax outputs) or 'logit' "
        "(the released code's average of logits)."
    )


def distilled_eval_outputs(
    cls_logits: torch.Tensor, dist_logits: torch.Tensor, rule: str = "prob"
) -> dict[str, torch.Tensor]:
    """Per-head scores for evaluation: "cls", "dist", "fused" (by ``rule``), "fused_alt" (the other rule)."""
    fused = fuse_predictions(cls_logits, dist_logits, rule)  # validates the rule
    other = "logit" if rule == "prob" else "prob"
    return {
        "cls": cls_logits,
        "dist": dist_logits,
        "fused": fused,
        "fused_alt": fuse_predictions(cls_logits, dist_logits, other),
    }


def distilled_head_logits(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both heads' logits of a timm distilled ViT, in any mode (timm's eval forward returns their average)."""
    if not hasattr(model, "head_dist"):
        raise ValueError(
            f"{type(model).__name__} has no distillation head (`head_dist`); per-head evaluation needs a "
            "`*_distilled_*` model."
        )
    tokens = model.forward_features(images)
    cls_tok, dist_tok = tokens[:, 0], tokens[:, 1]
    head_drop = getattr(model, "head_drop", nn.Identity())
    return model.head(head_drop(cls_tok)), model.head_dist(head_drop(dist_tok))


# ----------------------------------------------------------------------------------------------------------
# Teacher


class TeacherLoadError(ConfigError):
    """A teacher checkpoint that cannot be used, with the problem and the fix in the message."""


_COMMON_CLASSIFIERS = ("head.fc", "fc", "head", "classifier", "last_linear")


def _classifier_names(model_name: str) -> tuple[str, ...]:
    """Module names of the classifier of a timm architecture, from its pretrained config when timm has one."""
    try:
        cfg = timm.get_pretrained_cfg(model_name)
    except Exception:  # unknown or custom model names have no config
        cfg = None
    names = getattr(cfg, "classifier", None) if cfg is not None else None
    if isinstance(names, str):
        return (names,)
    if names:
        return tuple(names)
    return _COMMON_CLASSIFIERS


def _check_head(
    state: Mapping[str, torch.Tensor], names: tuple[str, ...], num_classes: int, where: str
) -> None:
    """Raise if the checkpoint's classifier predicts a different number of classes than the run."""
    for name in names:
        weight = state.get(f"{name}.weight")
        if weight is not None and weight.ndim >= 2 and weight.shape[0] != num_classes:
            raise TeacherLoadError(
                f"The teacher checkpoint {where} has a {weight.shape[0]}-class head ({name}.weight has shape "
                f"{tuple(weight.shape)}), but this run has {num_classes} classes. Distil from a teacher "
                f"trained on the same dataset (data.num_classes={num_classes}), or train one first with "
                "`python train.py model=<cnn>` on this data."
            )


def _few(keys: list[str], n: int = 5) -> str:
    """A short, readable list of keys."""
    shown = ", ".join(keys[:n])
    return shown + (f", … ({len(keys)} in all)" if len(keys) > n else "")


def load_teacher(
    model_name: str, checkpoint: str | Path | None, num_classes: int, **model_kwargs: Any
) -> nn.Module:
    """Build the timm teacher, load its checkpoint, and return it frozen in eval mode on CPU."""
    if checkpoint is None or str(checkpoint).strip() == "":
        raise TeacherLoadError(
            "distill.teacher.checkpoint is not set, so there is no teacher to distil from. Train a teacher "
            "first with `python train.py model=<cnn>` (e.g. model=regnety_160, or the demo CNN) and pass its "
            "checkpoint with distill.teacher.checkpoint=/path/to/checkpoint.pth, or use distill=none."
        )
    path = Path(checkpoint).expanduser()
    if not path.is_file():
        raise TeacherLoadError(
            f"The teacher checkpoint {path} does not exist (distill.teacher.checkpoint). Check the path, or "
            "train a teacher first with `python train.py model=<cnn>` and point distill.teacher.checkpoint "
            "at its checkpoint file."
        )
    state = read_weights(path, source=f"The teacher checkpoint {path}")
    # Before building: a teacher trained on other classes is the commonest mistake, and says so plainly.
    _check_head(state, _classifier_names(model_name), num_classes, str(path))

    model = timm.create_model(model_name, pretrained=False, num_classes=num_classes, **model_kwargs)
    expected = model.state_dict()
    names = tuple(n for n, m in model.named_modules() if n and m in _as_tuple(model.get_classifier()))
    _check_head(state, names, num_classes, str(path))
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_few(unexpected)}")
        raise TeacherLoadError(
            f"The teacher checkpoint {path} does not match the architecture {model_name!r} "
            f"({'; '.join(parts)}). Set distill.teacher.model to the architecture the checkpoint was trained "
            "with (and the same model kwargs)."
        )
    mismatched = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if state[k].shape != v.shape
    ]
    if mismatched:
        raise TeacherLoadError(
            f"The teacher checkpoint {path} has tensors of other shapes than {model_name!r} builds "
            f"(checkpoint vs model: {_few(mismatched, 3)}). Set distill.teacher.model and its kwargs to "
            "those the checkpoint was trained with."
        )
    model.load_state_dict(state, strict=True)
    model.eval()
    model.requires_grad_(False)
    return model


def _as_tuple(module: nn.Module | tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    """timm's get_classifier returns a module, or a tuple of them for distilled models."""
    return module if isinstance(module, tuple) else (module,)


def teacher_forward(teacher: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Float32 teacher logits without autograd (bf16 autocast on CUDA); feed it the student's mixed batch."""
    if teacher.training:
        teacher.eval()
    # no_grad rather than inference_mode: the logits are later used next to autograd tensors in the loss.
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=images.is_cuda):
        logits = teacher(images)
    return logits.float()


# ----------------------------------------------------------------------------------------------------------
# Wiring into a run


def resolve_teacher(teacher_cfg, output_root: str | Path) -> tuple[str, dict[str, Any], Path]:
    """Teacher architecture, its timm kwargs and checkpoint file; a run folder (or run name) brings all three."""
    reference = teacher_cfg.checkpoint
    name, kwargs = teacher_cfg.model, dict(teacher_cfg.kwargs)
    if reference is None or str(reference).strip() == "":
        return name, kwargs, None  # load_teacher explains what to do
    path = Path(str(reference)).expanduser()
    if not path.exists() and (Path(output_root) / "runs" / str(reference)).is_dir():
        path = Path(output_root) / "runs" / str(reference)
    if path.is_dir():
        run_config = path / ".hydra" / "config.yaml"
        if run_config.exists():
            import yaml

            model = yaml.safe_load(run_config.read_text())["model"]
            name, kwargs = model["name"], dict(model.get("kwargs") or {})
        best, last = path / "checkpoint-best.pt", path / "checkpoint-last.pt"
        path = best if best.exists() else last
    return name, kwargs, path


def student_model_name(cfg) -> str:
    """The timm model a run trains: model.name, or its distilled twin (model.distilled_name) for the token kinds.

    DeiT's Table 3 trains plain DeiT for no distillation and the class-token kinds, and DeiT⚗ (with a
    distillation token) for the token kinds; a distilled model given a class-token kind would train the average
    of its two heads (timm's forward), which no row of the paper does, so it is refused."""
    kind, name, twin = cfg.distill.type, cfg.model.name, cfg.model.distilled_name
    distilled = "_distilled_" in name
    if kind in TOKEN_KINDS:
        if distilled:
            return name
        if twin:
            return twin
        raise ConfigError(f"distill={kind} trains a distillation token, but model.name={name} has none and "
                          "model.distilled_name is unset. Use a DeiT model option (model=deit_base, "
                          "model=vit_demo, ...), whose distilled twin is picked for you, or distill=hard / "
                          "distill=soft.")
    if distilled:
        raise ConfigError(f"model.name={name} has a distillation token, which distill={kind} does not train: timm "
                          "would train the average of its two heads, and DeiT's Table 3 trains the plain model for "
                          "this row. Use the model without the token (model=vit_demo, model=deit_base, ... instead "
                          "of their _distilled options); distill=hard_token and distill=soft_token pick the "
                          "distilled twin themselves.")
    return name


def check_distill_config(cfg) -> None:
    """Before anything runs: the student model suits the kind and the teacher resolves to a loadable file."""
    kind = cfg.distill.type
    student_model_name(cfg)
    if kind == "none":
        return
    name, _, path = resolve_teacher(cfg.distill.teacher, cfg.output_root)
    if path is None or not Path(path).is_file():
        load_teacher(name, path, cfg.data.num_classes)  # raises the message for a missing/unset checkpoint
    if not timm.is_model(name):
        raise ConfigError(f"distill.teacher.model={name} is not a timm model; set it to the teacher's architecture.")


def build_teacher(cfg, device: torch.device) -> nn.Module:
    """The frozen teacher on `device` (channels_last on GPU), checked against the data's class count."""
    name, kwargs, path = resolve_teacher(cfg.distill.teacher, cfg.output_root)
    teacher = load_teacher(name, path, cfg.data.num_classes, **kwargs).to(device)
    if device.type == "cuda" and not hasattr(teacher, "pos_embed"):
        teacher = teacher.to(memory_format=torch.channels_last)
    return teacher
