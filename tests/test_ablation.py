"""Table 8 as override sets: each row changes exactly its ingredient; the whole table runs in one sweep."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.record.identity import composed_choices, experiment
from deit_ablate.record.overrides import pretrain_overrides
from deit_ablate.record.rundir import RESULT, RunDir, runs_root, wandb_root
from deit_ablate.run.stages import load_pretrained
from deit_ablate.train.models import build_model, resize_pos_embed_state
from tests.conftest import CONF, TINY, compose_config, identity_of, run_train, study_rows

# Table 8's rows and the one ingredient each changes (DeiT, Table 8).
ROWS = {
    "baseline": {},
    "sgd": {"optimizer.name": "sgd"},
    "sgd_finetune": {"finetune.optimizer": "sgd"},
    "no_randaugment": {"augment.auto_augment": None},
    "autoaugment": {"augment.auto_augment": "original"},
    "no_mixup": {"mix.mixup_alpha": 0.0},
    "no_cutmix": {"mix.cutmix_alpha": 0.0},
    "no_mixup_cutmix": {"mix.mixup_alpha": 0.0, "mix.cutmix_alpha": 0.0},
    "no_erasing": {"augment.reprob": 0.0},
    "no_drop_path": {"model.drop_path": 0.0},
    "no_repeated_aug": {"augment.repeated_aug": 1},
    "dropout": {"model.dropout": 0.1},
    "ema": {"train.ema": True},
}


def _composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def _flat(cfg) -> dict:
    out = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    experiment_part = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])  # Hydra's node: choices
    walk(OmegaConf.to_container(experiment_part, resolve=True), "")
    return out


def test_every_row_of_table_8_has_an_option_and_nothing_else_does():
    assert sorted(p.stem for p in (CONF / "ablation").glob("*.yaml")) == sorted(ROWS)


@pytest.mark.parametrize("preset", ["demo", "paper"])
@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
@pytest.mark.parametrize("row", sorted(ROWS))
def test_row_differs_from_baseline_only_in_its_ingredient_and_tag(row, stage, preset):
    base = _composed([f"preset={preset}", f"stage={stage}", "ablation=baseline"])
    ours = _composed([f"preset={preset}", f"stage={stage}", f"ablation={row}"])
    flat_base, flat_ours = _flat(base), _flat(ours)
    diff = {key: flat_ours[key] for key in flat_ours if flat_ours[key] != flat_base.get(key)}
    assert set(flat_ours) == set(flat_base)
    assert diff == ROWS[row]
    # the row's tag: Hydra's choice, which the experiment (its name and wandb id) carries as `ablation`
    assert ours.hydra.runtime.choices.ablation == row
    assert experiment(ours, choices=composed_choices(ours))["ablation"] == row


def test_pretrained_rows_find_their_own_pretraining_same_seed():
    finetune = ["ablation=no_mixup", "seed=2", "stage=finetune", "resolution=384px", "finetune.lr=1e-3"]
    assert pretrain_overrides(finetune) == ["ablation=no_mixup", "seed=2"]
    upstream = identity_of(pretrain_overrides(finetune))
    pretrain = ["ablation=no_mixup", "seed=2", "finetune.lr=1e-3"]  # the fine-tune recipe never counts in pre-training
    assert upstream == identity_of(pretrain)
    assert upstream != identity_of(["ablation=no_mixup", "seed=1"])
    assert upstream != identity_of(["seed=2"])  # the row is in the identity


def test_finetune_resizes_position_embeddings_bicubically_and_keeps_the_class_token():
    cfg = compose_config([])
    small = build_model(cfg.model, 10, img_size=32)
    large = build_model(cfg.model, 10, img_size=48)
    state = small.state_dict()
    resized = resize_pos_embed_state(state, large)
    assert resized["pos_embed"].shape == large.pos_embed.shape == (1, 1 + 36, 128)
    assert torch.equal(resized["pos_embed"][:, :1], state["pos_embed"][:, :1])
    grid = state["pos_embed"][:, 1:].reshape(1, 4, 4, 128).permute(0, 3, 1, 2)
    by_hand = torch.nn.functional.interpolate(grid, size=(6, 6), mode="bicubic", align_corners=False)
    assert torch.allclose(resized["pos_embed"][:, 1:], by_hand.permute(0, 2, 3, 1).reshape(1, 36, 128), atol=1e-6)


def test_load_pretrained_takes_a_checkpoint_of_another_resolution(tmp_path):
    cfg = compose_config([])
    small = build_model(cfg.model, 10, img_size=32)
    torch.save({"model": small.state_dict(), "epoch": 3}, RunDir(tmp_path).last_checkpoint)
    large = build_model(cfg.model, 10, img_size=48)
    load_pretrained(large, RunDir(tmp_path).last_checkpoint)
    assert torch.equal(large.blocks[0].attn.qkv.weight, small.blocks[0].attn.qkv.weight)
    assert large.pos_embed.shape[1] == 37


@pytest.mark.slow
def test_whole_table_both_stages_in_one_sweep_lands_a_run_per_row_and_stage(tmp_path, data_cache):
    proc = run_train(["-m", "ablation=glob(*)", "stage=pretrain,finetune", "train.max_steps=2"] + TINY, tmp_path,
                     data_cache)
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    rows = study_rows("ablation")
    assert len(runs) == 2 * len(rows) and len({run.run_id for run in runs}) == 2 * len(rows)
    seen = {(run.config["ablation"], run.config["stage"]) for run in runs}
    assert seen == {(row, stage) for row in rows for stage in ("pretrain", "finetune")}
    for run in runs:
        assert run.summary["status"] == "finished"
        assert set(run.tags) == {run.config["ablation"], run.config["stage"], "demo"}
        size = run.config["resolution"]["train_size"]
        assert size == (48 if run.config["stage"] == "finetune" else 32)
    ema = next(r for r in runs if r.config["ablation"] == "ema" and r.config["stage"] == "pretrain")
    assert ema.summary["top1"] == ema.summary["top1_ema_final"]  # the EMA weights are the row's result
    sgd_ft = next(r for r in runs if r.config["ablation"] == "sgd_finetune" and r.config["stage"] == "finetune")
    assert sgd_ft.config["finetune"]["optimizer"] == "sgd" and sgd_ft.config["optimizer"]["name"] == "adamw"
    assert proc.stdout.count("finetune at 48px") == len(rows)


@pytest.mark.slow
def test_relaunched_sweep_skips_finished_runs_and_resumes_the_rest(tmp_path, data_cache):
    sweep = ["-m", "ablation=baseline,no_mixup", "stage=pretrain,finetune", "train.max_steps=9",
             "train.epochs=2"] + TINY
    run_train(sweep, tmp_path, data_cache)
    runs_dir = runs_root(tmp_path / "outputs")
    interrupted = next(p for p in runs_dir.glob("ablation=no_mixup,*")
                       if "stage=finetune" in RunDir(p).hydra_overrides.read_text())
    RunDir(interrupted).result.unlink()  # killed after its first epoch's checkpoint
    proc = run_train(sweep, tmp_path, data_cache)
    assert proc.stdout.count("already finished") == 3
    assert proc.stdout.count("resuming") == 1
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert len({run.run_id for run in runs}) == 4  # one wandb run per identity, whatever the relaunches


def test_diverged_pretraining_gives_a_diverged_finetune_without_training(tmp_path, data_cache):
    sweep = ["-m", "ablation=no_erasing", "stage=pretrain,finetune", "optimizer.lr=1e12",
             "optimizer.warmup_epochs=0"] + TINY
    run_train(sweep, tmp_path, data_cache)
    results = [json.loads(p.read_text()) for p in (runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}")]
    assert sorted(r["status"] for r in results) == ["diverged", "diverged"]
    assert any("not fine-tuned" in r.get("note", "") for r in results)
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert sorted(r.summary["status"] for r in runs) == ["diverged", "diverged"]


def test_finetune_before_pretraining_is_a_clear_error(tmp_path, data_cache):
    proc = run_train(["stage=finetune"] + TINY, tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "has not finished" in proc.stderr and "stage=pretrain,finetune" in proc.stderr
    assert not (runs_root(tmp_path / "outputs")).exists() or not any((runs_root(tmp_path / "outputs")).iterdir())



@pytest.mark.slow
def test_resolution_sweep_fine_tunes_one_pretrained_checkpoint_at_each_size(tmp_path, data_cache):
    run_train(TINY + ["train.max_steps=2"], tmp_path, data_cache)
    proc = run_train(["-m", "stage=finetune", "resolution=24px,48px", "train.max_steps=2"] + TINY, tmp_path,
                     data_cache)
    sizes = sorted(int(size) for size in re.findall(r"finetune at (\d+)px", proc.stdout))
    assert sizes == [24, 48]
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    finetunes = [r for r in runs if r.config["stage"] == "finetune"]
    assert sorted(r.config["resolution"]["train_size"] for r in finetunes) == [24, 48]
    assert all(r.summary["status"] == "finished" for r in runs)
