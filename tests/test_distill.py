"""Distillation: each loss against its formula by hand, fusion rules, teachers, pos-embed resize."""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.data.mixup import mixup_target
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.run import teacher as teacher_module
from deit_ablate.run.report import fusion_figures, summarize
from deit_ablate.train.losses import DistillationLoss, distilled_eval_outputs, distilled_head_logits, fuse_predictions
from deit_ablate.train.models import resize_pos_embed_state
from deit_ablate.train.teacher import TeacherLoadError, load_teacher, teacher_forward
from deit_ablate.train.trainer import evaluate
from tests.conftest import compose_config

B, K, EPS = 4, 5, 0.1


# ---------------------------------------------------------------- hand-written references (loops, no helpers)


def hand_log_softmax(row: list[float]) -> list[float]:
    """log softmax of one row, written out."""
    m = max(row)
    log_z = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - log_z for v in row]


def hand_ce(logits: torch.Tensor, target_rows: list[list[float]]) -> float:
    """Batch mean of -sum_k target_k log softmax(z)_k."""
    total = 0.0
    for b in range(logits.shape[0]):
        logp = hand_log_softmax(logits[b].tolist())
        total -= sum(t * lp for t, lp in zip(target_rows[b], logp, strict=True))
    return total / logits.shape[0]


def smoothed(y: torch.Tensor, k: int, eps: float) -> list[list[float]]:
    """(1 - eps) e_y + eps / K, one list per image."""
    return [[(1 - eps) * (c == int(yb)) + eps / k for c in range(k)] for yb in y]


def one_hot_rows(y: torch.Tensor, k: int) -> list[list[float]]:
    """e_y with no smoothing."""
    return [[float(c == int(yb)) for c in range(k)] for yb in y]


def hand_kl_sum(p_logits: torch.Tensor, q_logits: torch.Tensor, tau: float) -> float:
    """sum over images and classes of p (log p - log q), p = softmax(p_logits / tau), q likewise."""
    total = 0.0
    for b in range(p_logits.shape[0]):
        logp = hand_log_softmax([v / tau for v in p_logits[b].tolist()])
        logq = hand_log_softmax([v / tau for v in q_logits[b].tolist()])
        for k in range(p_logits.shape[1]):
            total += math.exp(logp[k]) * (logp[k] - logq[k])
    return total


def teacher_labels(teacher: torch.Tensor) -> torch.Tensor:
    """Arg-max per row, by a loop."""
    return torch.tensor([max(range(teacher.shape[1]), key=lambda k, r=row: r[k]) for row in teacher.tolist()])


@pytest.fixture()
def batch() -> dict[str, torch.Tensor]:
    """Small random logits for student heads and teacher, plus integer labels."""
    g = torch.Generator().manual_seed(0)
    return {
        "cls": torch.randn(B, K, generator=g, dtype=torch.float64) * 2,
        "dist": torch.randn(B, K, generator=g, dtype=torch.float64) * 2,
        "teacher": torch.randn(B, K, generator=g, dtype=torch.float64) * 3,
        "y": torch.tensor([0, 3, 1, 4]),
    }


def ls_base() -> LabelSmoothingCrossEntropy:
    """The class-head criterion without Mixup."""
    return LabelSmoothingCrossEntropy(EPS)


# ---------------------------------------------------------------- losses


def paper_loss(base, kind: str, **settings) -> DistillationLoss:
    """The loss with the paper's alpha and tau for `kind`, as conf/distill/<kind>.yaml sets them."""
    distill = compose_config([f"distill={kind}"]).distill
    return DistillationLoss(base, kind, distill.alpha, distill.tau, **settings)


