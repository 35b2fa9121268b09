"""The sharpness study (Chen, Hsieh & Gong 2022) and the original ViT recipe it starts from: the recipe is the left
column of DeiT's Table 9 (Touvron et al. 2021) with the ViT paper's open values (Dosovitskiy et al. 2021,
appendix B.1), each row changes only its ingredient, the study is found with its numbers, and a row trains."""

from __future__ import annotations

import json

import pytest

from deit_ablate.config.studies import CONF_DIR, paper_tables, studies
from deit_ablate.record.rundir import RESULT, runs_root
from deit_ablate.train.optim import scaled_lr
from tests.conftest import CONF, TINY, compose_config, identity_of, one_class_imagefolder, run_train
from tests.test_ablation import _composed, _flat

STUDY = "sam"
# Each row: the row it extends and what it changes there, at paper scale and at demo scale.
SGD = {"optimizer.name": "sgd", "optimizer.lr_base_batch": 512, "optimizer.weight_decay": 1e-4}
AUGMENT = {"augment.auto_augment": "rand-m9-mstd0.5-inc1", "mix.mixup_alpha": 0.8}
ROWS: dict[str, tuple[str | None, dict, dict]] = {
    "baseline": (None, {}, {}),
    **{f"rho_{tag}": ("baseline", *[{"optimizer.sam_rho": rho}] * 2)
       for tag, rho in (("005", 0.05), ("01", 0.1), ("02", 0.2), ("025", 0.25))},
    # at demo scale the recipe's lr is already per 512 images
    "sgd": ("baseline", {**SGD, "optimizer.lr": 0.03},
            {"optimizer.name": "sgd", "optimizer.weight_decay": 1e-4, "optimizer.lr": 0.4}),
    "sgd_rho_02": ("sgd", *[{"optimizer.sam_rho": 0.2}] * 2),
    "augment": ("baseline", AUGMENT, AUGMENT),
    "augment_rho_02": ("augment", *[{"optimizer.sam_rho": 0.2}] * 2),
    "epochs_600": ("baseline", {"train.epochs": 600}, {"train.epochs": 20}),
    "resnet152_rho_005": ("resnet152", *[{"optimizer.sam_rho": 0.05}] * 2),
    "mixer_rho_02": ("mixer", *[{"optimizer.sam_rho": 0.2}] * 2),
    "hybrid_rho_02": ("hybrid", *[{"optimizer.sam_rho": 0.2}] * 2),
    # a tenth of ImageNet-1k: the baseline, augment and ViT-SAM rows with data.fraction = 0.1
    **{f"tenth{tag}": (row, *[{"data.fraction": 0.1}] * 2)
       for tag, row in (("", "baseline"), ("_augment", "augment"), ("_rho_02", "rho_02"))},
}
# Rows of another network: the baseline's recipe, their own model option (tests/test_sam_models.py builds them).
NETWORKS = {"resnet152": "resnet152", "mixer": "mixer_b16", "hybrid": "vit_hybrid_r50_b16"}
# The paper's numbers (top-1 at 224) and sharpness figures, as the chapter's SAM boxes quote Chen et al.
TOP1 = {"baseline": 74.6, "rho_005": 77.5, "rho_01": 78.8, "rho_02": 79.9, "rho_025": 79.3, "sgd": 71.5,
        "sgd_rho_02": 79.1, "augment": 79.6, "augment_rho_02": 81.5, "epochs_600": None, "resnet152": 78.5,
        "resnet152_rho_005": 79.3, "mixer": 66.4, "mixer_rho_02": 77.4, "hybrid": None, "hybrid_rho_02": None,
        "tenth": 32.8, "tenth_augment": 38.5, "tenth_rho_02": 46.1}
SHARPNESS = {"baseline": {"lambda_max": 738.8, "train_loss": 0.65, "noisy_loss": 6.66},
             "rho_02": {"lambda_max": 20.9, "train_loss": 0.82},
             "augment": {"lambda_max": 1659.3, "noisy_loss": 1.23},
             "resnet152": {"lambda_max": 179.8, "train_loss": 0.86, "noisy_loss": 2.39},
             "mixer": {"lambda_max": 1644.4, "train_loss": 0.45, "noisy_loss": 7.78}}
