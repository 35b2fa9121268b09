"""DeiT Table 5, the headline models: DeiT-Ti / S / B, their ⚗ twins distilled from a chained RegNetY-16GF teacher,
and the 1000-epoch DeiT-B⚗, as a study with the numbers the seeds state."""

from __future__ import annotations

import json
import math
import re

import pytest
import timm
import torch

from deit_ablate.analysis.aggregate.cells import cell_metric
from deit_ablate.analysis.aggregate.paper import paper_table
from deit_ablate.analysis.aggregate.reader import RunInfo
from deit_ablate.analysis.aggregate.render import render, to_json_dict
from deit_ablate.analysis.aggregate.table import build_table
from deit_ablate.config.schema import DistillKind
from deit_ablate.config.stage_config import stage_config
from deit_ablate.config.studies import studies
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.stages import teacher_run_overrides
from deit_ablate.run.student import student_model_name
from deit_ablate.train.losses import distilled_eval_outputs, distilled_head_logits
from tests.conftest import CONF, compose_config, identity_of, one_class_imagefolder, run_train

STUDY = "headline"
# The seeds' numbers (deit-blog-post "7. Results", the chapter's distillation table): top-1 at 224 and ↑384.
TABLE5 = {"deit_ti": (72.2, None), "deit_s": (None, None), "deit_b": (81.8, 83.1), "deit_ti_distilled": (74.5, None),
          "deit_s_distilled": (None, None), "deit_b_distilled": (83.4, 84.5), "deit_b_distilled_1000ep": (84.2, 85.2),
          "deit_b_distilled_1000ep_crop_1_0": (None, 85.42)}
# Each row at paper scale: the model trained (timm name, with the width and heads the row gives), distilled, epochs.
MODELS = {"deit_ti": ("deit_tiny_patch16_224", 192, 3), "deit_s": ("deit_small_patch16_224", 384, 6),
          "deit_b": ("deit_base_patch16_224", None, None)}


def test_table5_rows_and_numbers_are_the_seeds():
    study = next(s for s in studies() if s.name == STUDY)
    assert (study.table, study.baseline, study.default, study.rows) == ("table5", "deit_b", None, tuple(TABLE5))
    table = paper_table("table5")
    assert table.columns == {"pretrain": "224", "finetune": "↑384"} and table.absent == "not in the text"
    raw = json.loads((CONF / STUDY / "numbers.json").read_text())["table5"]
    assert {row["key"]: (row["pretrain"], row["finetune"]) for row in raw["rows"]} == TABLE5


@pytest.mark.parametrize("row", list(TABLE5))
def test_each_row_trains_its_model_at_paper_scale(row):
    cfg = compose_config(["preset=paper", f"{STUDY}={row}"])
    size = row.split("_")[1]
    name, width, heads = MODELS[f"deit_{size}"]
    distilled = "distilled" in row
    expected = name.replace("_patch", "_distilled_patch") if distilled else name
    assert student_model_name(cfg.model, cfg.distill) == expected
    assert (cfg.model.kwargs.get("embed_dim"), cfg.model.kwargs.get("num_heads")) == (width, heads)
    assert cfg.distill.type == (DistillKind.hard_token if distilled else DistillKind.none)
    assert cfg.distill.teacher.chain == ("regnety_160" if distilled else None)
    assert cfg.train.epochs == (1000 if "1000ep" in row else 300)


def test_the_rows_share_runs_with_the_other_studies():
    """DeiT-B is Table 8's baseline run and DeiT-B⚗ Table 2's RegNetY-16GF row: one experiment, one folder."""
    paper = ["preset=paper"]
    assert identity_of([*paper, f"{STUDY}=deit_b"]).digest == identity_of(paper).digest
    assert (identity_of([*paper, f"{STUDY}=deit_b_distilled"]).digest
            == identity_of([*paper, "teachers=regnety_16gf"]).digest)
    assert identity_of([*paper, f"{STUDY}=deit_ti"]).digest != identity_of(paper).digest


