"""A stage is a recipe: a fine-tune or transfer runs the pre-training's config with its block's named keys and override
set applied (deit_ablate/config/stage_config.py). Held to the released commands: DeiT III's fine-tunes, Table 7's
transfer, the original ViT recipe's lr rules; and the identity, which stays the composed config."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from deit_ablate.config.stage_config import stage_changes, stage_config
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.identity import experiment_digest
from deit_ablate.run.assemble import stage_optimizer
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.stages import changes_line, compared_config, stage_recipe
from deit_ablate.run.validate import validate_config
from tests.conftest import CONF, TINY, compose_config, identity_of, run_train

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

# facebookresearch/deit, README_revenge.md, "finetuning for ViT-S, B and L at resolution 384x384", ViT-B:
#   --model deit_base_patch16_LS --batch 32 --lr 1e-5 --epochs 20 --weight-decay 0.1 --sched cosine --input-size 384
#   --eval-crop-ratio 1.0 --reprob 0.0 --nodes 2 --ngpus 8 --smoothing 0.1 --warmup-epochs 5 --drop 0.0 --seed 0
#   --opt adamw --warmup-lr 1e-6 --mixup .8 --drop-path 0.15 --cutmix 1.0 --unscale-lr --no-repeated-aug
#   --aa rand-m9-mstd0.5-inc1 --finetune model_path
# with main.py's defaults for the rest: --min-lr 1e-5, --train-mode, no --bce-loss (cross-entropy), no
# --ThreeAugment, --mixup-prob 1.0, --mixup-switch-prob 0.5, --clip-grad None, no --model-ema.
RELEASED_FINETUNE_384 = {
    "train.micro_batch": 32,  # --batch 32
    "train.global_batch": 512,  # x 2 nodes x 8 GPUs
    "optimizer.lr": 1e-5,  # --lr 1e-5 --unscale-lr: the lr at this batch...
    "optimizer.lr_base_batch": 512,  # ...said at it
    "train.epochs": 20,
    "optimizer.weight_decay": 0.1,
    "optimizer.sched": "cosine",
    "resolution.train_size": 384,
    "resolution.eval_size": 384,
    "resolution.crop_pct": 1.0,  # --eval-crop-ratio 1.0
    "augment.reprob": 0.0,
    "mix.label_smoothing": 0.1,  # --smoothing 0.1
    "optimizer.warmup_epochs": 5,
    "model.dropout": 0.0,  # --drop 0.0
    "seed": 0,
    "optimizer.name": "adamw",
    "optimizer.warmup_lr": 1e-6,
    "mix.mixup_alpha": 0.8,
    "model.drop_path": 0.15,
    "mix.cutmix_alpha": 1.0,
    "augment.repeated_aug": 1,  # --no-repeated-aug
    "augment.auto_augment": "rand-m9-mstd0.5-inc1",
    "optimizer.min_lr": 1e-5,  # main.py's default
    "finetune.train_mode": True,  # main.py's default
    "mix.criterion": "ce",  # no --bce-loss
    "augment.three_augment": False,  # no --ThreeAugment
    "mix.prob": 1.0,
    "mix.switch_prob": 0.5,
    "optimizer.clip_grad": None,
    "train.ema": False,
}
# "finetuning for ViT-B, L and H at resolution 224x224", ViT-B: the same but --batch 64 --nodes 1 --input-size 224
# --drop-path 0.2.
RELEASED_FINETUNE_224 = {**RELEASED_FINETUNE_384, "train.micro_batch": 64, "resolution.train_size": 224,
                         "resolution.eval_size": 224, "model.drop_path": 0.2}


def _applied(overrides: list[str]):
    return stage_config(compose_config(overrides))


def _value(cfg, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node[key]
    return node.value if hasattr(node, "value") else node


@pytest.mark.parametrize("row", ["deit3=baseline", "recipe=deit3"])
def test_deit3_fine_tune_at_384_is_the_released_command(row):
    cfg = _applied([row, "stage=finetune", "preset=paper"])
    assert {key: _value(cfg, key) for key in RELEASED_FINETUNE_384} == RELEASED_FINETUNE_384
    assert cfg.model.kwargs.init_values == 1e-4  # the pre-trained network (deit_base_patch16_LS) as it was
    validate_config(compose_config([row, "stage=finetune"]))  # and at demo scale it passes every check


def test_deit3_fine_tune_at_224_is_the_released_224_command():
    cfg = _applied(["deit3=res_224", "stage=finetune", "preset=paper"])
    assert {key: _value(cfg, key) for key in RELEASED_FINETUNE_224} == RELEASED_FINETUNE_224


def test_the_pretraining_keeps_its_own_recipe():
    """The fine-tune's set changes nothing of the pre-training: BCE, 3-Augment, 3 repeats, drop path 0.2."""
    cfg = _applied(["deit3=baseline", "preset=paper"])
    assert (cfg.mix.criterion, cfg.mix.label_smoothing, cfg.augment.three_augment) == ("bce", 0.0, True)
    assert (cfg.augment.repeated_aug, cfg.model.drop_path, cfg.optimizer.name) == (3, 0.2, "lamb")


