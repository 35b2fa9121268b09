"""The config surface: Table 9 at preset=paper, typed schemas, group options, --cfg job."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from deit_ablate.core.errors import ConfigError
from deit_ablate.run.validate import validate_config
from tests.conftest import REPO, compose_config, identity_of


def test_paper_preset_is_table_9():
    cfg = compose_config(["preset=paper"])
    assert cfg.model.name == "deit_base_patch16_224"
    assert cfg.data.name == "imagenet"
    assert (cfg.resolution.train_size, cfg.resolution.eval_size) == (224, 224)
    assert cfg.train.global_batch == 1024
    assert cfg.optimizer.name == "adamw"
    assert cfg.optimizer.lr == 5e-4 and cfg.optimizer.lr_base_batch == 512
    assert cfg.optimizer.weight_decay == 0.05
    assert cfg.optimizer.sched == "cosine" and cfg.optimizer.warmup_epochs == 5
    assert cfg.train.epochs == 300
    assert cfg.mix.label_smoothing == 0.1
    assert cfg.model.dropout == 0.0 and cfg.model.drop_path == 0.1
    assert cfg.augment.repeated_aug == 3
    assert cfg.optimizer.clip_grad is None
    assert cfg.augment.auto_augment == "rand-m9-mstd0.5-inc1"
    assert cfg.augment.reprob == 0.25 and cfg.augment.remode == "pixel"
    # Beta parameters, not probabilities; one of the two per batch.
    assert (cfg.mix.mixup_alpha, cfg.mix.cutmix_alpha, cfg.mix.switch_prob, cfg.mix.prob) == (0.8, 1.0, 0.5, 1.0)
    assert cfg.train.ema is False
    assert "ablation" not in cfg and cfg.stage == "pretrain"  # Table 8's row is a Hydra choice, baseline by default
    assert identity_of([]).run_id == identity_of(["ablation=baseline"]).run_id != identity_of(["ablation=sgd"]).run_id


def test_paper_finetune_stage_is_the_384_recipe():
    cfg = compose_config(["preset=paper", "stage=finetune"])
    assert (cfg.resolution.train_size, cfg.resolution.crop_pct) == (384, 0.875)  # eval: resize 438, crop 384
    ft = cfg.finetune
    assert (ft.lr, ft.weight_decay, ft.epochs, ft.min_lr) == (5e-6, 1e-8, 30, 5e-6)
    assert (ft.global_batch, ft.warmup_epochs, ft.warmup_lr, ft.train_mode, ft.optimizer) == (512, 5, 1e-6, False,
                                                                                               "adamw")


def test_demo_preset_keeps_every_ingredient_on():
    cfg = compose_config([])
    assert cfg.preset == "demo" and cfg.data.name == "builtin"
    assert cfg.augment.auto_augment == "rand-m9-mstd0.5-inc1"
    assert cfg.augment.reprob > 0 and cfg.augment.repeated_aug == 3
    assert cfg.mix.mixup_alpha == 0.8 and cfg.mix.cutmix_alpha == 1.0 and cfg.mix.label_smoothing == 0.1
    assert cfg.model.drop_path == 0.1 and cfg.optimizer.name == "adamw" and cfg.optimizer.warmup_epochs > 0


@pytest.mark.parametrize(("option", "alphas"), [("mixup_cutmix", (0.8, 1.0)), ("mixup_only", (0.8, 0.0)),
                                                ("cutmix_only", (0.0, 1.0)), ("none", (0.0, 0.0))])
def test_mix_options(option, alphas):
    cfg = compose_config([f"mix={option}"])
    assert (cfg.mix.mixup_alpha, cfg.mix.cutmix_alpha) == alphas
    assert cfg.mix.label_smoothing == 0.1


def test_misspelled_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as error:
        compose_config(["mix.mixup_alpah=0.5"])
    assert "mixup_alpah" in str(error.value.__cause__ or error.value)


def test_wrong_type_fails_naming_the_key():
    with pytest.raises((ConfigCompositionException, ValidationError)) as error:
        compose_config(["train.global_batch=lots"])
    text = str(error.value) + str(error.value.__cause__)
    assert "global_batch" in text and "lots" in text


def test_unknown_group_option_fails_listing_the_options():
    with pytest.raises(ConfigCompositionException) as error:
        compose_config(["mix=cutmixx"])
    assert "cutmixx" in str(error.value) and "cutmix_only" in str(error.value)


def test_misspelled_key_in_a_group_file_is_an_error(tmp_path):
    conf = tmp_path / "conf"
    import shutil

    shutil.copytree(REPO / "conf", conf)
    (conf / "mix" / "bad.yaml").write_text("mixup_alfa: 0.8\n")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), f"--config-dir={conf}", "mix=bad", "--cfg", "job"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "mixup_alfa" in proc.stderr


def test_cfg_job_prints_the_resolved_paper_recipe():
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "preset=paper", "--cfg", "job"],
                          capture_output=True, text=True, cwd=REPO, check=True)
    assert "global_batch: 1024" in proc.stdout
    assert "auto_augment: rand-m9-mstd0.5-inc1" in proc.stdout
    assert "name: deit_base_patch16_224" in proc.stdout
    assert "${" not in proc.stdout  # resolved: no interpolation left for the reader to work out


@pytest.mark.parametrize(("override", "problem"), [
    ("model.kwargs.num_heads=3", r"AssertionError: dim should be divisible by num_heads"),
    ("model.kwargs.embed_dim=-128", r"RuntimeError: Trying to create tensor with negative dimension -128"),
])
def test_model_arguments_timm_refuses_stop_the_launch(override, problem):
    """The model is built on the meta device before anything is written: not after the run's folder is made."""
    with pytest.raises(ConfigError, match=rf"deit_tiny_patch16_224 cannot be built with .*{override}.*: timm refuses "
                                          rf"them \({problem}.*Change the model.kwargs value it names"):
        validate_config(compose_config([override]))
