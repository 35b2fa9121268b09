"""Table 7's transfer recipes against their sources, written out by hand: each row's stage recipe is its closest DeiT
source's (facebookresearch/deit issues #45 and #105, each lr at the batch its author gave it, issue #141), and
transfer_recipe=cait is CaiT's rule (Touvron et al. 2021b, section 4.3) over the source's pre-training recipe."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from deit_ablate.config.stage_config import stage_config
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.run.assemble import stage_optimizer
from deit_ablate.run.commands import show_stage_config
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.stages import stage_distils, stage_recipe
from deit_ablate.run.validate import validate_config
from tests.conftest import CONF, compose_config, identity_of, one_class_imagefolder

# DeiT's ImageNet training (Table 9), which both issues keep ("all other elements are the same", #45) or list (#105)
IMAGENET_AUGMENTATION = {"auto_augment": "rand-m9-mstd0.5-inc1", "repeated_aug": 3, "mixup_alpha": 0.8,
                         "cutmix_alpha": 1.0, "label_smoothing": 0.1, "sched": "cosine", "warmup_epochs": 5.0}
# Issue #45 (2021-01-22), for CIFAR-10 and Cars: image size 224 or 384, batch 768, lr 0.01, SGD, weight decay 1e-4,
# 1000 epochs, no random erasing, no stochastic depth. The lr is the one at batch 768 (issue #141: the author's
# numbers are the lr after main.py's linear scaling).
ISSUE_45 = {**IMAGENET_AUGMENTATION, "optimizer": "sgd", "global_batch": 768, "lr_at_batch": 0.01,
            "weight_decay": 1e-4, "epochs": 1000, "drop_path": 0.0, "reprob": 0.0}
# Issue #105 (2021-07-30), DeiT-B on iNaturalist: batch 768, lr 7.5e-5 (at that batch, issue #141), 360 epochs,
# weight decay 0.05, cosine, repeated augmentation, smoothing 0.1, 5 warm-up epochs, rand-m9-mstd0.5-inc1, Mixup 0.8,
# CutMix 1.0, stochastic depth 0.1, erasing 0.1, AdamW.
ISSUE_105 = {**IMAGENET_AUGMENTATION, "optimizer": "adamw", "global_batch": 768, "lr_at_batch": 7.5e-5,
             "weight_decay": 0.05, "epochs": 360, "drop_path": 0.1, "reprob": 0.1}
SOURCES = {"cifar10": ISSUE_45, "cifar100": ISSUE_45, "flowers": ISSUE_45, "cars": ISSUE_45, "inat18": ISSUE_105,
           "inat19": ISSUE_105}
# CaiT section 4.3: the lr divided by 10 (Cars, Flowers, iNaturalist) or 100 (CIFAR), 1000 epochs (360 for
# iNaturalist 2018 and 2019), the training's other hyperparameters, no distillation
CAIT = {"cifar10": (100, 1000), "cifar100": (100, 1000), "flowers": (10, 1000), "cars": (10, 1000),
        "inat18": (10, 360), "inat19": (10, 360)}
# The training hyperparameters of two sources: DeiT-B's (Table 9: AdamW, lr 5e-4 per 512 images at batch 1024) and
# DeiT III's ViT-B (LAMB, lr 3e-3 at batch 2048, weight decay 0.05, drop path 0.2, no erasing), whose ↑384
# fine-tune (AdamW, lr 1e-5, weight decay 0.1) is not what CaiT's rule reads
DEIT_B = {**IMAGENET_AUGMENTATION, "optimizer": "adamw", "global_batch": 1024, "lr_at_batch": 1e-3,
          "weight_decay": 0.05, "drop_path": 0.1, "reprob": 0.25, "warmup_lr": 1e-6, "min_lr": 1e-5}
DEIT3_B = {"optimizer": "lamb", "global_batch": 2048, "lr_at_batch": 3e-3, "weight_decay": 0.05, "drop_path": 0.2,
           "reprob": 0.0, "warmup_epochs": 5.0, "warmup_lr": 1e-6, "min_lr": 1e-5, "repeated_aug": 3,
           "label_smoothing": 0.0, "sched": "cosine"}
TEACHER = ["distill=hard_token", "distill.teacher.checkpoint=/nowhere/regnety_160.pth"]  # a distilled source


def _lr_at_batch(cfg) -> float:
    """The peak lr the stage's optimizer is built with, at the batch it runs."""
    recipe = stage_recipe(cfg)
    optimizer = stage_optimizer(stage_config(cfg).optimizer, recipe, torch.nn.Linear(2, 2), DistInfo())
    return optimizer.param_groups[0]["lr"]