def test_cfg_job_prints_the_fine_tune_as_it_runs():
    command = [sys.executable, "train.py", "deit3=baseline", "stage=finetune", "preset=paper", "--cfg", "job",
               "--resolve"]
    shown = yaml.safe_load(subprocess.run(command, cwd=CONF.parent, capture_output=True, text=True,
                                          check=True).stdout)
    assert (shown["mix"]["criterion"], shown["mix"]["label_smoothing"]) == ("ce", 0.1)
    assert shown["augment"]["auto_augment"] == "rand-m9-mstd0.5-inc1" and shown["augment"]["repeated_aug"] == 1
    assert (shown["augment"]["reprob"], shown["model"]["drop_path"]) == (0.0, 0.15)
    assert (shown["optimizer"]["name"], shown["optimizer"]["lr"], shown["train"]["epochs"]) == ("adamw", 1e-5, 20)
    assert "hydra" not in shown
    package = subprocess.run([*command[:-1], "--package", "mix"], cwd=CONF.parent, capture_output=True, text=True,
                             check=True).stdout
    assert package.startswith("# @package mix") and "criterion: ce" in package


@pytest.mark.parametrize(("override", "problem"), [
    ("++finetune.overrides.mix.critrion=ce", "has no key mix.critrion. Did you mean mix.criterion"),
    ("++finetune.overrides.mix.label_smoothing=lots", "label_smoothing: Value 'lots'"),
    ("++finetune.overrides.optimizer.lr=1e-3", "set finetune.lr instead"),
    ("++transfer.overrides.model.drop_path=0.1", "set transfer.drop_path instead"),
    ("++finetune.overrides.runtime.device=cpu", "`runtime` is not one of them"),
    ("++finetune.overrides.mix.label_smoothing=1.5", r"mix.label_smoothing=1.5 must be in \[0"),
    ("++finetune.overrides.model.kwargs.depth=2",
     r"finetune.overrides changes the network \(model.kwargs.depth 6 -> 2\), but stage=finetune loads the weights of "
     "its pre-training"),
    ("++transfer.overrides.model.kwargs.embed_dim=64", r"\(model.kwargs.embed_dim 128 -> 64\), but stage=transfer "
                                                       "loads the weights of its source run"),
    ("++finetune.overrides.model.kwargs.patch_size=4",
     r"patch_embed.proj.weight, pos_embed\).*drop the model keys from finetune.overrides"),
])
def test_a_bad_override_set_is_refused_with_the_fix_even_in_a_pretraining(override, problem):
    for stage in ("stage=pretrain", "stage=finetune"):
        if "1.5" in override and stage == "stage=pretrain":
            continue  # a value in range for the schema's type, checked where the stage runs it
        with pytest.raises(ConfigError, match=problem):
            validate_config(compose_config([override, stage]))


def test_an_override_set_may_change_how_the_network_trains_and_a_transfer_its_head():
    for overrides in (["stage=finetune", "++finetune.overrides.model.dropout=0.1",
                       "++finetune.overrides.model.drop_path=0.3"],
                      ["transfer=builtin_b", "++transfer.overrides.model.head=mlp_tanh"]):
        validate_config(compose_config(overrides))


