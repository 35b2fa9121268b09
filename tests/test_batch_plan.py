"""Splitting the global batch over processes and accumulation steps."""

from __future__ import annotations

import pytest

from deit_ablate.errors import ConfigError
from deit_ablate.validate import plan_batch
from tests.conftest import compose_config


@pytest.mark.parametrize(("world", "cap", "per_rank", "accum"), [
    (1, 128, 1024, 8), (8, 128, 128, 1), (16, 128, 64, 1), (4, 100, 256, 4), (2, 96, 512, 8),
])
def test_global_batch_is_split_per_rank_then_accumulated(world, cap, per_rank, accum):
    cfg = compose_config(["preset=paper", f"runtime.max_batch_per_device={cap}"])
    plan = plan_batch(cfg, world)
    assert (plan.per_rank_batch, plan.accum_steps) == (per_rank, accum)
    assert plan.micro_batch * plan.accum_steps * world == 1024
    assert plan.micro_batch <= cap


def test_a_batch_that_cannot_be_split_names_the_numbers_and_the_fix():
    cfg = compose_config(["preset=paper", "train.global_batch=1000"])
    with pytest.raises(ConfigError) as error:
        plan_batch(cfg, 3)
    message = str(error.value)
    assert "train.global_batch=1000 cannot be split over 3 processes" in message and "multiple of 3" in message
