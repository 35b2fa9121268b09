"""The study of the recipe after DeiT: DeiT III's ingredients (Touvron, Cord & Jégou 2022), registers (Darcet et al.
2024), layer-wise lr decay (Clark et al. 2020; Bao et al. 2022) and patient and consistent teaching (Beyer et al.
2022). The study is found with the chapter's numbers, each row changes only its ingredient at both scales and both
stages, the baseline is DeiT III's released ViT-B recipe, and a paper-scale dry run lists every row."""

from __future__ import annotations

import functools
import json
import re

import pytest
import timm
import torch

from deit_ablate.analysis.aggregate.reader import RunInfo
from deit_ablate.analysis.aggregate.render import render, to_json_dict
from deit_ablate.analysis.aggregate.table import build_table
from deit_ablate.config.studies import CONF_DIR, paper_tables, studies
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.identity import composed_choices, run_identity
from deit_ablate.record.rundir import RESULT, RunDir, runs_root
from deit_ablate.run.lifecycle import dry_run_line
from deit_ablate.run.plan import make_plan
from deit_ablate.run.validate import check_pretrain_size, validate_config
from deit_ablate.train.optim import scaled_lr
from tests.conftest import CONF, TINY, compose_config, identity_of, one_class_imagefolder, run_train
from tests.test_ablation import _composed, _flat

