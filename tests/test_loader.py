"""The training DataLoader's workers: their CPU priority (runtime.worker_nice) and its validation."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import Dataset, SequentialSampler

from deit_ablate.core.errors import ConfigError
from deit_ablate.data.loader import build_loader
from deit_ablate.run.validate import validate_config
from tests.conftest import compose_config


class Niceness(Dataset):
    """Each item is the niceness of the process that loads it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(os.nice(0))


def _loaded_niceness(overrides: list[str]) -> set[int]:
    cfg = compose_config(overrides)
    dataset = Niceness()
    pairs = [(index, 0) for index in SequentialSampler(dataset)]  # a training loader's items: (index, seed)
    loader = build_loader(dataset, pairs, 2, cfg.runtime, train=True)
    return {int(value) for batch in loader for value in batch}


def test_workers_run_at_lower_priority_than_the_training_process():
    own = os.nice(0)
    assert _loaded_niceness(["runtime.num_workers=2"]) == {min(own + 19, 19)}
    assert _loaded_niceness(["runtime.num_workers=2", "runtime.worker_nice=5"]) == {min(own + 5, 19)}
    assert _loaded_niceness(["runtime.num_workers=2", "runtime.worker_nice=0"]) == {own}
    assert _loaded_niceness(["runtime.num_workers=0"]) == {own}  # no workers: the training process is left alone
    assert os.nice(0) == own


@pytest.mark.parametrize("value", [-1, 20])
def test_a_niceness_outside_0_to_19_is_a_config_error(value):
    with pytest.raises(ConfigError, match=rf"runtime.worker_nice={value} must be in \[0, 19\]: it is added"):
        validate_config(compose_config([f"runtime.worker_nice={value}"]))
