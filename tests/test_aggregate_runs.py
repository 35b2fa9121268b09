"""The aggregator on real runs of train.py: cells never pool different experiments, rows by group choice, curves, HTML.

One module fixture runs the issue's sequence in one `outputs/` folder, at the tiny test scale for two epochs:
a Table 8 sweep (`ablation=baseline,sgd,no_mixup seed=0,1`), the mix sweep (`mix=none,mixup_only,cutmix_only`)
and a plain `train.py` (the same experiment as `ablation=baseline seed=0`, under another run id).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from deit_ablate.analysis.aggregate import cli
from deit_ablate.analysis.aggregate.curves import load_histories, plot_curves
from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.analysis.aggregate.settings import experiment_settings, is_execution_key
from deit_ablate.config.studies import paper_tables
from deit_ablate.record.identity import RunIdentity
from deit_ablate.record.rundir import RunDir, runs_root, wandb_root
from deit_ablate.record.tracking import METRICS_CSV, Tracker, code_commit
from tests.conftest import TINY, SharedRun, run_train

TWO_EPOCHS = [o for o in TINY if not o.startswith("train.epochs=")] + ["train.epochs=2"]
MIX_ROWS = {"none", "mixup_only", "cutmix_only", "mixup_cutmix"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path, mix_sweep: SharedRun) -> Path:
    """The issue's runs, written by train.py into one outputs/ folder."""
    cwd = tmp_path_factory.mktemp("agg_runs")
    run_train(["-m", "ablation=baseline,sgd,no_mixup", "seed=0,1", *TWO_EPOCHS], cwd, data_cache)
    mix_sweep.copy_into(cwd)  # `-m mix=none,mixup_only,cutmix_only` with TWO_EPOCHS, trained once per session
    plain = run_train(TWO_EPOCHS, cwd, data_cache)
    assert "already finished" in plain.stdout  # the plain run is the same experiment as baseline seed 0
    return cwd / "outputs"


