"""The training DataLoader's workers: their CPU priority (runtime.worker_nice) and its validation."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import Dataset, SequentialSampler

from deit_ablate.core.errors import ConfigError
from deit_ablate.data.loader import build_loader, build_train_loader, end_workers, worker_niceness
from deit_ablate.data.transforms import TransformSpec
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
    keys = [(index, 0, 0) for index in SequentialSampler(dataset)]  # a training loader's keys: (index, seeds)
    loader = build_loader(dataset, keys, 2, cfg.runtime, train=True)
    return {int(value) for batch in loader for value in batch}


def test_workers_run_at_the_configured_niceness():
    own = os.nice(0)
    assert _loaded_niceness(["runtime.num_workers=2", "runtime.worker_nice=19"]) == {min(own + 19, 19)}
    assert _loaded_niceness(["runtime.num_workers=2", "runtime.worker_nice=5"]) == {min(own + 5, 19)}
    assert _loaded_niceness(["runtime.num_workers=2", "runtime.worker_nice=0"]) == {own}
    assert _loaded_niceness(["runtime.num_workers=0", "runtime.worker_nice=19"]) == {own}  # no workers: left alone
    assert os.nice(0) == own


@pytest.mark.parametrize(("size", "device", "expected"), [(32, "cpu", 19), (64, "cpu", 19), (96, "cpu", 0),
                                                          (224, "cpu", 0), (32, "cuda", 0), (224, "cuda", 0)])
def test_unset_niceness_yields_the_cores_only_where_the_training_step_limits_the_run(size, device, expected):
    assert worker_niceness(None, device, size) == expected
    assert worker_niceness(7, device, size) == 7  # a set value is kept everywhere


@pytest.mark.parametrize(("resolution", "expected"), [("32px", 19), ("224px", 0)])
def test_a_runs_training_workers_take_the_niceness_of_its_image_size(resolution, expected):
    """The demo at 32 px keeps its workers behind the step (1.13x, docs/PERFORMANCE.md); at 224 px they
    decode JPEGs and limit the run, and at niceness 19 any other process on the machine took their cores (the
    first epoch 8x slower on a shared 2-core machine, section 11)."""
    cfg = compose_config(["runtime.num_workers=2", f"resolution={resolution}"])
    assert cfg.runtime.worker_nice is None
    spec = TransformSpec(cfg.data, cfg.augment, cfg.resolution)
    dataset = Niceness()
    keys = [(index, 0, 0) for index in SequentialSampler(dataset)]
    own = os.nice(0)
    loader = build_train_loader(dataset, keys, 2, spec, cfg.runtime, torch.device("cpu"))
    assert {int(value) for batch in loader for value in batch} == {min(own + expected, 19)}


@pytest.mark.parametrize("value", [-1, 20])
def test_a_niceness_outside_0_to_19_is_a_config_error(value):
    with pytest.raises(ConfigError, match=rf"runtime.worker_nice={value} must be in \[0, 19\]: it is added"):
        validate_config(compose_config([f"runtime.worker_nice={value}"]))


def test_a_runs_loader_workers_end_when_asked_not_killed_after_a_wait():
    """end_workers stops a loader's persistent workers by torch's own stop signal: each exits by itself (exit 0).
    Left to the garbage collector, a loader in a reference cycle (as a run's are) has its queues finalized before
    it: the stop signal never reached the workers, each was waited on for 5 s and killed (exit -15), 20 s at the
    end of every run with 2 training and 2 evaluation workers."""
    cfg = compose_config(["runtime.num_workers=2"])
    loader = build_loader(Niceness(), [(index, 0, 0) for index in range(4)], 2, cfg.runtime, train=True)
    assert len(list(loader)) == 2
    workers = list(loader._iterator._workers)
    end_workers(loader)
    assert [worker.exitcode for worker in workers] == [0, 0]
    end_workers(loader)  # a second call, or the collector's, finds nothing to stop


def test_a_workers_death_mid_handover_counts_as_a_lost_worker():
    """A worker killed while the training process takes its batch's shared memory surfaces as the resource sharer's
    EOFError or a refused connection, not torch's RuntimeError (seen in test_signals' kill of the workers during a
    stop): the stop must read all three as a lost worker, and nothing else."""
    from deit_ablate.data.loader import lost_worker

    assert lost_worker(RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly"))
    assert lost_worker(EOFError())
    assert lost_worker(ConnectionRefusedError(111, "Connection refused"))
    assert not lost_worker(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not lost_worker(ValueError("a bad value"))
