"""scripts/bench.py --quick --skip-timm runs and writes every figure with device, command and settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deit_ablate.bench.pipeline import speedup_bound
from deit_ablate.bench.report import Figure, Report
from deit_ablate.bench.timm_ref import parse_step, timm_args
from tests.conftest import REPO


@pytest.mark.slow
def test_quick_bench_writes_positive_figures_for_every_section(tmp_path, data_cache):
    out = tmp_path / "bench.json"
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--skip-timm",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"]["cores"] >= 1 and result["device"]["summary"]
    names = {(f["name"], f["variant"]) for f in result["figures"]}
    for expected in [("matmul_rate", "float32"), ("train_step", "ours"), ("input_pipeline", "ours"),
                     ("input_pipeline", "ours+fast_jpeg"), ("input_pipeline", "dali"),
                     ("epoch_start_latency", "workers=ours"),
                     ("e2e_train", "ours"), ("train_step_in_run", "ours"), ("e2e_run_wall", "ours"),
                     ("startup_cfg_job", "ours"),
                     ("compose_sweep_26", "ours"), ("transform_stage", "decode"),
                     ("transform_stage", "RandAugment"), ("speedup_bound", "decode_free")]:
        assert expected in names, expected
    differences = {f["variant"]: f["value"] for f in result["figures"] if f["name"] == "fast_crop_pixel_difference"}
    assert differences["full_scale"] < 1 < differences["reduced_scale"] < 20  # grey levels, against timm's crop
    for figure in result["figures"]:
        if figure["name"] == "fast_crop_pixel_difference":
            continue
        assert figure["value"] > 0 and figure["samples"] and all(v > 0 for v in figure["samples"]), figure
        assert figure["device"] and figure["command"] and isinstance(figure["settings"], dict), figure
    exact = {f["variant"]: f["extra"]["exact_resume_with_workers"] for f in result["figures"]
             if f["name"] == "epoch_start_latency"}
    assert exact == {"workers=ours": True, "workers=persistent": False, "workers=per_epoch": True}
    e2e = next(f for f in result["figures"] if f["name"] == "e2e_train")
    assert 0 <= e2e["extra"]["data_wait_fraction"] < 1 and e2e["command"].startswith("python train.py")
    step = next(f for f in result["figures"] if f["name"] == "train_step")
    assert step["extra"]["train_flops_per_image"] > 0 and step["extra"]["mfu"] > 0
    assert "input_pipeline" in proc.stdout and "ours+fast_jpeg / ours" in proc.stdout  # the printed table
    stages = {f["variant"]: f["value"] for f in result["figures"] if f["name"] == "transform_stage"}
    bounds = {f["variant"]: f["value"] for f in result["figures"] if f["name"] == "speedup_bound"}
    total = sum(stages.values())
    assert bounds["decode_free"] == pytest.approx(total / (total - stages["decode"]))
    assert 1 < bounds["decode_free"] < bounds["decode_and_crop_free"]


def test_speedup_bound_is_amdahl():
    costs = {"decode": 1.0, "RandomResizedCropAndInterpolation": 1.0, "RandAugment": 2.0}
    assert speedup_bound(costs, ("decode",)) == pytest.approx(4 / 3)
    assert speedup_bound(costs, ("decode", "RandomResizedCropAndInterpolation")) == pytest.approx(2.0)
    assert speedup_bound(costs, ()) == 1.0


def test_timm_command_carries_our_model_batch_and_recipe(tmp_path):
    args = timm_args(["augment.repeated_aug=1"], tmp_path, tmp_path / "out", workers=2, device="cpu")
    text = " ".join(args)
    for flag in ["--model deit_tiny_patch16_224", "-b 128", "-j 2", "--aa rand-m9-mstd0.5-inc1", "--reprob 0.25",
                 "--remode pixel", "--mixup 0.8", "--cutmix 1.0", "--smoothing 0.1", "--drop-path 0.1", "--opt adamw",
                 "--weight-decay 0.05", "--sched cosine", "--train-interpolation bicubic", "img_size=32",
                 "patch_size=8"]:
        assert flag in text, flag
    assert "--amp" not in args and "--aug-repeats" not in args


def test_timm_step_lines_are_parsed():
    line = ("Train: 0 [   5/39 ( 15%)]  Loss: 2.30 (2.30)  Time: 0.201s,  638.31/s  (1.970s,   64.99/s)  "
            "LR: 1.291e-04  Data: 0.008 (0.076)")
    assert parse_step(line) == {"epoch": 0, "index": 5, "per_epoch": 39, "step_s": 0.201, "data_s": 0.008}
    assert parse_step("Test: [   0/1]  Time: 0.1") is None


def test_comparisons_pair_repeats_and_invert_times():
    report = Report({"summary": "cpu"}, "bench")
    for variant, samples in {"a": [2.0, 4.0], "b": [1.0, 2.0]}.items():
        report.add(Figure("x", variant, sorted(samples)[len(samples) // 2], "s", "cpu", "cmd", {}, samples))
    assert report.compare("x", "a", "b").paired_ratios == [2.0, 2.0]
    assert report.compare("x", "a", "b", lower_is_better=True).ratio == 0.5
    assert "x" in report.table()


def _bench_script():
    """scripts/bench.py as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_script", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, says", [
    (["--run-model", "deit_small"], "exactly one image set: --run-data DIR"),
    (["--draw-jpegs", "64", "--run-data", "."], "exactly one image set"),
    (["--draw-jpegs", "64", "--run-model", "deit_huge"], "--run-model deit_huge: no such model group option"),
    (["--draw-jpegs", "64", "--run-model-kwargs", "embed_dim"], "'embed_dim' is not NAME=VALUE"),
    (["--draw-jpegs", "16", "--run-batch", "32"], "fewer than one batch of 32"),
    (["--draw-jpegs", "64", "--draw-classes", "21"], "a drawn set has 1 to 20 classes"),
    (["--run-data", "nowhere"], "nowhere/train is missing or holds no class folder"),
    (["--sections", "step", "--draw-jpegs", "64"], "add e2e_run to --sections"),
])
def test_e2e_run_on_jpegs_refuses_bad_flags_before_anything_runs(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bench = _bench_script()
    argv = ["--skip-timm", "--sections", "e2e_run", *argv]
    with pytest.raises(SystemExit) as stopped:
        bench.settings_from(bench.parse_args(argv), argv)
    (line,) = capsys.readouterr().err.splitlines()  # one line, exit status 2 (scripts/bench.py's refuse)
    assert stopped.value.code == 2 and line.startswith("error: ") and says in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_both_sides_of_a_run_on_jpegs_train_the_same_model_size_batch_and_data(tmp_path):
    from deit_ablate.bench.compose import compose_run
    from deit_ablate.bench.whole_run import JpegRun, image_folder_overrides

    for split in ("train", "val"):
        for name in ("a", "b", "c"):
            (tmp_path / split / name).mkdir(parents=True)
    run = JpegRun(data=tmp_path, model="deit_tiny", model_kwargs={"embed_dim": "64", "depth": "2"}, size=224, batch=256)
    overrides = image_folder_overrides(run, 14, "cuda", tmp_path / "cache")
    cfg = compose_run(overrides)
    assert (cfg.data.name, cfg.data.root, cfg.data.num_classes) == ("imagefolder", str(tmp_path), 3)
    assert (cfg.resolution.train_size, cfg.resolution.eval_size, cfg.resolution.crop_pct) == (224, 224, 0.875)
    assert (cfg.train.global_batch, cfg.train.micro_batch, cfg.augment.repeated_aug) == (256, 256, 1)
    assert dict(cfg.model.kwargs) == {"embed_dim": 64, "depth": 2}
    text = " ".join(timm_args(overrides, tmp_path, tmp_path / "out", workers=14, device="cuda"))
    for flag in [f"--data-dir {tmp_path}", "--num-classes 3", "--model deit_tiny_patch16_224", "--img-size 224",
                 "-b 256", "-j 14", "embed_dim=64 depth=2 img_size=224", "--amp --amp-dtype bfloat16"]:
        assert flag in text, flag


@pytest.mark.slow
def test_e2e_run_trains_a_model_on_drawn_jpegs(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(tmp_path / "cache"), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--skip-timm", "--sections",
                           "e2e_run", "--draw-jpegs", "32", "--draw-classes", "2", "--run-model", "deit_tiny",
                           "--run-model-kwargs", "embed_dim=32,depth=1,num_heads=2", "--run-size", "32",
                           "--run-batch", "16", "--workers", "0", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [figure] = [f for f in json.loads(out.read_text())["figures"] if f["name"] == "e2e_run_wall"]
    assert figure["variant"] == "ours" and figure["value"] > 0
    assert figure["settings"]["train_size"] == 32 and figure["settings"]["data"].endswith("-val4-c2")
    assert "data=imagefolder" in figure["command"] and "++model.kwargs.depth=1" in figure["command"]
    drawn = tmp_path / "cache" / "bench" / "jpeg-500x375-q90-n32-seed0-val4-c2"
    assert len(list(drawn.glob("train/*/*.jpg"))) == 32 and len(list(drawn.glob("val/*/*.jpg"))) == 4