def test_defaults_follow_the_paper() -> None:
    # DeiT Eq. 2 (soft): lambda 0.1, tau 3; Eq. 3 (hard): 1/2 each.
    settings = {kind: compose_config([f"distill={kind}"]).distill
                for kind in ("none", "soft", "soft_token", "hard", "hard_token")}
    assert settings["soft"].alpha == settings["soft_token"].alpha == 0.1
    assert settings["soft"].tau == settings["soft_token"].tau == 3.0
    assert settings["hard"].alpha == settings["hard_token"].alpha == 0.5
    assert settings["none"].alpha == 0.0
    loss = paper_loss(ls_base(), "soft")
    assert (loss.alpha, loss.tau, loss.kl_normalization) == (0.1, 3.0, "elements")


def test_none_is_label_smoothed_ce(batch: dict[str, torch.Tensor]) -> None:
    got = paper_loss(ls_base(), "none")(batch["cls"], None, batch["y"])
    assert got.item() == pytest.approx(hand_ce(batch["cls"], smoothed(batch["y"], K, EPS)), rel=1e-9)


@pytest.mark.parametrize("normalization,denom", [("elements", B * K), ("batch", B)])
def test_soft_formula_tau_squared_and_normalization(
    batch: dict[str, torch.Tensor], normalization: str, denom: int
) -> None:
    cls, t, y = batch["cls"], batch["teacher"], batch["y"]
    tau, alpha = 3.0, 0.1
    got = DistillationLoss(ls_base(), "soft", alpha, tau, normalization)(cls, t, y)
    kl = hand_kl_sum(t, cls, tau) / denom
    want = (1 - alpha) * hand_ce(cls, smoothed(y, K, EPS)) + alpha * tau**2 * kl
    assert got.item() == pytest.approx(want, rel=1e-6)
    # Without the tau^2 factor the value would differ (tau = 3, so by a lot).
    assert got.item() != pytest.approx((1 - alpha) * hand_ce(cls, smoothed(y, K, EPS)) + alpha * kl, rel=1e-3)


def test_soft_normalizations_differ_by_k(batch: dict[str, torch.Tensor]) -> None:
    args = (batch["cls"], batch["teacher"], batch["y"])
    base = paper_loss(ls_base(), "none")(*args).item()
    elem = DistillationLoss(ls_base(), "soft", 1.0, 3.0, "elements")(*args).item()
    per_image = DistillationLoss(ls_base(), "soft", 1.0, 3.0, "batch")(*args).item()
    assert base > 0
    assert per_image == pytest.approx(K * elem, rel=1e-6)


def test_kl_direction_is_teacher_to_student(batch: dict[str, torch.Tensor]) -> None:
    cls, t, y = batch["cls"], batch["teacher"], batch["y"]
    tau = 3.0
    got = DistillationLoss(ls_base(), "soft", 1.0, tau, "batch")(cls, t, y).item()
    forward = tau**2 * hand_kl_sum(t, cls, tau) / B  # KL(teacher || student)
    reverse = tau**2 * hand_kl_sum(cls, t, tau) / B  # KL(student || teacher)
    assert got == pytest.approx(forward, rel=1e-6)
    assert abs(forward - reverse) > 1e-3
    assert got != pytest.approx(reverse, rel=1e-3)


def test_hard_uses_class_head_and_unsmoothed_teacher_label(batch: dict[str, torch.Tensor]) -> None:
    cls, t, y = batch["cls"], batch["teacher"], batch["y"]
    got = paper_loss(ls_base(), "hard")(cls, t, y).item()
    yt = teacher_labels(t)
    want = 0.5 * hand_ce(cls, smoothed(y, K, EPS)) + 0.5 * hand_ce(cls, one_hot_rows(yt, K))
    assert got == pytest.approx(want, rel=1e-9)
    smoothed_teacher = 0.5 * hand_ce(cls, smoothed(y, K, EPS)) + 0.5 * hand_ce(cls, smoothed(yt, K, EPS))
    assert got != pytest.approx(smoothed_teacher, rel=1e-4)


