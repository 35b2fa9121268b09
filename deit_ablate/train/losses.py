"""Every loss of a run, in one place: the criterion Mixup/CutMix asks for (soft-target, label-smoothed or DeiT III's
binary cross-entropy), DeiT's distillation losses, the fixed teacher's cached term, and the late fusion of the two
heads (teachers: teacher.py).

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

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.data.mixup import cutmix_bbox_and_lam
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn

from deit_ablate.config.schema import Criterion, DistillKind, FusionRule, KLNormalization, MixConfig
from deit_ablate.core.errors import ConfigError

TOKEN_KINDS = (DistillKind.hard_token, DistillKind.soft_token)
SOFT_KINDS = ("soft", "soft_token")

StudentOutputs = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half-precision (autocast) logits to float32; float32/float64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def kl_teacher_student(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float, normalization: str = "elements"
) -> torch.Tensor:
    """tau^2 * KL(softmax(teacher/tau) || softmax(student/tau)), normalized per element or per image."""
    normalization = KLNormalization(normalization)
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
        kind: str,
        alpha: float,
        tau: float,
        kl_normalization: str = "elements",
    ) -> None:
        """Store the class-head criterion and the teacher term's kind, weight and temperature (the config's
        schema holds the allowed kinds and ranges; conf/distill/*.yaml the paper's values)."""
        super().__init__()
        self.base_criterion = base_criterion
        self.kind = DistillKind(kind)
        self.alpha = float(alpha)
        self.tau = float(tau)
        self.kl_normalization = KLNormalization(kl_normalization)

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
        if self.kind == DistillKind.none:
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
    if FusionRule(rule) == FusionRule.prob:
        return (_at_least_f32(cls_logits).softmax(dim=-1) + _at_least_f32(dist_logits).softmax(dim=-1)) / 2
    return (_at_least_f32(cls_logits) + _at_least_f32(dist_logits)) / 2


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


# --- the criterion of the (mixed) targets ---------------------------------------------------------------


class ReusedBufferMixup(Mixup):
    """timm's Mixup, the same draws and the same pixels, with the batch's reversed copy written into one buffer kept
    across steps, and CutMix's into its box only. timm's `x.flip(0)` allocates the whole batch every step: at batch
    256 at 224 px a fresh 154 MB tensor, whose page faults cost more than the flip on the CPU (issue 53, point 2;
    docs/host-step.md)."""

    _scratch: torch.Tensor | None = None

    def _reversed(self, x: torch.Tensor) -> torch.Tensor:
        """x's images in reverse order, in the kept buffer."""
        if self._scratch is None or self._scratch.numel() < x.numel() or self._scratch.dtype != x.dtype or \
                self._scratch.device != x.device:
            self._scratch = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        order = torch.arange(x.shape[0] - 1, -1, -1, device=x.device)
        return torch.index_select(x, 0, order, out=self._scratch[:x.numel()].view(x.shape))

    def _mix_batch(self, x: torch.Tensor) -> float:
        lam, use_cutmix = self._params_per_batch()
        if lam == 1.0:
            return 1.0
        if use_cutmix:
            (yl, yh, xl, xh), lam = cutmix_bbox_and_lam(x.shape, lam, ratio_minmax=self.cutmix_minmax,
                                                        correct_lam=self.correct_lam)
            box = x[:, :, yl:yh, xl:xh]
            box.copy_(self._reversed(box))
        else:
            flipped = self._reversed(x).mul_(1.0 - lam)  # before x changes
            x.mul_(lam).add_(flipped)
        return lam


def build_mixup(mix: MixConfig, num_classes: int) -> Mixup | None:
    """timm's Mixup with DeiT's Beta alphas and switch probability (ReusedBufferMixup: the same draws and pixels);
    None when both alphas are 0."""
    if mix.mixup_alpha <= 0 and mix.cutmix_alpha <= 0:
        return None
    return ReusedBufferMixup(
        mixup_alpha=mix.mixup_alpha,
        cutmix_alpha=mix.cutmix_alpha,
        prob=mix.prob,
        switch_prob=mix.switch_prob,
        mode=mix.mode,
        label_smoothing=mix.label_smoothing,
        num_classes=num_classes,
    )


def build_criterion(mix: MixConfig, mixup: Mixup | None) -> torch.nn.Module:
    """Soft-target CE when Mixup makes (smoothed) soft targets, else label-smoothed CE on integer labels; or
    DeiT III's binary cross-entropy (mix.criterion=bce)."""
    if mix.criterion == Criterion.bce:
        return binary_cross_entropy()
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if mix.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=mix.label_smoothing)
    return torch.nn.CrossEntropyLoss()


def binary_cross_entropy() -> torch.nn.Module:
    """DeiT III's loss (Touvron, Cord & Jegou 2022; Wightman et al. 2021): a sigmoid per class, every class present
    in the (mixed) target a positive of target 1, the mean over images and classes."""
    # DeiT III's engine sets targets = targets.gt(0.0) before torch's BCEWithLogitsLoss (mean reduction): the
    # threshold 0 is that; integer labels (no Mixup/CutMix) become one-hot.
    return BinaryCrossEntropy(smoothing=0.0, target_threshold=0.0, reduction="mean")


# --- the fixed teacher's cached term (run/teacher_cache.py builds the table) -----------------------------


def split_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, image indices) of a batch of WithIndex targets."""
    return targets[:, 0], targets[:, 1]


class FixedTeacherLoss:
    """The distillation loss with the cached teacher outputs of the batch's images (targets: WithIndex's)."""

    def __init__(self, distill_loss: nn.Module, table: torch.Tensor) -> None:
        self.distill_loss, self.table = distill_loss, table

    def __call__(self, images: torch.Tensor, outputs, targets: torch.Tensor) -> torch.Tensor:
        """`images` are unused: the teacher's term never depends on the student's view."""
        labels, indices = split_targets(targets)
        return self.distill_loss(outputs, self.table[indices], labels)
