"""The lr schedule a run trains: timm's schedule optimizer.sched names (cosine, step, none), moved per update or as the
released DeiT main.py moves it (optimizer.sched_on=epoch: `lr_scheduler.step(epoch)` after each epoch)."""

from __future__ import annotations

import pytest
import torch
from conftest import lr_trace
from timm.scheduler import CosineLRScheduler, StepLRScheduler

from deit_ablate.config.compose import compose_run_config
from deit_ablate.record.identity import experiment_digest
from deit_ablate.run.stages import stage_recipe
from deit_ablate.train.optim import scaled_lr
from tests.conftest import compose_config

DEMO_STEPS = 38  # the demo's updates per epoch (its log: "step 38/38")
FINETUNE = ["stage=finetune", "finetune.init_checkpoint=/pretrained.pt"]  # no pre-training run needed to compose


def _trace(cfg, steps_per_epoch: int = DEMO_STEPS) -> tuple[float, list[float]]:
    """(peak lr, the lr of every update) of the stage `cfg` describes (conftest.lr_trace)."""
    return lr_trace(cfg, steps_per_epoch)


def _released(cfg, scheduler_of, steps_per_epoch: int = DEMO_STEPS) -> list[float]:
    """The lr of every update as the released main.py sets it: timm's scheduler in epochs, `step(epoch)` after each
    epoch's updates (`scheduler_of(optimizer)` builds it as timm 0.3.2's create_scheduler did)."""
    recipe = stage_recipe(cfg)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))],
                                  lr=scaled_lr(recipe.lr, recipe.global_batch, recipe.lr_base_batch))
    scheduler = scheduler_of(optimizer, recipe)
    lrs = []
    for epoch in range(recipe.epochs):
        lrs += [optimizer.param_groups[0]["lr"]] * steps_per_epoch
        scheduler.step(epoch)
    return lrs


def _cosine(optimizer, recipe):
    return CosineLRScheduler(optimizer, t_initial=recipe.epochs, lr_min=recipe.min_lr, warmup_t=recipe.warmup_epochs,
                             warmup_lr_init=recipe.warmup_lr, warmup_prefix=False)


def test_epoch_stepping_is_the_released_main_py_on_the_demo():
    # facebookresearch/deit main.py: lr_scheduler.step(epoch) after train_one_epoch, so epoch e > 0 trains at
    # lr(e - 1): the demo's first two epochs (76 updates) both at the warm-up lr 1e-6
    cfg = compose_config(["optimizer.sched_on=epoch"])
    _, lrs = _trace(cfg)
    assert lrs == pytest.approx(_released(cfg, _cosine), rel=1e-12)
    assert lrs[: 2 * DEMO_STEPS] == [pytest.approx(1e-6)] * (2 * DEMO_STEPS) and lrs[2 * DEMO_STEPS] > 1e-6
    _, ours = _trace(compose_config([]))
    assert ours[DEMO_STEPS] > 0.9e-3  # per update: the warm-up is over after the first epoch (peak 1e-3)


def test_epoch_stepping_of_a_fine_tune_lags_its_warm_up_by_an_epoch():
    # the paper preset's fine-tune: 5 warm-up epochs of 30 from 1e-6 to 5e-6, flat after; per epoch, epoch 5 still
    # trains at lr(4), one warm-up step below the peak, and epochs 0 and 1 at 1e-6
    cfg = compose_config(["preset=paper", *FINETUNE, "optimizer.sched_on=epoch"])
    peak, lrs = _trace(cfg, steps_per_epoch=3)
    assert lrs == pytest.approx(_released(cfg, _cosine, steps_per_epoch=3), rel=1e-12)
    per_epoch = lrs[::3]
    assert per_epoch[:2] == [pytest.approx(1e-6)] * 2
    assert per_epoch[5] == pytest.approx(1e-6 + 4 * (peak - 1e-6) / 5) and per_epoch[6] == pytest.approx(peak)