def _table(argv: list[str]):
    args = cli.build_parser().parse_args(argv)
    return cli.aggregate(args, warn=lambda message: None)


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    assert cli.main([*argv, "--format", "json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def _configs(outputs: Path) -> dict[str, dict]:
    return {r.run_id: r.config for r in read_offline(wandb_root(outputs), warn=lambda m: None)}


def test_runs_log_choices_and_keep_a_metrics_csv(outputs: Path) -> None:
    configs = _configs(outputs)
    assert len(configs) == 9
    mixes = sorted(c["choices"]["mix"] for c in configs.values())
    assert mixes == sorted(["none", "mixup_only", "cutmix_only"] + ["mixup_cutmix"] * 6)
    assert all(not any(k.startswith("hydra/") for k in c["choices"]) for c in configs.values())
    for config in configs.values():
        folder = runs_root(outputs) / config["run_name"]
        assert OmegaConf.load(RunDir(folder).hydra_settings).hydra.runtime.choices.mix == config["choices"]["mix"]
        lines = (folder / METRICS_CSV).read_text().splitlines()
        assert lines[0].startswith("epoch,step,") and "val/top1" in lines[0]
        assert [line.split(",")[0] for line in lines[1:]] == ["0", "1"]


def test_no_cell_pools_sgd_with_adamw(outputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    configs = _configs(outputs)
    for rows in ("mix", "optimizer.name", "ablation", "seed"):
        data, err = _json([str(wandb_root(outputs)), "--rows", rows], capsys)
        for row in data["rows"]:
            for cell in row["cells"].values():
                settings = {json.dumps(experiment_settings(configs[rid]), sort_keys=True) for rid in cell["run_ids"]}
                assert len(settings) <= 1, (rows, row["key"])
                optimizers = {configs[rid]["optimizer"]["name"] for rid in cell["run_ids"]}
                assert len(optimizers) <= 1, (rows, row["key"], optimizers)
    data, err = _json([str(wandb_root(outputs)), "--rows", "mix"], capsys)
    split = next(s for s in data["splits"] if s["row"] == "mixup_cutmix")
    assert "optimizer.name" in split["varied"] and "ablation" in split["varied"]
    assert "runs differ in ablation, mix.mixup_alpha, optimizer.name" in err  # always said which keys varied


def test_rows_mix_are_the_option_names(outputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = _json([str(wandb_root(outputs)), "--rows", "mix"], capsys)
    keys = [r["key"] for r in data["rows"]]
    assert set(keys) == MIX_ROWS | {"mixup_cutmix · ablation=no_mixup", "mixup_cutmix · ablation=sgd"}
    assert {r["base"] for r in data["rows"]} == MIX_ROWS and data["rows_key"] == "mix"
    assert data["baseline"] == "mixup_cutmix"
    main = next(r for r in data["rows"] if r["key"] == "mixup_cutmix")["cells"]["pretrain"]
    assert main["n"] == 2 and sorted(main["seeds"]) == [0, 1] and not main["same_seed"]  # the plain run: seed 0
    data, _ = _json([str(wandb_root(outputs)), "--rows", "mix", "--match-baseline"], capsys)
    assert {r["key"] for r in data["rows"]} == MIX_ROWS
    assert len(data["meta"]["not_matching_baseline"]) == 4  # sgd and no_mixup, two seeds each
    data, _ = _json([str(wandb_root(outputs)), "--rows", "mix.mixup_alpha"], capsys)  # a plain key: its values
    assert {r["base"] for r in data["rows"]} == {"0", "0.8"}


def test_table8_view_splits_and_reports_a_repeated_seed(outputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, err = _json([str(wandb_root(outputs))], capsys)
    rows = {r["key"]: r for r in data["rows"]}
    base = rows["baseline"]["cells"]["pretrain"]
    assert base["n"] == 2 and not base["same_seed"] and "repeat a seed" not in err  # one run per experiment
    assert rows["baseline"]["cells"]["pretrain"]["paper"] == 81.8
    for mix in ("none", "mixup_only", "cutmix_only"):
        sub = rows[f"baseline · mix={mix}"]
        assert sub["cells"]["pretrain"]["n"] == 1 and sub["cells"]["pretrain"]["paper"] is None
    assert rows["sgd"]["cells"]["pretrain"]["n"] == 2 and rows["no_mixup"]["cells"]["pretrain"]["n"] == 2
    # Table 8's rows (all but three without runs) and the mix sub-rows
    assert len(data["rows"]) == len(paper_tables()["table8"]["rows"]) + 3
    data, _ = _json([str(wandb_root(outputs)), "--paper", "none"], capsys)  # no paper: rows without runs hidden
    assert [r["key"] for r in data["rows"]] == [
        "baseline", "baseline · mix=cutmix_only", "baseline · mix=mixup_only", "baseline · mix=none", "sgd", "no_mixup"
    ]
    data, _ = _json([str(wandb_root(outputs)), "--only-present"], capsys)
    assert len(data["rows"]) == 6 and data["paper"]["table"] == "table8"
    assert cli.main([str(wandb_root(outputs)), "--list-runs"]) == 0
    assert "same seed: not averaged" not in capsys.readouterr().out


def test_curves_draw_one_line_per_row_with_data(outputs: Path) -> None:
    table = _table([str(wandb_root(outputs)), "--rows", "mix"])
    png = outputs.parent / "curves.png"
    fig = plot_curves(table, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with_data = [r.key for r in table.rows if any(c.n for c in r.cells.values())]
    assert len(fig.axes) == 1 and len(with_data) == 6  # pre-training only: one panel
    assert sorted(line.get_label().split(" (n=")[0] for line in fig.axes[0].lines) == sorted(with_data)
    means = {line.get_label().split(" (n=")[0]: list(line.get_ydata()) for line in fig.axes[0].lines}
    assert all(len(v) == 2 for v in means.values())  # two epochs each
    assert cli.main([str(wandb_root(outputs)), "--rows", "mix", "--curves", str(png), "-q", "--out", "/dev/null"]) == 0


def test_curves_read_the_csv_else_the_wandb_log(outputs: Path, tmp_path: Path) -> None:
    runs = read_offline(wandb_root(outputs), warn=lambda m: None)
    from_csv = load_histories(runs, jobs=1)
    assert {where for _, where in from_csv.values()} == {"csv"}
    shutil.copytree(wandb_root(outputs), wandb_root(tmp_path / "elsewhere"),
                    ignore=shutil.ignore_patterns("latest-run"))
    moved = read_offline(wandb_root(tmp_path / "elsewhere"), warn=lambda m: None)
    from_log = load_histories(moved, jobs=1)
    assert {where for _, where in from_log.values()} == {"log"}
    for rid, (rows, _) in from_csv.items():
        logged = from_log[rid][0]
        assert [r["epoch"] for r in logged] == [0, 1]
        assert [r["val/top1"] for r in logged] == pytest.approx([r["val/top1"] for r in rows], abs=1e-6)


def test_html_is_one_self_contained_file(outputs: Path) -> None:
    page = outputs.parent / "table8.html"
    assert cli.main([str(wandb_root(outputs)), "--format", "html", "--out", str(page), "-q"]) == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and '<table class="results">' in text and "81.8 ± 0.2" in text
    assert "baseline · mix=none" in text
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]+"', text)) == 2  # Δ plot and curves
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert not re.search(r"<script|<link|@import|@font-face|url\(", text, re.I)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--metric", "top-1"], ["--metric 'top-1'", "top1"]),
        (["--rows", "distil"], ["--rows key 'distil'", "distill"]),
        (["--where", "optimizer.wd=0.1"], ["'optimizer.wd'", "optimizer.weight_decay"]),
        (["--preset", "papr"], ["--preset papr", "demo"]),
        (["--group", "tabel8"], ["--group tabel8"]),
    ],
)
def test_mistakes_exit_2_naming_the_key(outputs: Path, capsys: pytest.CaptureFixture[str], argv, words) -> None:
    assert cli.main([str(wandb_root(outputs)), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and all(w in err for w in words), err


def test_dropped_paper_column_says_why(outputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, err = _json([str(wandb_root(outputs)), "--rows", "resolution", "--paper", "table10"], capsys)
    assert data["paper"] is None and "paper table10 left out" in err and "(32)" in err


def test_execution_keys_never_split_a_cell() -> None:
    from deit_ablate.config.keys import DATA_LOCATION, EXECUTION_KEYS, NOT_EXPERIMENT

    # What never enters a run's identity never splits a cell.
    assert all(is_execution_key(k) for k in (*NOT_EXPERIMENT[:1], DATA_LOCATION, "runtime.tracking.mode"))
    assert is_execution_key("runtime.anything") and "runtime" in EXECUTION_KEYS
    a = {"seed": 0, "train": {"device": "cpu", "epochs": 2}, "runtime": {"x": 1}, "choices": {"mix": "none"}}
    b = {"seed": 1, "train": {"device": "cuda", "epochs": 2}, "runtime": {"x": 2}, "choices": {"mix": "none"}}
    assert experiment_settings(a) == experiment_settings(b) == {"train.epochs": 2}


def test_the_default_backend_is_one_rule_for_the_identity_and_the_aggregator() -> None:
    from deit_ablate.record.identity import experiment
    from tests.conftest import compose_config

    # a run logged before data.backend existed, and one of today's runs on the default backend: one setting
    old = {"seed": 0, "data": {"name": "builtin"}, "train": {"epochs": 2}}
    new = {"seed": 1, "data": {"name": "builtin", "backend": "pil"}, "train": {"epochs": 2}}
    dali = {"seed": 2, "data": {"name": "builtin", "backend": "dali"}, "train": {"epochs": 2}}
    assert experiment_settings(old) == experiment_settings(new) != experiment_settings(dali)
    assert "backend" not in experiment(compose_config(["data.backend=pil"]))["data"]
    assert experiment(compose_config(["data.backend=dali"]))["data"]["backend"] == "dali"


def test_metrics_csv_after_a_resume_holds_each_epoch_once(tmp_path: Path) -> None:
    cfg = OmegaConf.create({"runtime": {"tracking": {"mode": "disabled"}}})
    first = Tracker(cfg, RunIdentity("name", "id", "group", "digest"), {}, enabled=True, run_dir=tmp_path)
    for epoch in range(3):
        first.log({"epoch": epoch, "train/loss": 1.0}, step=epoch * 10 + 5)  # a step row: not in the CSV
        first.log({"epoch": epoch, "val/top1": 10.0 + epoch}, step=epoch * 10 + 10)
    # resumed from epoch 1
    resumed = Tracker(cfg, RunIdentity("name", "id", "group", "digest"), {}, enabled=True, run_dir=tmp_path)
    resumed.log({"epoch": 1, "val/top1": 21.0, "val_ema/top1": 22.0}, step=20)
    lines = (tmp_path / METRICS_CSV).read_text().splitlines()
    assert lines == ["epoch,step,val/top1,val_ema/top1", "0,10,10.0,", "1,20,21.0,22.0"]
    Tracker(cfg, RunIdentity("name", "id", "group", "digest"), {}, enabled=False,
            run_dir=tmp_path / "rank1").log({"epoch": 0, "val/top1": 1}, 1)
    assert not (tmp_path / "rank1").exists()


def _figure_texts(fig) -> list[str]:
    """Every text a figure draws outside its data: figure texts (the suptitle and the foot), axes titles and labels."""
    texts = [t.get_text() for t in fig.texts]
    assert fig.get_suptitle() in texts
    for ax in fig.axes:
        texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
    return [t for t in texts if t]


def test_html_and_png_say_what_was_run(outputs: Path, tmp_path: Path) -> None:
    """#26: the page and the figures name the data (and its digest), the model as built, epochs, resolution, preset,
    the aggregator's filters and the commit; no Markdown backticks; the study's title once."""
    digest = next(iter(_configs(outputs).values()))["data_fingerprint"]["digest"][:8]
    argv = [str(wandb_root(outputs)), "--preset", "demo", "--where", "optimizer.name=adamw"]
    page, png = tmp_path / "t8.html", tmp_path / "t8.png"
    assert cli.main([*argv, "--format", "html", "--out", str(page), "--plot", str(png), "-q"]) == 0
    html = page.read_text()
    args = cli.build_parser().parse_args([*argv, "--plot", str(png), "--curves", str(png)])
    figs = cli.figures(cli.aggregate(args, warn=lambda m: None), args)
    title = "Table 8: ablation of the DeiT-B recipe"
    model = "deit_tiny_patch16_224 (patch_size=8, embed_dim=32, depth=1, num_heads=2)"  # TINY's overrides
    words = ["builtin", digest, "10 classes", model, "pre-train 2", "pre-train 32 px", "demo", "--preset demo",
             "--where optimizer.name=adamw", "commit", code_commit()[:12]]  # the runs record the code's commit
    for name, text in [("html", html)] + [(k, "\n".join(_figure_texts(f))) for k, f in figs.items()]:
        flat = " ".join(text.split())  # a figure's footer is wrapped
        missing = [w for w in words if w not in flat]
        assert not missing, (name, missing, text[:3000])
        assert "`" not in text, name
        assert flat.count(title) == 1, name  # not repeated in <title>, the header and the caption; suptitle only


def test_only_present_drops_the_fine_tune_column_nobody_ran(outputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = _json([str(wandb_root(outputs))], capsys)
    assert data["stages"] == ["pretrain", "finetune"]  # Table 8's two columns by default
    data, _ = _json([str(wandb_root(outputs)), "--only-present"], capsys)
    assert data["stages"] == ["pretrain"] and len(data["rows"]) == 6
    assert cli.main([str(wandb_root(outputs)), "--only-present"]) == 0
    head = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| ablation"))
    assert "ours pre-train @32" in head and "fine-tune" not in head and "↑384" not in head
