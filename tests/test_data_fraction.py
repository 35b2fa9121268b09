"""data.fraction: a run trains on a fixed share of each class's training images (Chen, Hsieh & Gong 2022 train on a
tenth of ImageNet-1k), the same images under every layout, and evaluates on the whole held-out split; another share
is another run, the whole split the run it always was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import deit_ablate.run.assemble as assemble
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.datasets import fraction_indices
from deit_ablate.run.assemble import build_loaders
from deit_ablate.run.validate import plan_batch, validate_config
from tests.conftest import TINY, compose_config, identity_of, transform_spec

# Nine images of three classes, written out: class 0 at positions 0, 2, 3, 6, 8; class 1 at 1, 4, 7; class 2 at 5.
TARGETS = [0, 1, 0, 0, 1, 2, 0, 1, 0]
# Class c's permutation is torch.randperm(n_c) from seed c: (4, 0, 1, 3, 2) for class 0, so its positions in that
# order are 8, 0, 2, 6, 3; (1, 2, 0) for class 1: 4, 7, 1; (0,) for class 2: 5. Each keeps the first ceil(f * n_c).
KEPT = {
    0.5: [0, 2, 4, 5, 7, 8],  # ceil(2.5) = 3 of class 0 (8, 0, 2), ceil(1.5) = 2 of class 1 (4, 7), 1 of class 2
    0.1: [4, 5, 8],  # one of each class: ceil(0.5), ceil(0.3), ceil(0.1)
    0.4: [0, 4, 5, 7, 8],  # ceil(2.0) = 2 of class 0 (8, 0), ceil(1.2) = 2 of class 1 (4, 7), 1 of class 2
    1.0: list(range(9)),
}


@pytest.mark.parametrize("fraction", sorted(KEPT))
def test_the_kept_images_are_the_definitions_written_out_by_hand(fraction: float) -> None:
    assert fraction_indices(TARGETS, fraction) == KEPT[fraction]


def test_ceil_of_an_exact_share_is_that_share_not_one_more() -> None:
    assert len(fraction_indices([0] * 10, 0.3)) == 3  # 0.3 * 10 is 3.0000000000000004 in floating point
    assert len(fraction_indices([0] * 1300, 0.1)) == 130 and len(fraction_indices([0] * 1281, 0.1)) == 129


def test_another_share_is_another_run_and_the_whole_split_the_same_run() -> None:
    plain = identity_of(TINY)
    assert identity_of([*TINY, "data.fraction=1.0"]).run_id == plain.run_id  # runs before the key keep their id
    tenth = identity_of([*TINY, "data.fraction=0.1"])
    assert tenth.run_id != plain.run_id and "fraction=0.1" in tenth.name


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_a_share_outside_0_to_1_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=f"data.fraction={float(value)}") as error:
        validate_config(compose_config([*TINY, f"data.fraction={value}"]))
    assert "\n" not in str(error.value)


def _loaders(monkeypatch, cache, world_size: int, rank: int, workers: int = 0):
    """build_loaders for one rank of `world_size` (the rendezvous no-op: the loaders need none but the barrier)."""
    monkeypatch.setattr(assemble, "barrier", lambda info: None)
    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(cache))
    cfg = compose_config([*TINY, "data.fraction=0.5", f"runtime.num_workers={workers}"])
    plan = SimpleNamespace(settings=cfg, batch=plan_batch(cfg, world_size), transforms=transform_spec(cfg))
    return build_loaders(plan, DistInfo(rank=rank, world_size=world_size))


def _epoch_images(loaders) -> list[int]:
    """The split positions (of the whole train/) the rank's epoch 0 trains on."""
    loaders.train_sampler.set_epoch(0)
    return [loaders.train_set.indices[index] for index, *_ in loaders.train_sampler]


def test_every_layout_trains_on_the_same_subset_and_evaluates_on_all_of_val(monkeypatch, data_cache, tiny_data
                                                                            ) -> None:
    alone = _loaders(monkeypatch, data_cache, 1, 0)
    kept = alone.train_set.indices
    assert len(kept) == 10 * 15 and len(alone.val_loader.dataset) == 10 * 10  # 15 of 30 per class; val/ whole
    assert sorted({alone.train_set.dataset.targets[i] for i in kept}) == list(range(10))
    one = _epoch_images(alone)
    two = [image for rank in (0, 1) for image in _epoch_images(_loaders(monkeypatch, data_cache, 2, rank))]
    assert set(one) <= set(kept) and sorted(one) == sorted(two)  # the same images, dealt to one or two ranks
    # loader workers read the same images: the same labels in the same order
    labels = [labels.tolist() for _, labels, *_ in alone.train_loader]
    with_worker = _loaders(monkeypatch, data_cache, 1, 0, workers=1)
    assert with_worker.train_set.indices == kept
    with_worker.train_sampler.set_epoch(0)
    assert [labels.tolist() for _, labels, *_ in with_worker.train_loader] == labels
