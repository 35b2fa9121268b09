"""The teacher network of a distillation run: built from timm, its checkpoint loaded safely and checked against
the run's classes, frozen, and evaluated on a batch (at several sizes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import nn

from deit_ablate.core.errors import ConfigError
from deit_ablate.record.checkpoint import read_weights


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


def teacher_forward(teacher: nn.Module, images: torch.Tensor, bf16: bool | None = None) -> torch.Tensor:
    """Float32 teacher logits without autograd, under bf16 autocast when `bf16` (default: on a GPU, not on the CPU);
    feed it the student's mixed batch."""
    if teacher.training:
        teacher.eval()
    bf16 = images.device.type == "cuda" if bf16 is None else bf16
    # no_grad rather than inference_mode: the logits are later used next to autograd tensors in the loss.
    with torch.no_grad(), torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = teacher(images)
    return logits.float()


class MultiSizeTeacher(nn.Module):
    """A teacher evaluated on each batch at several sizes, its float32 logits averaged (distill.teacher.sizes: Beyer
    et al. 2022's teacher at 224 and 384 px). Each size resizes the batch to size x size, bilinearly with half-pixel
    centres and no antialiasing (F.interpolate, align_corners=False); a size equal to the batch's is the batch."""

    def __init__(self, teacher: nn.Module, sizes: Sequence[int]) -> None:
        super().__init__()
        self.teacher, self.sizes = teacher, tuple(int(size) for size in sizes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The mean over `sizes` of the teacher's logits on `images` resized to each."""
        total = None
        for size in self.sizes:
            resized = images if tuple(images.shape[-2:]) == (size, size) else F.interpolate(
                images, size=(size, size), mode="bilinear", align_corners=False, antialias=False)
            logits = self.teacher(resized).float()
            total = logits if total is None else total + logits
        return total / len(self.sizes)


# ----------------------------------------------------------------------------------------------------------
# Wiring into a run