@pytest.mark.parametrize("sched_on", ["update", "epoch"])
def test_sched_step_runs_timms_step_schedule(sched_on):
    cfg = compose_config(["optimizer.sched=step", "optimizer.decay_epochs=3", "optimizer.decay_rate=0.5",
                          f"optimizer.sched_on={sched_on}"])
    peak, lrs = _trace(cfg)
    if sched_on == "epoch":
        def step(optimizer, recipe):
            return StepLRScheduler(optimizer, decay_t=3, decay_rate=0.5, warmup_t=recipe.warmup_epochs,
                                   warmup_lr_init=recipe.warmup_lr, warmup_prefix=False)
        assert lrs == pytest.approx(_released(cfg, step), rel=1e-12)
    else:
        assert lrs[DEMO_STEPS] == pytest.approx(peak)  # after one warm-up epoch, the peak until epoch 3
        assert lrs[3 * DEMO_STEPS] == pytest.approx(peak / 2) and lrs[-1] == pytest.approx(peak / 8)
    assert lrs != _trace(compose_config([f"optimizer.sched_on={sched_on}"]))[1]  # not the cosine


def test_sched_none_trains_at_the_peak_lr_throughout():
    peak, lrs = _trace(compose_config(["optimizer.sched=none"]))
    assert lrs == [pytest.approx(peak)] * len(lrs)


def test_the_schedule_keys_are_the_experiment_and_the_default_keeps_old_identities():
    default = experiment_digest(compose_run_config([]))
    assert experiment_digest(compose_run_config(["optimizer.sched_on=update", "optimizer.decay_epochs=30"])) == default
    assert experiment_digest(compose_run_config(["optimizer.sched_on=epoch"])) != default
    assert experiment_digest(compose_run_config(["optimizer.sched=step"])) != default
    # keys the schedule does not read: the step schedule's decay under cosine, the warm-up without a schedule
    assert experiment_digest(compose_run_config(["optimizer.decay_rate=0.5"])) == default
    none = experiment_digest(compose_run_config(["optimizer.sched=none"]))
    assert experiment_digest(compose_run_config(["optimizer.sched=none", "optimizer.warmup_epochs=2",
                                                 "optimizer.sched_on=epoch"])) == none


@pytest.mark.parametrize("value", ["foo", "'cosine  ü'"])
def test_an_unknown_schedule_is_refused_at_composition_naming_the_choices(value):
    # before the key was read, `optimizer.sched=step`, `none` or any text trained the default cosine
    with pytest.raises(Exception) as refused:
        compose_run_config([f"optimizer.sched={value}"])
    error, messages = refused.value, []
    while error is not None:
        messages.append(str(error))
        error = error.__cause__
    text = "\n".join(messages)
    assert "expected one of [cosine, step, none]" in text and "optimizer.sched" in text


@pytest.mark.parametrize("preset", ["demo", "paper"])
def test_the_schedule_keys_print_in_the_resolved_job(preset):
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "train.py"), f"preset={preset}", "--cfg", "job", "--resolve"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "  sched: cosine\n  sched_on: update\n  decay_epochs: 30.0\n  decay_rate: 0.1\n" in out
    assert "  eval_max_images: null\n" in out


def test_the_released_per_gpu_batches_are_one_override_away():
    # the paper preset: 8 GPUs x 128 (DeiT-B on one 8-GPU node); the README of facebookresearch/deit trains DeiT-B on
    # 2 nodes x 8 GPUs x 64 and DeiT-S/Ti on 4 GPUs x 256, each the same global batch of 1024
    from deit_ablate.run.validate import plan_batch

    paper = plan_batch(compose_config(["preset=paper"]), world_size=8)
    assert (paper.micro_batch, paper.slots, paper.per_rank_batch) == (128, 8, 128)
    base = compose_config(["preset=paper", "train.micro_batch=64"])
    assert (plan_batch(base, 16).per_rank_batch, plan_batch(base, 16).slots) == (64, 16)
    assert (plan_batch(base, 1).accum_steps, plan_batch(base, 1).micro_batch) == (16, 64)
    small = plan_batch(compose_config(["preset=paper", "headline=deit_s", "train.micro_batch=256",
                                       "runtime.max_batch_per_device=256"]), world_size=4)  # where it fits
    assert (small.per_rank_batch, small.slots) == (256, 4)
