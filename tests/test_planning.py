"""Planning a sweep composes each run once: a fine-tune finds its pre-training among the sweep's own runs."""

import pytest

from deit_ablate.config.compose import compose_run_config
from deit_ablate.record import resolvers
from deit_ablate.record.identity import composed_choices, pretrain_overrides, run_identity


@pytest.mark.parametrize("row", [["ablation=no_mixup"], ["ablation=sgd_finetune", "seed=2"], ["deit3=res_128"],
                                 ["preset=paper", "ablation=dropout"]])
def test_a_sweeps_pretraining_is_the_run_its_finetune_would_compose(row, monkeypatch):
    monkeypatch.setattr(resolvers, "_composed", {})
    job = [*row, "stage=pretrain"]
    named = pretrain_overrides([*row, "stage=finetune"])
    resolvers.remember_sweep_run(compose_run_config(job), job)
    fresh = compose_run_config(named)
    assert resolvers._composed[tuple(named)] == run_identity(fresh, named, composed_choices(fresh))


def test_a_pretraining_that_is_not_the_finetunes_is_not_kept(monkeypatch):
    monkeypatch.setattr(resolvers, "_composed", {})
    job = ["resolution=160px", "stage=pretrain"]  # its fine-tune names the pre-training without the resolution
    resolvers.remember_sweep_run(compose_run_config(job), job)
    assert resolvers._composed == {}