@pytest.mark.slow  # two train.py processes before the fix: the pre-training trained, then the fine-tune failed
def test_a_sweep_whose_fine_tune_changes_the_network_trains_nothing(tmp_path, data_cache):
    proc = run_train(["-m", *TINY, "stage=pretrain,finetune", "++finetune.overrides.model.kwargs.depth=2"], tmp_path,
                     data_cache, check=False)
    assert proc.returncode == 2 and "model.kwargs.depth 1 -> 2" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()


def test_an_override_set_is_the_stage_only_and_part_of_its_identity():
    smoothed = ["++finetune.overrides.mix.label_smoothing=0.3"]
    assert identity_of(smoothed) == identity_of([])  # a pre-training: the fine-tune's set is not its recipe
    fine_tune = identity_of(["stage=finetune"])
    assert identity_of(["stage=finetune", *smoothed]).digest != fine_tune.digest
    assert _applied(["stage=finetune", *smoothed]).mix.label_smoothing == 0.3


def test_fine_tunes_of_two_pretrainings_the_stage_overrides_alike_are_two_runs():
    """Both fine-tunes run cross-entropy (the set's), but start from a BCE and a CE pre-training: the identity is
    the composed config, so they are two runs, not one."""
    bce, ce = (["deit3=baseline", "stage=finetune"], ["deit3=baseline", "stage=finetune", "mix.criterion=ce"])
    assert _applied(bce).mix.criterion == _applied(ce).mix.criterion == "ce"
    assert identity_of(bce).digest != identity_of(ce).digest


def test_the_identity_refuses_an_applied_config():
    with pytest.raises(ValueError, match="composed config"):
        experiment_digest(_applied(["stage=finetune"]))


def _built_lr(overrides: list[str]) -> float:
    cfg = compose_config([*overrides, "preset=paper", "finetune.init_checkpoint=/nowhere.pt",
                          "transfer.init_checkpoint=/nowhere.pt"])
    recipe = stage_recipe(cfg)
    optimizer = stage_optimizer(stage_config(cfg).optimizer, recipe, torch.nn.Linear(2, 2), DistInfo())
    return optimizer.param_groups[0]["lr"]


def test_each_stage_scales_its_lr_by_its_own_rule():
    """The original ViT recipe says its lr at 4096 images; its fine-tune's and transfer's lr are theirs, per 512 and
    at 768 images (before: divided by 4096 too, 8x lower than typed)."""
    assert _built_lr(["sam=baseline"]) == pytest.approx(3e-3)  # 3e-3 at its batch of 4096
    assert _built_lr(["sam=baseline", "stage=finetune", "finetune.lr=1e-4"]) == pytest.approx(1e-4)  # batch 512
    assert _built_lr(["sam=baseline", "transfer=cifar10"]) == pytest.approx(0.01)  # said at its batch of 768
    assert _built_lr(["deit3=baseline", "stage=finetune"]) == pytest.approx(1e-5)


def test_table8_fine_tune_keeps_its_lr_and_identity_under_the_stage_rule():
    """DeiT's pre-training says its lr per 512 images, as every stage did: the fine-tune's rule changes nothing."""
    assert _built_lr(["stage=finetune"]) == pytest.approx(5e-6)
    digests = [identity_of(["stage=finetune", *rule]).digest for rule in ([], ["finetune.lr_base_batch=512"],
                                                                           ["finetune.lr_base_batch=256"])]
    assert digests[0] == digests[1] != digests[2]


TRANSFERS = ("cifar10", "cifar100", "flowers", "cars", "inat18", "inat19")


@pytest.mark.parametrize("row", TRANSFERS)
def test_every_transfer_normalises_with_imagenets_statistics(row):
    """The pretrained backbone expects ImageNet's mean and std (the released datasets.py uses them for every set)."""
    cfg = _applied([f"transfer={row}", "preset=paper"])
    assert list(cfg.data.mean) == IMAGENET_MEAN and list(cfg.data.std) == IMAGENET_STD


