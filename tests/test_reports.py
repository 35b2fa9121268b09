"""Reports that say at a glance what was run (issue 39 point 12): the model as built and its size in the HTML title,
a table that fits the page, what the built-in data is, disagreement labels that are study rows, and why the paper's
Table 4 panel has no value of ours."""

from __future__ import annotations

import json

import yaml
from test_disagreement import PLAIN, TEACHER, make_run

from deit_ablate.analysis import disagreement
from deit_ablate.analysis.aggregate.about import facts, headline
from deit_ablate.analysis.aggregate.html import STYLE, to_html
from deit_ablate.analysis.aggregate.reader import RunInfo
from deit_ablate.analysis.aggregate.table import build_table

ARCH = {"name": "vit_base_patch16_224", "patch_size": 8, "width": 128, "depth": 6, "heads": 4, "params": 1_205_514}


def _sam_run(rid: str, row: str, seed: int = 0) -> RunInfo:
    """A finished demo run of the sharpness study as its wandb log holds it."""
    config = {"sam": row, "choices": {"sam": row}, "stage": "pretrain", "seed": seed, "preset": "demo",
              "model": {"name": "vit_base_patch16_224", "kwargs": {"patch_size": 8, "embed_dim": 128}},
              "data": {"name": "builtin", "num_classes": 10, "builtin": {"image_size": 40, "train_per_class": 500,
                                                                        "val_per_class": 100, "classes": "shapes"}},
              "resolution": {"train_size": 32, "eval_size": 32}}
    summary = {"status": "finished", "top1": 40.0 + seed, "architecture": ARCH, "model_name": ARCH["name"]}
    return RunInfo(run_id=rid, config=config, summary=summary)


def _sam_table():
    return build_table([_sam_run("a", "baseline"), _sam_run("b", "rho_02")], rows="sam")


def test_the_title_names_the_model_run_its_size_and_the_preset():
    title = headline(_sam_table())
    assert title.startswith("Sharpness and SAM on ViT-B/16")  # the paper's, said to be the paper's
    assert "(the paper's models; ours: vit_base_patch16_224 (patch 8, width 128, depth 6, heads 4, 1.21 M params)" \
        in title
    assert "on builtin (10 synthetic shape classes) at 32 px, demo preset)" in title


def test_the_data_is_said_to_be_synthetic_shapes():
    data = dict(facts(_sam_table()))["data"]
    assert data.startswith("builtin: 10 synthetic shape classes (shapes), drawn at 40 px, 500 train / 100 val "
                           "images per class")


def test_the_html_table_wraps_inside_the_page_instead_of_scrolling():
    page = to_html(_sam_table())  # tests/test_report_pages.py measures it in a browser
    assert "overflow-x" not in STYLE and "nowrap" not in STYLE and "max-width: 1400px" in STYLE
    assert '<table class="results"><thead>' in page and 'class="wide"' not in page


def _choose(run, **choices: str) -> None:
    """Give a run folder the Hydra choices a launch records (.hydra/hydra.yaml)."""
    run.hydra.mkdir(exist_ok=True)
    every = {"preset": "demo", "model": "vit_demo", "ablation": "baseline", "teachers": None, "sam": None, **choices}
    run.hydra_settings.write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": every}}}))


def test_disagreement_labels_are_study_rows_and_the_empty_paper_panel_says_why(tmp_path, capsys):
    runs = [make_run(tmp_path, name, {"main": heads}) for name, heads in
            (("vit_base_patch16_224-aaaaaaaaaa", PLAIN), ("vit_base_patch16_224-bbbbbbbbbb", TEACHER),
             ("resnet10t-cccccccccc", TEACHER), ("deit_tiny-dddddddddd", PLAIN))]
    for run, choices in zip(runs, ({"sam": "baseline"}, {"sam": "rho_02"}, {"model": "cnn_demo"}, {}), strict=True):
        _choose(run, **choices)
    out = tmp_path / "out"
    assert disagreement.main([str(run.path) for run in runs] + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((out / "disagreement.json").read_text())
    assert saved["labels"] == ["sam=baseline", "sam=rho_02", "model=cnn_demo", "ablation=baseline"]
    assert all(row["ours"] is None for row in saved["paper_table4"])
    why = ("Ours is — where these runs hold no such pair: Table 4 compares a distilled run (one with a distillation "
           "token: class, distillation and fused heads); its teacher run")
    assert saved["paper_missing"].startswith(why) and "No run here (or more than one) is a distilled run" in \
        saved["paper_missing"]
    assert why in printed and why in (out / "disagreement.md").read_text()


def test_the_end_of_run_summary_says_whose_each_accuracy_is():
    from deit_ablate.run.report import accuracy_line, summarize

    model, ema = {"top1": 41.0, "top5": 80.0, "loss": 1.0}, {"top1": 44.0, "top5": 83.0, "loss": 0.9}
    with_ema = accuracy_line(summarize("finished", model, ema, 45.0, 2, 16, 1.0))
    assert with_ema == ("top-1     EMA 44.00% final, 45.00% best; model 41.00% final   top-5 EMA 83.00%, model "
                        "80.00%"), with_ema  # it said `top-1 44.00% final, 45.00% best   top-5 83.00%`
    alone = accuracy_line(summarize("finished", model, {}, 42.0, 2, 16, 1.0))
    assert alone == "top-1     model 41.00% final, 42.00% best   top-5 80.00%", alone