def test_the_crop_row_is_the_1000_epoch_run_evaluated_at_crop_1():
    """CaiT section 4.5.3: DeiT-B⚗↑384 at crop ratio 1.0 (85.42). One pre-training; only the fine-tune differs."""
    paper, row = ["preset=paper"], f"{STUDY}=deit_b_distilled_1000ep_crop_1_0"
    assert identity_of([*paper, row]).digest == identity_of([*paper, f"{STUDY}=deit_b_distilled_1000ep"]).digest
    fine_tune = stage_config(compose_config([*paper, row, "stage=finetune"]))
    assert (fine_tune.resolution.crop_pct, fine_tune.resolution.eval_size, fine_tune.train.epochs) == (1.0, 384, 30)
    assert compose_config([*paper, row]).resolution.crop_pct == 0.875  # the pre-training's evaluation is DeiT's


def test_the_crop_rows_fine_tune_ranks_by_the_heads_logit_average_as_wightmans_figure():
    """85.42 is timm's evaluation of DeiT-B⚗ (VisionTransformerDistilled at evaluation: the mean of the two heads'
    logits); the row's fine-tune fuses its heads so, while the 1000-epoch row keeps the mean of probabilities."""
    paper, row = ["preset=paper", "stage=finetune"], f"{STUDY}=deit_b_distilled_1000ep_crop_1_0"
    fusion = stage_config(compose_config([*paper, row])).distill.fusion
    assert fusion == "logit"
    assert stage_config(compose_config([*paper, f"{STUDY}=deit_b_distilled_1000ep"])).distill.fusion == "prob"
    # Class head sure of class 0; distillation head rules it out and mildly prefers class 1.
    cls, dist = torch.tensor([[10.0, 0.0, 0.0]]), torch.tensor([[-20.0, 3.0, 0.0]])
    scores = distilled_eval_outputs(cls, dist, fusion)
    torch.testing.assert_close(scores["fused"], torch.tensor([[-5.0, 1.5, 0.0]]))  # (cls + dist) / 2
    p_cls, p_dist = ([math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in (cls[0].tolist(),
                                                                                          dist[0].tolist()))
    mean_prob = [(a + b) / 2 for a, b in zip(p_cls, p_dist, strict=True)]  # about [0.500, 0.476, 0.024]
    torch.testing.assert_close(scores["fused_alt"][0], torch.tensor(mean_prob))
    assert scores["fused"].argmax(-1).item() == 1 and scores["fused_alt"].argmax(-1).item() == 0  # they disagree
    # timm's own evaluation forward of a distilled ViT is that fusion
    model = timm.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1,
                              num_heads=2, num_classes=3).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        heads = distilled_head_logits(model, images)
        torch.testing.assert_close(model(images), distilled_eval_outputs(*heads, fusion)["fused"])
    # and the row's ↑384 number is compared with the run's fused figure (top1_fused)
    numbers = next(r for r in paper_table("table5").rows if r.key == "deit_b_distilled_1000ep_crop_1_0")
    assert numbers.heads == {"finetune": "fused"} and numbers.values["finetune"] == 85.42
    assert cell_metric("top1", numbers.heads["finetune"]) == ("top1_fused", "fused")


def test_a_distilled_rows_teacher_run_is_the_plain_regnet_run():
    overrides = ["preset=paper", f"{STUDY}=deit_ti_distilled", "seed=2"]
    cfg = compose_config(overrides)
    assert teacher_run_overrides(Lineage.of(cfg, overrides)) == ["model=regnety_160", "preset=paper", "seed=2"]