def _runs(overrides: list[str]) -> dict:
    """What the stage of `overrides` runs, in the keys the sources speak of."""
    cfg = compose_config([*overrides, "preset=paper", "transfer.init_checkpoint=/nowhere.pt", *TEACHER])
    applied, recipe = stage_config(cfg), stage_recipe(cfg)
    runs = {"optimizer": recipe.optimizer, "global_batch": recipe.global_batch, "lr_at_batch": _lr_at_batch(cfg),
            "weight_decay": recipe.weight_decay, "epochs": recipe.epochs, "warmup_epochs": recipe.warmup_epochs,
            "warmup_lr": recipe.warmup_lr, "min_lr": recipe.min_lr, "sched": applied.optimizer.sched,
            "drop_path": applied.model.drop_path, "reprob": applied.augment.reprob,
            "repeated_aug": applied.augment.repeated_aug, "auto_augment": applied.augment.auto_augment,
            "mixup_alpha": applied.mix.mixup_alpha, "cutmix_alpha": applied.mix.cutmix_alpha,
            "label_smoothing": applied.mix.label_smoothing}
    assert not stage_distils(Lineage.of(cfg, ())), "a transfer trains on the labels alone"
    return runs


def _approx(expected: dict) -> dict:
    return {key: pytest.approx(value) if isinstance(value, float) else value for key, value in expected.items()}


@pytest.mark.parametrize("row", sorted(SOURCES))
def test_each_row_runs_its_closest_sources_recipe(row):
    runs = _runs([f"transfer={row}"])
    assert {key: runs[key] for key in SOURCES[row]} == _approx(SOURCES[row])
    assert (runs["warmup_lr"], runs["min_lr"]) == (1e-6, 1e-5)  # main.py's defaults: neither issue sets them


@pytest.mark.parametrize("row", sorted(CAIT))
def test_the_cait_rule_is_the_pretrainings_recipe_with_its_lr_divided(row):
    divisor, epochs = CAIT[row]
    for source, training in (([], DEIT_B), (["recipe=deit3", "model=vit_base"], DEIT3_B)):
        runs = _runs([f"transfer={row}", "transfer_recipe=cait", *source])
        expected = {**training, "lr_at_batch": training["lr_at_batch"] / divisor, "epochs": epochs}
        assert {key: runs[key] for key in expected} == _approx(expected), source


def test_the_lr_of_each_source_is_said_at_its_batch_and_scales_from_there():
    """As the author reads #105's 7.5e-5 (issue #141), so #45's 0.01: at batch 768 (per 512 images it was 0.015);
    another batch scales it linearly from there, and the demo's lr is still said per 512 images."""
    for row, lr in (("cifar10", 0.01), ("inat18", 7.5e-5)):
        assert _runs([f"transfer={row}"])["lr_at_batch"] == pytest.approx(lr)
        assert _runs([f"transfer={row}", "transfer.global_batch=384"])["lr_at_batch"] == pytest.approx(lr / 2)
    demo = compose_config(["transfer=builtin_b", "transfer.init_checkpoint=/nowhere.pt"])
    assert _lr_at_batch(demo) == pytest.approx(0.04 * 128 / 512)