# Hydra's own keys and the row's choices differ between any two rows by construction.
CHOICE_KEYS = ("hydra.",)


def _row(row: str, preset: str) -> dict:
    return {k: v for k, v in _flat(_composed([f"{STUDY}={row}", f"preset={preset}"])).items()
            if not k.startswith(CHOICE_KEYS)}


def _changes(row: dict, base: dict) -> dict:
    return {k: row[k] for k in row if row[k] != base.get(k)}


def test_every_row_has_an_option_and_a_paper_row_in_order_and_the_study_is_found():
    options = sorted(p.stem for p in (CONF / STUDY).glob("*.yaml"))
    assert options == sorted([*ROWS, *NETWORKS])
    table = paper_tables()[STUDY]
    assert [r["key"] for r in table["rows"]] == list(TOP1)
    assert {r["key"]: r["pretrain"] for r in table["rows"]} == TOP1
    assert {r["key"]: r["sharpness"] for r in table["rows"] if "sharpness" in r} == SHARPNESS
    assert table["columns"] == {"pretrain": "224"} and table["default"] is None
    assert "Chen, Hsieh, Gong (2022)" in table["citation"] and "arXiv:2106.01548" in table["citation"]
    study = next(s for s in studies() if s.name == STUDY)
    assert study.baseline == "baseline" and study.default is None and study.rows == tuple(TOP1)
    assert CONF_DIR == CONF  # the registry reads this checkout's folders
    for r in table["rows"]:  # every compared row names a row of the table
        assert r.get("baseline", "baseline") in TOP1
    # the one row without a number says why (the text: 600 epochs "changes nothing")
    assert "no number" in next(r for r in table["rows"] if r["key"] == "epochs_600")["note"]
    notes = {r["key"]: r.get("note", "") for r in table["rows"]}
    # the hybrid's plain top-1 is not in the text, SAM's gain is: in its note, the schema having no delta field
    assert "not in our texts" in notes["hybrid"] and "+2.7 points" in notes["hybrid_rho_02"]
    assert "11.0" in notes["mixer_rho_02"]


@pytest.mark.parametrize("preset", ["paper", "demo"])
@pytest.mark.parametrize("row", ["mixer", "hybrid"])
def test_a_network_row_is_the_baseline_with_its_own_model(row, preset):
    changed = _changes(_row(row, preset), _row("baseline", preset))
    model = _flat(compose_config([f"model={NETWORKS[row]}", f"preset={preset}"]))
    assert changed and all(k.startswith("model.") for k in changed)
    assert changed == {k: model[k] for k in changed}  # the model option's name and sizes
    assert _row(row, preset)["model.dropout"] == 0.1  # the recipe's


