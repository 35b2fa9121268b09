"""The global batch as the recipe's virtual slots: micro-batches dealt over processes and accumulation steps."""

from __future__ import annotations

import pytest

from deit_ablate.core.errors import ConfigError
from deit_ablate.run.validate import micro_batch_split, plan_batch, validate_config
from tests.conftest import compose_config


@pytest.mark.parametrize(("world", "per_rank", "accum"), [(1, 1024, 8), (2, 512, 4), (4, 256, 2), (8, 128, 1)])
def test_the_paper_batch_is_eight_micro_batches_of_128_on_any_layout(world, per_rank, accum):
    plan = plan_batch(compose_config(["preset=paper"]), world)
    assert (plan.slots, plan.micro_batch, plan.per_rank_batch, plan.accum_steps) == (8, 128, per_rank, accum)
    assert plan.slots_of(world - 1)[-1] == 7  # every slot is some process's
    assert sorted(s for rank in range(world) for s in plan.slots_of(rank)) == list(range(8))


def test_the_device_cap_changes_nothing_computed_when_the_micro_batch_fits():
    plans = {cap: plan_batch(compose_config(["preset=paper", f"runtime.max_batch_per_device={cap}"]), 1)
             for cap in (128, 512, 4096)}
    assert len(set(plans.values())) == 1  # the micro-batch is the recipe's, not the hardware's


def test_a_layout_that_cannot_hold_a_micro_batch_is_refused_naming_both_keys():
    cfg = compose_config(["preset=paper", "runtime.max_batch_per_device=64"])
    with pytest.raises(ConfigError) as error:
        micro_batch_split(cfg)
    message = str(error.value)
    assert "runtime.max_batch_per_device=64" in message and "train.micro_batch=128" in message
    assert "Mixup/CutMix" in message and "BatchNorm" not in message  # a ViT has none
    assert len(message.splitlines()) == 1


def test_splitting_is_allowed_when_exactly_equivalent():
    # no Mixup/CutMix, no SAM, no drop path or dropout, no BatchNorm: a micro-batch's loss is the mean of its halves
    cfg = compose_config(["preset=paper", "runtime.max_batch_per_device=64", "mix=none", "model.drop_path=0"])
    assert micro_batch_split(cfg) == (128, 2)
    plan = plan_batch(cfg, 2)
    assert (plan.accum_steps, plan.split, plan.pass_batch) == (4, 2, 64)


def test_a_batchnorm_model_is_never_split():
    cfg = compose_config(["model=cnn_demo", "mix=none", "model.drop_path=0", "runtime.max_batch_per_device=16"])
    with pytest.raises(ConfigError, match="BatchNorm normalises over the micro-batch"):
        micro_batch_split(cfg)


def test_more_processes_than_slots_is_refused_with_the_layouts_that_work():
    with pytest.raises(ConfigError) as error:
        plan_batch(compose_config(["preset=paper"]), 16)
    message = str(error.value)
    assert "8 micro-batches of train.micro_batch=128" in message and "16 processes" in message
    assert "run 8 process(es)" in message


def test_a_global_batch_that_is_no_whole_number_of_micro_batches_is_refused():
    with pytest.raises(ConfigError, match=r"train.global_batch=1000 is not a whole number of micro-batches of "
                                          r"train.micro_batch=128.*e\.g\. 125"):
        micro_batch_split(compose_config(["preset=paper", "train.global_batch=1000"]))


def test_an_odd_micro_batch_with_mixup_is_refused_before_the_run():
    # issue 39's `train.global_batch=6 runtime.max_batch_per_device=3`: refused by the config check
    with pytest.raises(ConfigError, match="train.global_batch=6 is not a whole number"):
        validate_config(compose_config(["train.global_batch=6", "runtime.max_batch_per_device=3"]))
    with pytest.raises(ConfigError, match="pairs the images of a micro-batch"):
        validate_config(compose_config(["train.global_batch=6", "train.micro_batch=3"]))


def test_each_stage_has_its_own_micro_batch():
    finetune = plan_batch(compose_config(["preset=paper", "stage=finetune", "data.root=/x"]), 16)
    assert (finetune.micro_batch, finetune.slots, finetune.per_rank_batch) == (32, 16, 32)  # 32 x 16 GPUs
    demo = plan_batch(compose_config([]), 1)
    assert (demo.micro_batch, demo.slots, demo.accum_steps) == (32, 4, 4)
