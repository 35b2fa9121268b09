"""The host's share of a step (issue 53, point 2): our Mixup gives timm's pixels and targets from the same draws
without allocating the flipped batch each step, and the host-step bench runs both sides on the stand-in."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from timm.data import Mixup

from deit_ablate.bench import host_step
from deit_ablate.train.losses import ReusedBufferMixup, build_mixup
from tests.conftest import compose_config


def test_the_mixup_of_a_run_is_timms_pixel_for_pixel_with_one_buffer_kept():
    cfg = compose_config([])
    ours = build_mixup(cfg.mix, 10)
    assert isinstance(ours, ReusedBufferMixup)
    kwargs = dict(mixup_alpha=cfg.mix.mixup_alpha, cutmix_alpha=cfg.mix.cutmix_alpha, prob=cfg.mix.prob,
                  switch_prob=cfg.mix.switch_prob, mode=cfg.mix.mode, label_smoothing=cfg.mix.label_smoothing,
                  num_classes=10)
    images, labels = torch.rand(8, 3, 24, 24), torch.arange(8)  # no sample shares its flipped partner's label
    lams = set()
    for seed in range(16):  # Mixup and CutMix both drawn, as np.random decides
        np.random.seed(seed)
        expected, expected_targets = Mixup(**kwargs)(images.clone(), labels)
        np.random.seed(seed)
        mixed, targets = ours(images.clone(), labels)
        assert torch.equal(mixed, expected) and torch.equal(targets, expected_targets), seed
        lams.add(round(float(targets.max()), 3))
    buffer = ours._scratch
    ours(images.clone(), labels)
    assert ours._scratch is buffer and len(lams) > 4  # kept across steps; the draws varied


def test_both_sides_of_the_host_step_run_on_the_stand_in(data_cache):
    setup, ours = host_step.ours(host_step.host_overrides(str(data_cache / "builtin"), 8, 32))
    extra, timms = host_step.timms(setup)
    assert setup.trainer.module(setup.images()).shape == (8, 10)
    before = setup.trainer.step
    ms = host_step.alternate({"ours": ours, "timm": timms}, steps=2, pairs=1, warmup=1)
    assert setup.trainer.step == before + 3 and all(len(v) == 1 and v[0] > 0 for v in ms.values())
    assert extra["mixup_collate_s_per_batch_in_a_worker"] > 0


def test_each_timed_run_drains_the_device_and_both_sides_run_on_the_setups_device(data_cache):
    """On a GPU the figure is the host's time only if the queued kernels are waited for: synchronize (a no-op on the
    CPU, torch.cuda.synchronize on a GPU) before and after every timed run of either side."""
    assert "runtime.device=cuda" in host_step.host_overrides("root", 8, 32, "cuda")
    setup, ours = host_step.ours(host_step.host_overrides(str(data_cache / "builtin"), 8, 32), torch.device("cpu"))
    _, timms = host_step.timms(setup)
    calls = []
    setup.calls = dataclasses.replace(setup.calls, synchronize=lambda: calls.append("synchronize"))
    host_step.alternate({"ours": ours, "timm": timms}, steps=1, pairs=1, warmup=1)
    assert calls == ["synchronize"] * 8  # warm-up and one pair, each side: before and after
    assert setup.pixels.device == setup.device == next(setup.trainer.module.parameters()).device