def test_the_baseline_at_paper_scale_is_the_original_vit_recipe():
    """DeiT Table 9's left column, with the ViT paper's clipping norm, betas and schedule ends (appendix B.1)."""
    cfg = _row("baseline", "paper")
    assert cfg["model.name"] == "vit_base_patch16_224"
    assert {k: cfg[f"model.kwargs.{k}"] for k in ("patch_size", "embed_dim", "depth", "num_heads")} == \
        {"patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12}
    assert cfg["train.global_batch"] == 4096 and cfg["train.epochs"] == 300 and not cfg["train.ema"]
    assert cfg["optimizer.name"] == "adamw"
    assert scaled_lr(cfg["optimizer.lr"], 4096, cfg["optimizer.lr_base_batch"]) == pytest.approx(3e-3, rel=1e-12)
    assert cfg["optimizer.weight_decay"] == 0.3 and cfg["optimizer.betas"] == [0.9, 0.999]
    assert cfg["optimizer.sched"] == "cosine" and cfg["optimizer.warmup_epochs"] == 3.4
    assert cfg["optimizer.warmup_lr"] == 0.0 and cfg["optimizer.min_lr"] == 0.0
    assert cfg["optimizer.clip_grad"] == 1.0 and cfg["optimizer.sam_rho"] == 0.0
    assert cfg["mix.label_smoothing"] == 0.0 and cfg["mix.mixup_alpha"] == 0.0 and cfg["mix.cutmix_alpha"] == 0.0
    assert cfg["model.dropout"] == 0.1 and cfg["model.drop_path"] == 0.0
    assert cfg["augment.repeated_aug"] == 1 and cfg["augment.auto_augment"] is None
    assert cfg["augment.reprob"] == 0.0 and cfg["augment.color_jitter"] == 0.0  # timm jitters when no policy is on
    assert cfg["augment.scale"] == [0.08, 1.0] and cfg["augment.hflip"] == 0.5  # Inception-style crop and flip
    assert cfg["resolution.train_size"] == 224 and cfg["data.name"] == "imagenet"


@pytest.mark.parametrize("preset", ["paper", "demo"])
@pytest.mark.parametrize("row", [r for r in ROWS if ROWS[r][0]])
def test_row_differs_from_its_own_baseline_only_in_its_ingredient(row, preset):
    base, paper, demo = ROWS[row]
    assert _changes(_row(row, preset), _row(base, preset)) == (paper if preset == "paper" else demo)


def test_the_sgd_rows_lr_at_the_papers_batch():
    cfg = _row("sgd", "paper")  # 0.03 per 512 images (ViT paper's SGD grid), linear in the batch
    assert scaled_lr(cfg["optimizer.lr"], cfg["train.global_batch"], cfg["optimizer.lr_base_batch"]) == \
        pytest.approx(0.24)
    assert cfg["optimizer.momentum"] == 0.9 and cfg["optimizer.clip_grad"] == 1.0


def test_resnet152_row_trains_resnets_sgd_recipe_on_the_same_crops():
    paper, demo = _row("resnet152", "paper"), _row("resnet152", "demo")
    assert paper["model.name"] == "resnet152" and demo["model.name"] == "resnet10t"
    assert paper["train.epochs"] == 90 and paper["optimizer.name"] == "sgd"
    assert scaled_lr(paper["optimizer.lr"], 4096, paper["optimizer.lr_base_batch"]) == pytest.approx(1.6)
    assert paper["optimizer.weight_decay"] == 1e-4 and paper["optimizer.clip_grad"] is None
    assert paper["model.dropout"] == 0.0
    base = _row("baseline", "paper")
    for key in ("augment.auto_augment", "augment.color_jitter", "augment.reprob", "augment.repeated_aug",
                "mix.mixup_alpha", "mix.cutmix_alpha", "mix.label_smoothing", "train.global_batch"):
        assert paper[key] == base[key], key


def test_demo_rows_train_the_demo_vit_at_the_demo_batch():
    demo = _row("baseline", "demo")
    assert {k: demo[f"model.kwargs.{k}"] for k in ("patch_size", "embed_dim", "depth", "num_heads")} == \
        {"patch_size": 8, "embed_dim": 128, "depth": 6, "num_heads": 4}  # the demo preset's vit_demo
    assert demo["train.global_batch"] == 128 and demo["train.epochs"] == 10
    assert scaled_lr(demo["optimizer.lr"], 128, demo["optimizer.lr_base_batch"]) == pytest.approx(1e-3)
    assert demo["optimizer.clip_grad"] == 1.0 and demo["optimizer.weight_decay"] == 0.3


def test_recipe_deit_is_the_default_and_sets_nothing():
    default, explicit = compose_config([]), compose_config(["recipe=deit"])
    assert default == explicit
    assert identity_of(["ablation=baseline"]).digest == identity_of(["recipe=deit"]).digest


def test_recipe_vit_original_applies_over_any_study_row_and_the_preset():
    """The recipe comes after the preset and the ingredient groups: it wins over both; a study row comes after it."""
    cfg = _flat(_composed(["recipe=vit_original", "ablation=baseline", "preset=paper"]))
    assert cfg["optimizer.weight_decay"] == 0.3 and cfg["mix.label_smoothing"] == 0.0
    assert cfg["train.global_batch"] == 4096 and cfg["augment.repeated_aug"] == 1
    assert cfg["model.name"] == "deit_base_patch16_224"  # the recipe is the training, not the model
    demo = _flat(_composed(["recipe=vit_original", "ablation=dropout"]))
    assert demo["optimizer.warmup_epochs"] == 1.0 and demo["train.global_batch"] == 128  # the demo's scale
    assert _flat(_composed(["recipe=vit_original", "ablation=ema"]))["train.ema"] is True  # the row wins


def test_the_aggregator_shows_each_rows_paper_number_and_its_delta_to_its_own_baseline():
    from deit_ablate.analysis.aggregate.table import build_table

    table = build_table([], rows=STUDY, paper=STUDY)  # the rows without runs: the paper's columns only
    cells = {r.key: r.cells["pretrain"] for r in table.rows}
    assert [r.key for r in table.rows] == list(TOP1) and {k: c.paper for k, c in cells.items()} == TOP1
    deltas = {k: cells[k].paper_delta for k in ("mixer_rho_02", "tenth_augment", "tenth_rho_02", "hybrid_rho_02")}
    assert deltas == {"mixer_rho_02": pytest.approx(11.0), "tenth_augment": pytest.approx(5.7),
                      "tenth_rho_02": pytest.approx(13.3), "hybrid_rho_02": None}  # the hybrid's: in its note
    assert "+2.7 points" in next(r for r in table.rows if r.key == "hybrid_rho_02").note


@pytest.mark.slow
def test_the_dry_run_lists_every_row_at_paper_scale(tmp_path, data_cache):
    data = one_class_imagefolder(tmp_path / "imagenet")
    proc = run_train(["-m", f"{STUDY}=glob(*)", "runtime.dry_run=true", "preset=paper", *data], tmp_path, data_cache)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[dry run]")]
    names = sorted(line.split(f"{STUDY}=", 1)[1].split("-", 1)[0] for line in lines)
    assert names == sorted(TOP1) and all(line.endswith("train from step 0") for line in lines)
    assert not (tmp_path / "outputs" / "runs").exists() or not any((tmp_path / "outputs" / "runs").iterdir())


@pytest.mark.slow
def test_a_demo_row_trains_two_steps(tmp_path, data_cache):
    run_train([f"{STUDY}=rho_02", "train.max_steps=2"] + TINY, tmp_path, data_cache)
    results = [json.loads(p.read_text()) for p in runs_root(tmp_path / "outputs").glob(f"{STUDY}=rho_02*/{RESULT}")]
    assert [(r["status"], r["steps_done"]) for r in results] == [("finished", 2)]


# The demo rows of the other networks and of a tenth (of 320 images per class: 32 kept), each 2 steps of a tiny
# size (their widths, 1 block).
TINY_NETWORKS = {"mixer_rho_02": ["model.kwargs.num_blocks=1", "model.kwargs.embed_dim=32"],
                 "hybrid_rho_02": ["model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"],
                 "tenth_rho_02": [o for o in TINY if o.startswith("model.")] + ["data.builtin.train_per_class=320"]}


@pytest.mark.slow
@pytest.mark.parametrize("row", sorted(TINY_NETWORKS))
def test_the_new_demo_rows_train_two_steps(row, tmp_path, data_cache):
    tiny = [o for o in TINY if not o.startswith("model.")] + TINY_NETWORKS[row]
    proc = run_train([f"{STUDY}={row}", "train.max_steps=2", *tiny], tmp_path, data_cache)
    results = [json.loads(p.read_text()) for p in runs_root(tmp_path / "outputs").glob(f"{STUDY}={row}*/{RESULT}")]
    assert [(r["status"], r["steps_done"]) for r in results] == [("finished", 2)]
    if row.startswith("tenth"):
        assert "training on 320 of the 3200 training images" in proc.stdout + proc.stderr