@pytest.mark.slow
def test_the_paper_scale_dry_run_plans_every_row_its_teacher_and_fine_tunes(tmp_path, data_cache):
    data = one_class_imagefolder(tmp_path / "imagenet")
    proc = run_train(["-m", f"{STUDY}=glob(*)", "stage=pretrain,finetune", "preset=paper", *data,
                      "runtime.dry_run=true"], tmp_path, data_cache)
    plans = re.findall(r"\[dry run\] (\S+) \(wandb id [^)]+\): (.*)", proc.stdout)
    teacher = identity_of(["model=regnety_160", "preset=paper", *data]).name
    names = [name for name, _ in plans]
    assert names.count(teacher) == 1 and plans[names.index(teacher)][1] == "train from step 0"
    waiting = [i for i, (_, plan) in enumerate(plans) if plan == f"wait for its teacher run {teacher}"]
    assert waiting and names.index(teacher) < min(waiting)  # the chained teacher before its first student
    rows = {(re.search(rf"{STUDY}=(\w+)", name).group(1), "stage=finetune" in name): plan
            for name, plan in plans if name != teacher}
    assert len(rows) == 2 * len(TABLE5) == len(plans) - 1
    for row in TABLE5:
        waits = "distilled" in row
        assert rows[row, False] == (f"wait for its teacher run {teacher}" if waits else "train from step 0")
        assert rows[row, True].startswith("wait for its pre-training")
    assert not (tmp_path / "outputs" / "runs").exists() or not any((tmp_path / "outputs" / "runs").iterdir())


def test_each_distilled_row_names_its_fusion_and_shows_the_other_beside_it():
    """Table 5's ⚗ cells compare one fusion with the paper (the softmax sum; the crop row's ↑384, the logit mean)
    and show the same runs under the other rule; a plain row has neither."""
    def run(rid: str, row: str, stage: str, seed: int, summary: dict, **config) -> RunInfo:
        return RunInfo(run_id=rid, config={"preset": "paper", "stage": stage, "seed": seed, "choices": {STUDY: row},
                                           **config}, summary={"status": "finished", **summary})

    def distilled(fused: float, other: float, **named) -> dict:
        return {"top1": fused, "top1_fused": fused, "top1_fused_alt": other, "top1_cls": 80.0, "top1_dist": 81.0,
                **named}

    runs = [run("b0", "deit_b", "pretrain", 0, {"top1": 81.0}),
            run("bd0", "deit_b_distilled", "pretrain", 0, distilled(83.0, 82.5, fusion="prob")),
            run("bd1", "deit_b_distilled", "pretrain", 1, distilled(83.4, 82.7, fusion="prob")),
            # recorded before `fusion` was: the fine-tune's rule is read from its config's finetune.overrides
            run("crop0", "deit_b_distilled_1000ep_crop_1_0", "finetune", 0, distilled(85.5, 85.3),
                distill={"fusion": "prob"}, finetune={"overrides": {"distill": {"fusion": "logit"}}})]
    table = build_table(runs, rows=STUDY)
    records = {r["key"]: r["cells"] for r in to_json_dict(table)["rows"]}
    prob = records["deit_b_distilled"]["pretrain"]
    assert (prob["fusion"], prob["other_fusion"], prob["mean"]) == ("prob", "logit", pytest.approx(83.2))
    assert prob["other_fusion_mean"] == pytest.approx(82.6)
    logit = records["deit_b_distilled_1000ep_crop_1_0"]["finetune"]
    assert (logit["fusion"], logit["other_fusion"], logit["mean"], logit["other_fusion_mean"]) == (
        "logit", "prob", 85.5, 85.3)
    assert records["deit_b"]["pretrain"]["fusion"] is None
    text = render(table, "markdown")
    assert "| ours pre-train | other fusion |" in text.replace(" @224", "")
    assert re.search(r"\| deit_b_distilled \| deit_b \| 83\.20 ± 0\.28 \(n=2\) · fused heads · softmax sum \| "
                     r"82\.60 ± 0\.14 · logit mean \|", text), text
    assert re.search(r"\| deit_b_distilled_1000ep_crop_1_0 \|.*\| 85\.50 \(n=1\) · fused heads · logit mean \| "
                     r"85\.30 · softmax sum \|", text), text
    assert re.search(r"\| deit_b \|  \| 81\.00 \(n=1\) \|  \|", text), text  # no fusion, no other figure
    assert "Fusion: a ⚗ cell's figure ranks classes" in text