def test_hard_token_splits_heads(batch: dict[str, torch.Tensor]) -> None:
    cls = batch["cls"].clone().requires_grad_(True)
    dist = batch["dist"].clone().requires_grad_(True)
    t, y = batch["teacher"], batch["y"]
    loss = paper_loss(ls_base(), "hard_token")((cls, dist), t, y)
    yt = teacher_labels(t)
    want = 0.5 * hand_ce(batch["cls"], smoothed(y, K, EPS))
    want += 0.5 * hand_ce(batch["dist"], one_hot_rows(yt, K))
    assert loss.item() == pytest.approx(want, rel=1e-9)
    loss.backward()
    # d/dz of 0.5 * mean CE: 0.5 * (softmax - target) / B, per head with its own target.
    p_cls, p_dist = batch["cls"].softmax(-1), batch["dist"].softmax(-1)
    want_cls = 0.5 * (p_cls - torch.tensor(smoothed(y, K, EPS), dtype=torch.float64)) / B
    want_dist = 0.5 * (p_dist - torch.tensor(one_hot_rows(yt, K), dtype=torch.float64)) / B
    torch.testing.assert_close(cls.grad, want_cls)
    torch.testing.assert_close(dist.grad, want_dist)


@pytest.mark.parametrize("normalization,denom", [("elements", B * K), ("batch", B)])
def test_soft_token_puts_kl_on_dist_head(batch: dict[str, torch.Tensor], normalization: str, denom: int):
    cls, dist, t, y = batch["cls"], batch["dist"], batch["teacher"], batch["y"]
    got = paper_loss(ls_base(), "soft_token", kl_normalization=normalization)((cls, dist), t, y).item()
    want = 0.9 * hand_ce(cls, smoothed(y, K, EPS)) + 0.1 * 9.0 * hand_kl_sum(t, dist, 3.0) / denom
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("kind", ["soft", "hard", "hard_token", "soft_token"])
def test_mixup_soft_targets(batch: dict[str, torch.Tensor], kind: str) -> None:
    cls, dist, t, y = batch["cls"], batch["dist"], batch["teacher"], batch["y"]
    targets = mixup_target(y, K, lam=0.7, smoothing=EPS).double()  # what timm's Mixup hands the loss
    rows = targets.tolist()
    # timm's mixed targets carry the smoothing already: check one row by hand.
    assert rows[0][0] == pytest.approx(0.7 * (0.9 + 0.02) + 0.3 * 0.02)
    outputs = (cls, dist) if kind.endswith("_token") else cls
    kd = dist if kind.endswith("_token") else cls
    got = paper_loss(SoftTargetCrossEntropy(), kind)(outputs, t, targets).item()
    if kind.startswith("soft"):
        want = 0.9 * hand_ce(cls, rows) + 0.1 * 9.0 * hand_kl_sum(t, kd, 3.0) / (B * K)
    else:
        want = 0.5 * hand_ce(cls, rows) + 0.5 * hand_ce(kd, one_hot_rows(teacher_labels(t), K))
    assert got == pytest.approx(want, rel=1e-6)


def test_token_kind_without_dist_head_is_a_clear_error(batch: dict[str, torch.Tensor]) -> None:
    for kind in ("hard_token", "soft_token"):
        with pytest.raises(ConfigError) as err:
            paper_loss(ls_base(), kind)(batch["cls"], batch["teacher"], batch["y"])
        assert "_distilled_" in str(err.value) and "set_distilled_training(True)" in str(err.value)


def test_non_token_kind_with_tuple_uses_class_head(batch: dict[str, torch.Tensor]) -> None:
    for kind in ("none", "soft", "hard"):
        crit = paper_loss(ls_base(), kind)
        pair = crit((batch["cls"], batch["dist"]), batch["teacher"], batch["y"])
        single = crit(batch["cls"], batch["teacher"], batch["y"])
        assert pair.item() == pytest.approx(single.item(), rel=1e-12)


def test_bad_settings_are_clear_errors(batch: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="'sotf' is not a valid DistillKind"):
        DistillationLoss(ls_base(), "sotf", 0.5, 1.0)
    with pytest.raises(ValueError, match="'mean' is not a valid KLNormalization"):
        paper_loss(ls_base(), "soft", kl_normalization="mean")
    with pytest.raises(ValueError, match="needs the teacher's logits"):
        paper_loss(ls_base(), "hard")(batch["cls"], None, batch["y"])
    with pytest.raises(ValueError, match="same classes"):
        paper_loss(ls_base(), "hard")(batch["cls"], batch["teacher"][:, :3], batch["y"])