@pytest.mark.parametrize("rule", ["deit", "cait"])
@pytest.mark.parametrize("row", ["builtin_b", "cars", "inat18"])  # the CIFAR rows differ from cars in the factor alone
def test_rows_under_either_rule_pass_the_launch_checks(row, rule, tmp_path):
    data = [] if row == "builtin_b" else one_class_imagefolder(tmp_path)
    for preset in ("demo", "paper"):
        validate_config(compose_config([f"transfer={row}", f"transfer_recipe={rule}", f"preset={preset}", *data]))


@pytest.mark.parametrize("divisor", ["0", "-10"])
def test_a_factor_cait_cannot_divide_by_is_refused_naming_it(divisor):
    """Before the check: a ZeroDivisionError traceback out of the config's resolution (0), or a negative lr blamed
    on optimizer.lr (-10)."""
    with pytest.raises(ConfigError, match=r"transfer.cait_lr_divisor=-?\d+.0 must be > 0: CaiT's factor"):
        validate_config(compose_config(["transfer=builtin_b", "transfer_recipe=cait",
                                        f"transfer.cait_lr_divisor={divisor}"]))


@pytest.mark.parametrize("row", sorted(SOURCES))
def test_cfg_job_shows_the_recipe_the_transfer_runs(row, capsys):
    """`--cfg job --resolve` prints the stage's config, its transfer block as the stage read it: under CaiT's rule,
    transfer.lr is the pre-training's lr over the factor once (it was divided again by the printed config)."""
    divisor, cait_epochs = CAIT[row]
    source = SOURCES[row]
    for rule, lr, base_batch, batch, epochs in (("deit", source["lr_at_batch"], 768, 768, source["epochs"]),
                                                ("cait", 5e-4 / divisor, 512, 1024, cait_epochs)):
        assert show_stage_config([f"transfer={row}", "preset=paper", f"transfer_recipe={rule}", "--cfg", "job",
                                  "--resolve"])
        shown = yaml.safe_load(capsys.readouterr().out)
        optimizer, transfer = shown["optimizer"], shown["transfer"]
        assert (optimizer["name"], shown["train"]["epochs"]) == (source["optimizer"] if rule == "deit" else "adamw",
                                                                 epochs)
        assert (optimizer["lr"], optimizer["lr_base_batch"], shown["train"]["global_batch"]) == (lr, base_batch, batch)
        assert (transfer["lr"], transfer["lr_base_batch"]) == (lr, base_batch), rule


def test_python_train_py_cfg_job_prints_issue_105s_recipe():
    command = [sys.executable, "train.py", "transfer=inat18", "preset=paper", "--cfg", "job", "--resolve"]
    shown = yaml.safe_load(subprocess.run(command, cwd=CONF.parent, capture_output=True, text=True,
                                          check=True).stdout)
    optimizer, train = shown["optimizer"], shown["train"]
    assert (optimizer["name"], optimizer["lr"], optimizer["lr_base_batch"], train["global_batch"]) == (
        "adamw", 7.5e-5, 768, 768)
    assert (optimizer["weight_decay"], train["epochs"], shown["model"]["drop_path"], shown["augment"]["reprob"]) == (
        0.05, 360, 0.1, 0.1)


def test_the_rule_names_no_source_run_and_its_factor_is_not_the_identity():
    """transfer_recipe= is the transfer's own, like transfer.*: the source run is found without it, and a pre-training
    or fine-tune given it is the run without it. CaiT's factor enters a run only through the lr it gives."""
    for stage in (["stage=pretrain"], ["stage=finetune"]):
        assert identity_of([*stage, "transfer_recipe=cait"]) == identity_of(stage)
    base = identity_of(["transfer=cars"])
    assert identity_of(["transfer=cars", "transfer.cait_lr_divisor=100"]) == base  # DeiT's rule does not read it
    cait = identity_of(["transfer=cars", "transfer_recipe=cait"])
    assert cait.digest != base.digest and "transfer_recipe=cait" in cait.name
    assert identity_of(["transfer=cars", "transfer_recipe=cait", "transfer.cait_lr_divisor=100"]).digest != cait.digest