STUDY = "deit3"
RA = {"augment.auto_augment": "rand-m9-mstd0.5-inc1", "augment.three_augment": False}
FT_224 = {"finetune.micro_batch": 64, "finetune.overrides.model.drop_path": 0.2}
FT_224_DEMO = {"finetune.overrides.model.drop_path": 0.1}
# Each row: the row it extends and what it changes there, at paper and demo scale, in (pre-training, fine-tune).
LONGER = (1200, 4800, 9600)  # Beyer et al.'s longer schedules, in epochs
ROWS: dict[str, tuple[str, dict, dict, dict, dict]] = {
    "randaugment": ("baseline", RA, RA, RA, RA),
    "epochs_300": ("baseline", *[{"train.epochs": 300}] * 2, *[{"train.epochs": 4}] * 2),
    "epochs_300_ce": ("epochs_300", *[{"mix.criterion": "ce"}] * 4),
    # 224 throughout: the fine-tune at 224 (demo: 32), not the preset's 384 (48), as DeiT III's 224 fine-tune (its
    # micro-batch and drop path: the finetune block, in both stages' config)
    "res_224": ("baseline", {**FT_224}, {"resolution.train_size": 224, "resolution.eval_size": 224, **FT_224},
                {**FT_224_DEMO}, {"resolution.train_size": 32, "resolution.eval_size": 32, **FT_224_DEMO}),
    # low-resolution pre-training, then the same fine-tune as res_224; the fine-tune names the pre-training's size
    "res_128": ("res_224", {"resolution.train_size": 128, "resolution.eval_size": 128, "finetune.pretrain_size": 128},
                {"finetune.pretrain_size": 128},
                {"resolution.train_size": 24, "resolution.eval_size": 24, "finetune.pretrain_size": 24},
                {"finetune.pretrain_size": 24}),
    **{f"registers_{n}": ("baseline", *[{"model.kwargs.reg_tokens": n}] * 4) for n in (1, 4)},
    **{f"layer_decay_{tag}": ("baseline", *[{"finetune.layer_decay": z}] * 4)
       for tag, z in (("065", 0.65), ("075", 0.75), ("08", 0.8))},
    "teach_consistent": ("teach_fixed", *[{"distill.teacher_view": "same"}] * 4),
    # both of Beyer et al.'s ingredients against the fixed view, as their table compares them
    "teach_function_matching": ("teach_fixed", *[{"distill.teacher_view": "same", "mix.mixup_alpha": 1.0}] * 4),
    # patience: the same two rows for longer, the demo at the paper's epochs / 30 (the 300-epoch rows' 10 demo epochs)
    **{f"{row}_{n}": (row, *[{"train.epochs": n}] * 2, *[{"train.epochs": n // 30}] * 2)
       for row in ("teach_fixed", "teach_function_matching") for n in LONGER},
    # the stronger teacher: the same one at 224 and 384 px (demo: 32 and 48), its logits averaged
    "teach_function_matching_9600_224_384": ("teach_function_matching_9600", {"distill.teacher.sizes": [224, 384]},
                                             {"distill.teacher.sizes": [224, 384]},
                                             *[{"distill.teacher.sizes": [32, 48]}] * 2),
    # the label-only student: teach_fixed's without a teacher, its KL settings back to the schema's
    "teach_labels": ("teach_fixed", *[{"distill.type": "none", "distill.alpha": 0.0, "distill.kl_normalization":
                                       "elements", "distill.teacher_view": "same"}] * 4),
}
# The chapter's numbers: (top-1 from scratch, after the fine-tune); None: not in the text.
PAPER = {"baseline": (83.1, None), "randaugment": (82.7, None), "epochs_300": (82.2, None),
         "epochs_300_ce": (80.9, None), "res_224": (None, 84.6), "res_128": (None, 85.1),
         "registers_1": (None, None), "registers_4": (None, None), "layer_decay_065": (None, None),
         "layer_decay_075": (None, None), "layer_decay_08": (None, None), "teach_fixed": (77.8, None),
         "teach_fixed_1200": (78.1, None), "teach_fixed_4800": (77.6, None), "teach_fixed_9600": (77.0, None),
         "teach_consistent": (None, None), "teach_function_matching": (80.3, None),
         "teach_function_matching_1200": (81.5, None), "teach_function_matching_4800": (82.2, None),
         "teach_function_matching_9600": (82.3, None), "teach_function_matching_9600_224_384": (82.8, None),
         "teach_labels": (78.2, None)}


@functools.cache  # a row's base is composed once for all the rows that extend it
def _row(row: str, preset: str, stage: str = "pretrain") -> dict:
    cfg = _flat(_composed([f"{STUDY}={row}", f"preset={preset}", f"stage={stage}"]))
    return {k: (v.value if hasattr(v, "value") else v) for k, v in cfg.items() if not k.startswith("hydra.")}


def _changes(row: dict, base: dict) -> dict:
    return {k: row[k] for k in row if row[k] != base.get(k)}


def _check_pretrain_size(cfg):
    check_pretrain_size(cfg.stage, cfg.finetune.pretrain_size, cfg.resolution.train_size)


def test_the_study_is_found_with_its_rows_in_order_and_the_chapters_numbers():
    study = next(s for s in studies() if s.name == STUDY)
    assert CONF_DIR == CONF  # the registry reads this checkout's folders
    assert study.baseline == "baseline" and study.default is None and study.rows == tuple(PAPER)
    assert sorted(p.stem for p in (CONF / STUDY).glob("*.yaml")) == sorted(PAPER)
    table = paper_tables()[STUDY]
    assert {r["key"]: (r["pretrain"], r["finetune"]) for r in table["rows"]} == PAPER
    assert table["absent"] == "not in the text" and table["columns"]["pretrain"] == "224"
    for cited in ("arXiv:2204.07118", "arXiv:2309.16588", "arXiv:2106.05237"):
        assert cited in table["citation"]
    rows = {r["key"]: r for r in table["rows"]}
    for key, (base, *_) in ROWS.items():  # each compared row names the row it extends
        assert rows[key]["baseline"] == base, key
    assert all("ViT-H" in rows[k]["label"] for k in ("res_224", "res_128"))  # the chapter's figures are ViT-H's
    assert all("ResNet-50" in rows[k]["label"] for k in PAPER if k.startswith("teach_"))  # the student's


@pytest.mark.parametrize("preset", ["paper", "demo"])
@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
@pytest.mark.parametrize("row", list(ROWS))
def test_row_differs_from_its_own_baseline_only_in_its_ingredient(row, stage, preset):
    base, paper_pre, paper_ft, demo_pre, demo_ft = ROWS[row]
    want = {("paper", "pretrain"): paper_pre, ("paper", "finetune"): paper_ft,
            ("demo", "pretrain"): demo_pre, ("demo", "finetune"): demo_ft}[preset, stage]
    assert _changes(_row(row, preset, stage), _row(base, preset, stage)) == want


def test_the_baseline_is_deit3s_released_vit_b_recipe():
    """ViT-B's values of the released DeiT III command: LAMB 3e-3 at batch 2048, BCE, 3-Augment, no erasing."""
    cfg = _row("baseline", "paper")
    assert cfg["model.name"] == "vit_base_patch16_224" and cfg["model.kwargs.depth"] == 12
    assert cfg["model.kwargs.init_values"] == 1e-4 and cfg["model.kwargs.drop_path_schedule"] == "uniform"
    assert cfg["model.drop_path"] == 0.2 and "model.kwargs.reg_tokens" not in cfg  # no registers
    assert cfg["optimizer.name"] == "lamb" and cfg["train.global_batch"] == 2048 and cfg["train.epochs"] == 800
    assert scaled_lr(cfg["optimizer.lr"], 2048, cfg["optimizer.lr_base_batch"]) == pytest.approx(3e-3)
    assert cfg["optimizer.weight_decay"] == 0.05 and cfg["optimizer.warmup_epochs"] == 5
    assert cfg["optimizer.warmup_lr"] == 1e-6 and cfg["optimizer.min_lr"] == 1e-5
    assert cfg["augment.three_augment"] is True and cfg["augment.auto_augment"] is None
    assert cfg["augment.color_jitter"] == 0.3 and cfg["augment.reprob"] == 0.0 and cfg["augment.repeated_aug"] == 3
    assert cfg["augment.crop"] == "rrc"  # simple random crop is DeiT III's ImageNet-21k choice, not 1k's
    assert cfg["mix.criterion"] == "bce" and cfg["mix.label_smoothing"] == 0.0
    assert cfg["mix.mixup_alpha"] == 0.8 and cfg["mix.cutmix_alpha"] == 1.0
    assert cfg["resolution.train_size"] == 224 and cfg["resolution.crop_pct"] == 1.0
    assert cfg["distill.type"] == "none" and cfg["finetune.layer_decay"] is None


def test_the_fine_tune_is_deit3s_released_fine_tune_command():
    """AdamW, lr 1e-5 at the fine-tune's batch of 512, weight decay 0.1, 20 epochs (5 warm-up), train mode."""
    cfg = _row("baseline", "paper", "finetune")
    assert cfg["finetune.optimizer"] == "adamw" and cfg["finetune.global_batch"] == 512
    assert scaled_lr(cfg["finetune.lr"], 512, cfg["finetune.lr_base_batch"]) == pytest.approx(1e-5)  # its own rule
    assert cfg["finetune.min_lr"] == 1e-5 and cfg["finetune.weight_decay"] == 0.1
    assert cfg["finetune.epochs"] == 20 and cfg["finetune.warmup_epochs"] == 5 and cfg["finetune.train_mode"]
    assert cfg["resolution.train_size"] == 384  # the baseline's second stage is the preset's


def test_low_resolution_rows_pretrain_at_their_size_and_fine_tune_at_224():
    """DeiT III pre-trains ViT-H/14 at 126 (81 tokens) and fine-tunes at 224; ViT-B/16 at 128: 64 tokens of 196."""
    sizes = {(row, preset, stage): _row(row, preset, stage)["resolution.train_size"]
             for row in ("res_128", "res_224") for preset in ("paper", "demo") for stage in ("pretrain", "finetune")}
    assert sizes == {("res_128", "paper", "pretrain"): 128, ("res_128", "paper", "finetune"): 224,
                     ("res_128", "demo", "pretrain"): 24, ("res_128", "demo", "finetune"): 32,
                     ("res_224", "paper", "pretrain"): 224, ("res_224", "paper", "finetune"): 224,
                     ("res_224", "demo", "pretrain"): 32, ("res_224", "demo", "finetune"): 32}
    assert 1 - (128 // 16) ** 2 / (224 // 16) ** 2 == pytest.approx(1 - (126 // 14) ** 2 / (224 // 14) ** 2, abs=0.02)


@pytest.mark.parametrize("preset", ["paper", "demo"])
def test_fine_tunes_of_pretrainings_that_differ_only_in_size_are_different_runs(preset):
    """res_128 and res_224 fine-tune at the same size with the same recipe; their pre-trainings differ."""
    tuned = {row: identity_of([f"{STUDY}={row}", f"preset={preset}", "stage=finetune"])
             for row in ("res_128", "res_224")}
    assert tuned["res_128"].digest != tuned["res_224"].digest and tuned["res_128"].run_id != tuned["res_224"].run_id
    pre = {row: identity_of([f"{STUDY}={row}", f"preset={preset}"]).digest for row in ("res_224", "baseline")}
    assert pre["res_224"] == pre["baseline"]  # 224 throughout pre-trains as the baseline: one run


def test_a_pretrain_size_that_is_not_the_pretrainings_is_refused():
    cfg = compose_config([f"{STUDY}=res_128", "preset=paper", "resolution.train_size=224"])
    with pytest.raises(ConfigError, match=r"finetune.pretrain_size=128 but .* resolution.train_size=224"):
        _check_pretrain_size(cfg)
    _check_pretrain_size(compose_config([f"{STUDY}=res_128", "preset=paper"]))  # its own size: accepted
    _check_pretrain_size(compose_config([f"{STUDY}=res_128", "preset=paper", "stage=finetune"]))  # fine-tunes at 224


def test_fine_tune_rows_share_the_baselines_pretraining():
    """A layer-decay row is a fine-tune-stage row: its pre-training is the baseline's run (finetune.* is left out)."""
    for preset in ("paper", "demo"):
        base = identity_of([f"{STUDY}=baseline", f"preset={preset}"]).digest
        for tag in ("065", "075", "08"):
            assert identity_of([f"{STUDY}=layer_decay_{tag}", f"preset={preset}"]).digest == base
        tuned = identity_of([f"{STUDY}=layer_decay_08", f"preset={preset}", "stage=finetune"]).digest
        assert tuned != identity_of([f"{STUDY}=baseline", f"preset={preset}", "stage=finetune"]).digest


@pytest.mark.parametrize("preset", ["paper", "demo"])
def test_teaching_rows_distil_a_resnet50_student_on_the_kl_term_alone(preset):
    """Beyer et al. (2022): alpha 1 (no true labels), temperature 1, per-image KL, Inception crops and flips only;
    the fixed view is the control; function matching mixes every batch with lambda ~ Beta(1, 1) = U[0, 1]."""
    fixed, matching = _row("teach_fixed", preset), _row("teach_function_matching", preset)
    assert fixed["model.name"] == ("resnet50" if preset == "paper" else "resnet10t")
    assert fixed["train.global_batch"] == (4096 if preset == "paper" else 128)
    assert fixed["train.epochs"] == (300 if preset == "paper" else 10)
    assert fixed["distill.type"] == "soft" and fixed["distill.alpha"] == 1.0 and fixed["distill.tau"] == 1.0
    assert fixed["distill.kl_normalization"] == "batch" and fixed["distill.teacher_view"] == "fixed"
    assert fixed["distill.teacher.checkpoint"] is None  # the user names the teacher's run folder
    assert fixed["augment.auto_augment"] is None and fixed["augment.color_jitter"] == 0.0
    assert fixed["augment.reprob"] == 0.0 and fixed["augment.repeated_aug"] == 1
    assert fixed["mix.mixup_alpha"] == 0.0 and fixed["mix.cutmix_alpha"] == 0.0
    assert matching["distill.teacher_view"] == "same" and matching["mix.mixup_alpha"] == 1.0
    assert matching["mix.cutmix_alpha"] == 0.0 and matching["mix.prob"] == 1.0
    labels = _row("teach_labels", preset)  # the same student and setup on the true labels: cross-entropy, unsmoothed
    assert labels["distill.type"] == "none" and labels["mix.criterion"] == "ce" and labels["mix.label_smoothing"] == 0
    assert {k: labels[k] for k in fixed if k.startswith(("model.", "train.", "augment.", "optimizer."))} == {
        k: fixed[k] for k in fixed if k.startswith(("model.", "train.", "augment.", "optimizer."))}
    # Beta(1, 1) is uniform on [0, 1]: its density is 1 everywhere
    density = torch.distributions.Beta(1.0, 1.0).log_prob(torch.tensor([0.1, 0.5, 0.9])).exp()
    assert torch.allclose(density, torch.ones(3))


# Beyer et al.'s rows beyond the 300-epoch pair: the longer schedules, the 224 + 384 teacher, the label-only student
TEACH_LONG = [row for row in PAPER if row.startswith("teach_") and row[-1].isdigit() or row == "teach_labels"]


@pytest.fixture(scope="module")
def paper_inputs(tmp_path_factory) -> list[str]:
    """A one-image ImageNet folder and a teacher file for paper-scale plans (a run folder in a real sweep)."""
    root = tmp_path_factory.mktemp("paper")
    torch.save(timm.create_model("resnet10t", num_classes=1).state_dict(), root / "teacher.pth")
    return [*one_class_imagefolder(root / "imagenet"), f"distill.teacher.checkpoint={root / 'teacher.pth'}",
            "distill.teacher.model=resnet10t", f"runtime.output_root={root / 'out'}"]


@pytest.mark.parametrize("row", TEACH_LONG)
def test_each_longer_teaching_row_plans_at_paper_scale(row, paper_inputs):
    """What `python train.py deit3=<row> preset=paper runtime.dry_run=true` checks and prints, in this process."""
    overrides = [f"{STUDY}={row}", "preset=paper", "runtime.dry_run=true", *paper_inputs]
    cfg = _composed(overrides)
    validate_config(cfg)
    name = run_identity(cfg, overrides, composed_choices(cfg)).name
    line = dry_run_line(make_plan(cfg, DistInfo(), RunDir(runs_root(cfg.runtime.output_root) / name), overrides))
    assert re.search(rf"^\[dry run\] \S*\b{STUDY}={row}[,-].* \(wandb id \w+\): train from step 0$", line), line
    epochs = 300 if row == "teach_labels" else next(n for n in LONGER if f"_{n}" in row)
    assert cfg.train.epochs == epochs


def test_the_aggregator_shows_each_teaching_rows_paper_number_and_its_paper_delta():
    def run(rid: str, row: str, top1: float) -> RunInfo:  # a finished demo run as its wandb log holds it
        config = {"preset": "demo", "stage": "pretrain", "seed": 0, "ablation": "baseline", "choices": {STUDY: row}}
        return RunInfo(run_id=rid, config=config, summary={"status": "finished", "top1": top1})

    table = build_table([run("a", "teach_fixed", 80.0), run("b", "teach_function_matching_9600", 82.0)], rows=STUDY)
    records = {r["key"]: r for r in to_json_dict(table)["rows"]}
    for row in TEACH_LONG:
        base, cell = ROWS[row][0], records[row]["cells"]["pretrain"]
        assert records[row]["delta_to"] == base and cell["paper"] == PAPER[row][0], row
        assert cell["paper_delta"] == pytest.approx(PAPER[row][0] - PAPER[base][0]), row
    text = render(table, "markdown")
    assert re.search(r"\| teach_function_matching_9600_224_384 \| teach_function_matching_9600 \|.*"
                     r"\| 82\.8 \| \+0\.5 \|", text)
    assert re.search(r"\| teach_labels \| teach_fixed \|.*\| 78\.2 \| \+0\.4 \|", text)


@pytest.mark.slow  # ~20 s: every row composed and checked in a subprocess
def test_the_dry_run_lists_every_row_at_paper_scale(tmp_path, data_cache):
    root = tmp_path / "imagenet"
    one_class_imagefolder(root)
    teacher = tmp_path / "teacher.pth"  # a teacher for the teach_* rows (a run folder in a real sweep)
    torch.save(timm.create_model("resnet10t", num_classes=1).state_dict(), teacher)
    teach = [f"distill.teacher.checkpoint={teacher}", "distill.teacher.model=resnet10t"]
    proc = run_train(["-m", f"{STUDY}=glob(*)", "runtime.dry_run=true", "preset=paper", f"data.root={root}",
                      "data.num_classes=1", *teach], tmp_path, data_cache)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[dry run]")]
    same = sorted(line.split(" row ", 1)[1].split(" ", 1)[0] for line in lines if " computes the same as " in line)
    lines = [line for line in lines if " computes the same as " not in line]
    names = sorted(line.split(f"{STUDY}=", 1)[1].split(",", 1)[0].split("-", 1)[0] for line in lines)
    assert names == sorted(PAPER) and all(line.endswith("train from step 0") for line in lines)
    assert len(lines) == len(PAPER) and set(TEACH_LONG) < set(names)  # the longer teaching rows among them
    # rows that change only the fine-tune pre-train as the baseline does: one experiment at this stage, said so
    assert same == [f"{STUDY}={row}" for row in ("layer_decay_065", "layer_decay_075", "layer_decay_08", "res_224")]
    assert not (tmp_path / "outputs" / "runs").exists() or not any((tmp_path / "outputs" / "runs").iterdir())


@pytest.mark.slow  # ~10 s: two short demo runs
def test_low_resolution_row_pretrains_at_24_and_fine_tunes_its_checkpoint_at_32(tmp_path, data_cache):
    """res_128 at demo scale: the pre-training at 24 px (3 x 3 patches), its fine-tune at 32 px (4 x 4) from it."""
    proc = run_train(["-m", f"{STUDY}=res_128", "stage=pretrain,finetune", "train.max_steps=2"] + TINY,
                     tmp_path, data_cache)
    runs = [line for line in proc.stdout.splitlines() if line.startswith("[run] ") and " at " in line]
    assert [line.split(" at ", 1)[1].split("px", 1)[0] for line in runs] == ["24", "32"]
    assert "pretrain at 24px" in runs[0] and "finetune at 32px" in runs[1]
    results = [json.loads(p.read_text()) for p in runs_root(tmp_path / "outputs").glob(f"{STUDY}=res_128*/{RESULT}")]
    assert sorted((r["status"], r["steps_done"]) for r in results) == [("finished", 2)] * 2