# ---------------------------------------------------------------- fusion


def test_fusion_rules_can_disagree() -> None:
    # Class head: very sure of class 0. Distillation head: rules out class 0 hard, mildly prefers class 1.
    cls = torch.tensor([[10.0, 0.0, 0.0]])
    dist = torch.tensor([[-20.0, 3.0, 0.0]])
    prob = fuse_predictions(cls, dist, "prob")
    logit = fuse_predictions(cls, dist, "logit")
    # Paper: mean of probabilities ~ [0.500, 0.476, 0.024] -> class 0.
    # Code: mean of logits [-5, 1.5, 0] -> class 1.
    p_cls = [math.exp(v) / sum(math.exp(u) for u in cls[0].tolist()) for v in cls[0].tolist()]
    p_dist = [math.exp(v) / sum(math.exp(u) for u in dist[0].tolist()) for v in dist[0].tolist()]
    hand = [(a + b) / 2 for a, b in zip(p_cls, p_dist, strict=True)]
    torch.testing.assert_close(prob[0], torch.tensor(hand))
    torch.testing.assert_close(logit, torch.tensor([[-5.0, 1.5, 0.0]]))
    assert prob.argmax(-1).item() == 0
    assert logit.argmax(-1).item() == 1
    assert prob.sum().item() == pytest.approx(1.0)

    out = distilled_eval_outputs(cls, dist, rule="prob")
    assert set(out) == {"cls", "dist", "fused", "fused_alt"}
    assert out["fused"].argmax(-1).item() == 0 and out["fused_alt"].argmax(-1).item() == 1
    assert out["cls"].argmax(-1).item() == 0 and out["dist"].argmax(-1).item() == 1
    swapped = distilled_eval_outputs(cls, dist, rule="logit")
    torch.testing.assert_close(swapped["fused"], out["fused_alt"])
    with pytest.raises(ValueError, match="'max' is not a valid FusionRule"):
        fuse_predictions(cls, dist, "max")


class _HandHeads(torch.nn.Module):
    """A stand-in distilled ViT whose 'images' are its two heads' logits: tokens[:, 0] -> head, [:, 1] -> head_dist."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.head_dist = torch.nn.Identity(), torch.nn.Identity()

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return images


def test_evaluation_scores_both_fusions_in_one_pass_as_defined():
    # Four images, three classes, the heads' logits by hand. Softmax sum (the DeiT paper) and logit mean (the
    # released code, timm) rank image 0 apart: sure class head vs a distillation head ruling class 0 out.
    cls = torch.tensor([[10.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    dist = torch.tensor([[-20.0, 3.0, 0.0], [0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    targets = torch.tensor([0, 1, 0, 1])

    def softmax(row: list[float]) -> list[float]:
        total = sum(math.exp(v) for v in row)
        return [math.exp(v) / total for v in row]

    def argmax(row: list[float]) -> int:
        return max(range(len(row)), key=row.__getitem__)

    by_prob = [argmax([a + b for a, b in zip(softmax(c), softmax(d), strict=True)])
               for c, d in zip(cls.tolist(), dist.tolist(), strict=True)]
    by_logit = [argmax([(a + b) / 2 for a, b in zip(c, d, strict=True)])
                for c, d in zip(cls.tolist(), dist.tolist(), strict=True)]
    assert (by_prob, by_logit) == ([0, 1, 0, 1], [1, 1, 0, 1])  # the rules disagree on image 0 alone
    loader = [(torch.stack([cls, dist], dim=1), targets)]
    for rule, ours, other in (("prob", 100.0, 75.0), ("logit", 75.0, 100.0)):
        metrics = evaluate(_HandHeads(), loader, DistInfo(), fusion=rule)
        assert (metrics["top1"], metrics["top1_fused_alt"]) == (ours, other), rule
        assert (metrics["top1_cls"], metrics["top1_dist"]) == (50.0, 75.0)
        final = summarize("finished", metrics, {}, ours, 1, 1, 1.0)
        named = fusion_figures(final, rule)
        assert (named["fusion"], named["top1_fusion_prob"], named["top1_fusion_logit"]) == (rule, 100.0, 75.0)


def tiny_deit(img_size: int = 32, distilled: bool = True) -> torch.nn.Module:
    """A one-block DeiT small enough for unit tests."""
    name = "deit_tiny_distilled_patch16_224" if distilled else "deit_tiny_patch16_224"
    kw = dict(img_size=img_size, patch_size=4, embed_dim=48, depth=1, num_heads=3, num_classes=5)
    return timm.create_model(name, pretrained=False, **kw)


def test_distilled_head_logits_match_timm_eval_average() -> None:
    torch.manual_seed(0)
    model = tiny_deit().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        cls, dist = distilled_head_logits(model, x)
        torch.testing.assert_close(fuse_predictions(cls, dist, "logit"), model(x))
        model.train()
        model.set_distilled_training(True)
        model.head_drop.p = 0.0
        pair = model(x)
    torch.testing.assert_close(pair[0], cls)
    torch.testing.assert_close(pair[1], dist)
    with pytest.raises(ValueError, match="no distillation head"):
        distilled_head_logits(tiny_deit(distilled=False), x)


# ---------------------------------------------------------------- teacher


def tiny_cnn(num_classes: int = 5) -> torch.nn.Module:
    """timm's smallest ResNet."""
    torch.manual_seed(0)
    return timm.create_model("test_resnet", pretrained=False, num_classes=num_classes).eval()