def test_transfer_schedules_are_caits_per_dataset():
    """CaiT section 4.3: 1000 epochs for CIFAR-10/100, Flowers and Cars, 360 for iNaturalist 2018 and 2019."""
    epochs = {row: _applied([f"transfer={row}", "preset=paper"]).train.epochs for row in TRANSFERS}
    assert epochs == {"cifar10": 1000, "cifar100": 1000, "flowers": 1000, "cars": 1000, "inat18": 360, "inat19": 360}
    assert compose_config(["data=cifar10"]).data.mean[0] == 0.4914  # training from scratch keeps CIFAR's


@pytest.mark.slow  # a whole fine-tune process (~10 s); .ci/run runs it
def test_a_fine_tune_trains_with_its_override_set_and_says_so(tmp_path, data_cache, tiny_run):
    """End to end: the fine-tune of TINY's pre-training with a set of its own; its log names each change, and
    wandb holds the composed config (the set in it)."""
    tiny_run.copy_into(tmp_path)
    proc = run_train([*TINY, "stage=finetune", "finetune.epochs=1", "++finetune.overrides.mix.label_smoothing=0.3",
                      "++finetune.overrides.augment.repeated_aug=1"], tmp_path, data_cache)
    assert "[run] the finetune runs its pre-training's config with:" in proc.stdout + proc.stderr
    log = proc.stdout + proc.stderr
    assert "mix.label_smoothing 0.1 -> 0.3" in log and "augment.repeated_aug 3 -> 1" in log


def _changes(overrides: list[str]) -> str | None:
    """The log line a run of `overrides` writes about what its stage changes (as run/main.py writes it)."""
    cfg = compose_config(overrides)
    lineage = Lineage.of(cfg, overrides)
    compared = compared_config(lineage)
    return changes_line(lineage, stage_changes(cfg if compared is None else compared, stage_config(cfg)))


def test_a_transfers_log_names_its_source_and_every_key_that_differs_from_it():
    """The demo's transfer starts from the fine-tune (3 epochs at 48 px on `shapes`): the line names that source and
    what differs from it, not from the pre-training (10 epochs at 32 px); from the pre-training, the 32 -> 48 px."""
    line = _changes(["transfer=builtin_b"])
    start = "the transfer runs the config of its source run (transfer.source_stage=finetune) with:"
    assert line.startswith(start), line
    assert "train.epochs 3 -> 5" in line and "data.builtin.classes shapes -> shapes_b" in line, line
    assert "resolution.train_size" not in line, line  # the fine-tune is at 48 px already
    line = _changes(["transfer=builtin_b", "transfer.source_stage=pretrain"])
    assert "resolution.train_size 32 -> 48" in line and "resolution.eval_size 32 -> 48" in line, line
    assert "train.epochs 10 -> 5" in line, line


def test_a_fine_tunes_log_names_the_size_it_changes():
    line = _changes(["stage=finetune"])
    assert line.startswith("the finetune runs its pre-training's config with:"), line
    assert "resolution.train_size 32 -> 48" in line and "train.epochs 10 -> 3" in line, line
    assert _changes([]) is None


def test_stage_changes_of_a_pretraining_are_none():
    cfg = compose_config([])
    assert stage_changes(cfg, stage_config(cfg)) == []


@pytest.mark.parametrize("preset", ["demo", "paper"])
@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_the_deit3_option_and_the_studys_baseline_are_one_recipe(preset, stage):
    """deit3=baseline is recipe=deit3 on ViT-B: at demo scale they once differed (lr 3e-3 against 1e-3 at batch 128,
    drop path 0.05 against 0.1)."""
    option, row = (_applied([choice, f"preset={preset}", f"stage={stage}", "model=vit_base"])
                   for choice in ("recipe=deit3", "deit3=baseline"))
    for node in ("optimizer", "train", "model", "augment", "mix", "resolution", "finetune"):
        assert option[node] == row[node], node


def test_per_batch_computations_are_the_stages_own():
    """A fine-tune that mixes where its pre-training did not: Mixup/CutMix is per micro-batch in that stage."""
    from deit_ablate.run.validate import per_batch_computations

    cfg = compose_config(["mix=none", "stage=finetune", "++finetune.overrides.mix.mixup_alpha=0.8"])
    assert any("Mixup/CutMix" in item for item in per_batch_computations(cfg))
    assert not any("Mixup/CutMix" in item for item in per_batch_computations(compose_config(["mix=none"])))
