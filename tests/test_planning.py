"""Planning a sweep composes each run once: a fine-tune finds its pre-training among the sweep's own runs."""

import pytest

from deit_ablate.config.compose import compose_run_config
from deit_ablate.record import resolvers
from deit_ablate.record.identity import composed_choices, run_identity
from deit_ablate.record.overrides import named_by_finetune, pretrain_overrides


@pytest.mark.parametrize("row", [["ablation=no_mixup"], ["ablation=sgd_finetune", "seed=2"], ["deit3=res_128"],
                                 ["preset=paper", "ablation=dropout"]])
def test_a_sweeps_pretraining_is_the_run_its_finetune_would_compose(row, monkeypatch):
    monkeypatch.setattr(resolvers, "_composed", {})
    job = [*row, "stage=pretrain"]
    named = pretrain_overrides([*row, "stage=finetune"])
    assert named_by_finetune("pretrain", job) == named
    resolvers.run_dir_of(named, "outputs", compose_run_config(job))  # as the dry run hands in its sweep's configs
    fresh = compose_run_config(named)
    assert resolvers._composed[tuple(named)] == run_identity(fresh, named, composed_choices(fresh))


def test_a_pretraining_that_is_not_the_finetunes_is_not_named_by_it():
    # its fine-tune names the pre-training without the resolution: another run
    assert named_by_finetune("pretrain", ["resolution=160px", "stage=pretrain"]) is None
    assert named_by_finetune("finetune", ["ablation=sgd", "stage=finetune"]) is None
    assert named_by_finetune("pretrain", ["ablation=sgd", "stage=pretrain"]) == ["ablation=sgd"]


def test_config_files_read_once_compose_each_run_as_hydra_does(monkeypatch):
    from omegaconf import OmegaConf

    from deit_ablate.config import compose

    def composed(runs):  # in one Hydra app, as a sweep composes its runs
        from hydra import initialize_config_dir

        with initialize_config_dir(config_dir=str(compose.CONF_DIR), version_base="1.3"):
            configs = [compose.compose_run_config(run) for run in runs]
        return [OmegaConf.to_yaml(cfg, resolve=True) for cfg in configs]  # after all: a run's config is its own

    runs = [["ablation=no_mixup"], ["ablation=sgd", "seed=1"], ["ablation=dropout", "augment=autoaugment"], []]
    with monkeypatch.context() as hydra_alone:
        hydra_alone.setattr(compose, "read_config_files_once", lambda config_loader: None)
        expected = composed(runs)
    monkeypatch.setattr(compose, "_LOADED", {})
    # a file read once and handed to every composition as it is: each run's config changes with the next ones
    assert composed(runs) == expected and composed(runs) == expected
    assert "\nseed: 0\n" in expected[0] and "\nseed: 1\n" in expected[1]


def test_a_loader_reading_files_once_pickles_as_its_repository():
    """The SLURM launcher pickles the sweep's config loader into every job; before, unpickling it recursed without
    end (RecursionError in every job) and would have carried every file read so far."""
    import pickle

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from deit_ablate.config import compose

    with initialize_config_dir(config_dir=str(compose.CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        compose.read_config_files_once(loader)
        compose.compose_run_config(["ablation=no_mixup"])
        copied = pickle.loads(pickle.dumps(loader))
    assert isinstance(copied.repository, compose.ConfigFilesReadOnce) and copied.repository.loaded is compose._LOADED
    wrapper, repository = (len(pickle.dumps(r)) for r in (loader.repository, loader.repository.delegate))
    assert wrapper < repository + 200  # the files read so far stay in this process