@pytest.mark.parametrize("layout", ["model", "state_dict_ddp", "bare", "safetensors"])
def test_load_teacher_layouts(tmp_path, layout: str) -> None:
    src = tiny_cnn()
    sd = src.state_dict()
    if layout == "model":
        path = tmp_path / "t.pth"
        torch.save({"model": sd, "epoch": 3}, path)
    elif layout == "state_dict_ddp":
        path = tmp_path / "t.pth"
        torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}}, path)
    elif layout == "bare":
        path = tmp_path / "t.pth"
        torch.save(sd, path)
    else:
        path = tmp_path / "t.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    teacher = load_teacher("test_resnet", path, num_classes=5)
    assert not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), src(x))


def test_teacher_forward_no_grad_float32_eval(tmp_path) -> None:
    path = tmp_path / "t.pth"
    torch.save(tiny_cnn().state_dict(), path)
    teacher = load_teacher("test_resnet", str(path), num_classes=5)
    teacher.train()  # something flipped it; teacher_forward must still run it in eval mode
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    out = teacher_forward(teacher, x)
    assert out.dtype == torch.float32 and out.shape == (2, 5)
    assert not out.requires_grad and not teacher.training


@pytest.mark.parametrize("checkpoint", [None, "", "  "])
def test_unset_checkpoint_message(checkpoint) -> None:
    with pytest.raises(TeacherLoadError) as err:
        load_teacher("test_resnet", checkpoint, num_classes=5)
    assert isinstance(err.value, ConfigError)  # the project's one bad-input error type
    msg = str(err.value)
    assert "distill.teacher.checkpoint is not set" in msg
    assert "python train.py model=<cnn>" in msg


def test_missing_file_message(tmp_path) -> None:
    path = tmp_path / "nope" / "teacher.pth"
    with pytest.raises(TeacherLoadError) as err:
        load_teacher("test_resnet", path, num_classes=5)
    assert str(path) in str(err.value) and "does not exist" in str(err.value)


def test_wrong_class_count_is_caught_before_building(tmp_path, monkeypatch) -> None:
    path = tmp_path / "t.pth"
    torch.save({"model": tiny_cnn(num_classes=5).state_dict()}, path)

    def must_not_build(*args, **kwargs):
        raise AssertionError("create_model called before the head check")

    monkeypatch.setattr(teacher_module.timm, "create_model", must_not_build)
    with pytest.raises(TeacherLoadError) as err:
        load_teacher("test_resnet", path, num_classes=7)
    msg = str(err.value)
    assert "5-class head" in msg and "7 classes" in msg and "fc.weight" in msg


def test_missing_and_unexpected_keys_are_named(tmp_path) -> None:
    sd = tiny_cnn().state_dict()
    removed = "layer1.0.conv1.weight"
    assert removed in sd
    del sd[removed]
    sd["extra.bias"] = torch.zeros(3)
    path = tmp_path / "t.pth"
    torch.save(sd, path)
    with pytest.raises(TeacherLoadError) as err:
        load_teacher("test_resnet", path, num_classes=5)
    msg = str(err.value)
    assert "missing keys: " + removed in msg
    assert "unexpected keys: extra.bias" in msg
    assert "distill.teacher.model" in msg


def test_unrecognized_layout_message(tmp_path) -> None:
    path = tmp_path / "t.pth"
    torch.save({"weights": {"a": 1}, "epoch": 2}, path)
    with pytest.raises(ConfigError, match="not a recognised checkpoint layout"):
        load_teacher("test_resnet", path, num_classes=5)


# ---------------------------------------------------------------- position embeddings


@pytest.mark.parametrize("distilled,prefix", [(True, 2), (False, 1)])
def test_resize_pos_embed_keeps_prefix_rows(distilled: bool, prefix: int) -> None:
    torch.manual_seed(0)
    src = tiny_deit(32, distilled)  # 8 x 8 grid
    dst = tiny_deit(48, distilled)  # 12 x 12 grid
    assert dst.num_prefix_tokens == prefix
    state = src.state_dict()
    before = state["pos_embed"].clone()
    out = resize_pos_embed_state(state, dst)
    pe = out["pos_embed"]
    assert pe.shape == (1, prefix + 12 * 12, 48) == dst.pos_embed.shape
    assert torch.equal(pe[:, :prefix], before[:, :prefix])
    assert torch.equal(state["pos_embed"], before)  # input untouched
    # The patch rows are the 8 x 8 grid, resized bicubically to 12 x 12, in raster order.
    grid = before[:, prefix:].reshape(1, 8, 8, 48).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(12, 12), mode="bicubic", align_corners=False)
    torch.testing.assert_close(pe[:, prefix:], want.permute(0, 2, 3, 1).reshape(1, 144, 48))
    dst.load_state_dict(out, strict=True)
    assert dst(torch.randn(1, 3, 48, 48)).shape == (1, 5)


def test_resize_pos_embed_same_shape_and_family_mismatch() -> None:
    model = tiny_deit(32)
    state = model.state_dict()
    assert resize_pos_embed_state(state, model)["pos_embed"] is state["pos_embed"]
    plain = tiny_deit(32, distilled=False).state_dict()  # 1 + 64 rows into a model with 2 prefix rows
    with pytest.raises(ValueError, match="prefix tokens"):
        resize_pos_embed_state(plain, tiny_deit(48))


def test_teacher_kwargs_timm_refuses_stop_the_launch(tmp_path) -> None:
    """distill.teacher.kwargs are built on meta before anything is written (they failed at the run's start, after
    its folder, log and wandb run were made)."""
    from deit_ablate.run.validate import validate_config

    path = tmp_path / "teacher.pth"
    torch.save({"model": tiny_cnn(num_classes=10).state_dict()}, path)
    teacher = ["distill=hard", "distill.teacher.model=test_resnet", f"distill.teacher.checkpoint={path}"]
    validate_config(compose_config(teacher))  # the teacher as it was trained: accepted
    with pytest.raises(ConfigError, match=r"the teacher test_resnet cannot be built with "
                                          r"distill.teacher.kwargs.no_such_argument=1: timm refuses them \(TypeError"):
        validate_config(compose_config([*teacher, "+distill.teacher.kwargs.no_such_argument=1"]))
