"""train.py end to end in a subprocess: a finished run, divergence, resume, sweeps and bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.record.rundir import RESULT, RunDir, runs_root, wandb_root
from tests.conftest import TINY, SharedRun, run_train


def _only_run_dir(cwd: Path) -> Path:
    runs = [p for p in (runs_root(cwd / "outputs")).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_tiny_run_trains_evaluates_checkpoints_and_logs(tiny_run: SharedRun):
    proc, cwd = tiny_run.proc, tiny_run.cwd
    run_dir = _only_run_dir(cwd)
    result = json.loads(RunDir(run_dir).result.read_text())
    assert result["status"] == "finished" and result["steps_done"] == 8  # 256 repeated images / batch 32
    assert 0.0 <= result["top1"] <= 100.0 and result["top5_final"] >= result["top1"]
    state = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
    assert state["epoch"] == 1 and state["step"] == 8 and "pos_embed" in state["model"]
    assert RunDir(run_dir).best_checkpoint.exists()
    assert not list(run_dir.glob(".*.tmp"))  # no half-written checkpoint left behind
    assert "status    finished" in proc.stdout and "top-1" in proc.stdout
    assert "| img/s " in proc.stderr and "| lr " in proc.stderr and "| loss " in proc.stderr  # the progress lines
    assert "\r" not in proc.stderr  # stderr is a pipe: plain lines, not a redrawn bar (tests/test_status.py)
    assert "global batch 32 = 4 micro-batches of 8 (virtual slots), 4 per rank and step" in proc.stdout
    offline = list((wandb_root(cwd / "outputs")).glob(f"offline-run-*-{result['run_id']}"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    (logged,) = read_offline(wandb_root(cwd / "outputs"))
    assert logged.config["ablation"] == "baseline" and logged.config["mix"]["mixup_alpha"] == 0.8
    assert {"baseline", "pretrain", "demo"} == set(logged.tags)
    assert logged.summary["status"] == "finished" and logged.summary["top1"] == result["top1"]
    assert logged.summary["accum_steps"] == 4 and logged.summary["slots"] == 4 and logged.summary["world_size"] == 1
    assert not re.search(r"api_key|password|secret|token\b|WANDB_", json.dumps(logged.config), re.I)


def test_relaunch_skips_a_finished_run(tmp_path, data_cache, tiny_run: SharedRun):
    tiny_run.copy_into(tmp_path)  # TINY, trained once
    proc = run_train(TINY, tmp_path, data_cache)
    assert "already finished" in proc.stdout and "skipping" in proc.stdout
    assert len(list((wandb_root(tmp_path / "outputs")).glob("offline-run-*"))) == 1


def test_divergence_ends_the_run_as_a_result_with_exit_status_0(tmp_path, data_cache):
    proc = run_train(TINY + ["optimizer.lr=1e12", "optimizer.warmup_epochs=0"], tmp_path, data_cache)
    assert proc.returncode == 0
    result = json.loads(RunDir(_only_run_dir(tmp_path)).result.read_text())
    assert result["status"] == "diverged" and result["steps_done"] < 8
    assert "diverged" in proc.stdout


# loader workers draw per sample (with 2 workers: slow; test_streams.py and test_invariance.py check the
# samples' draws epoch by epoch, and layouts, in the default suite)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_is_exact_two_epochs_equal_one_plus_resume_plus_one(resumed_runs, workers):
    a, _, first_half = resumed_runs(workers).checkpoints  # the weights are equal, checked by the helper
    assert first_half["epoch"] == 1 and first_half["step"] == 8
    assert not torch.equal(a["model"]["head.weight"], first_half["model"]["head.weight"])


def test_mix_sweep_runs_three_runs_in_one_sweep_folder(mix_sweep: SharedRun):
    proc, tmp_path = mix_sweep.proc, mix_sweep.cwd  # -m mix=none,mixup_only,cutmix_only, trained once
    runs = sorted(p.name for p in (runs_root(tmp_path / "outputs")).iterdir() if p.is_dir())
    assert len(runs) == 3 and all(name.startswith("data.builtin") for name in runs)
    assert {name.split("mix=")[1].split(",")[0] for name in runs} == {"none", "mixup_only", "cutmix_only"}
    for name in runs:
        result = json.loads(RunDir.under(tmp_path / "outputs", name).result.read_text())
        assert result["status"] == "finished"
    assert proc.stdout.count("status    finished") == 3


def test_missing_data_root_is_a_clear_error_and_leaves_nothing(tmp_path, data_cache):
    proc = run_train(["data=imagenet"] + TINY, tmp_path, data_cache, check=False)
    assert proc.returncode == 2
    assert "data=imagenet needs data.root" in proc.stderr and "data.root=/path/to/imagenet" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any((runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}"))
    proc = run_train(["data=imagenet", f"data.root={tmp_path / 'nowhere'}"] + TINY, tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_imagefolder_without_val_split_names_the_layout(tmp_path, data_cache):
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)
    proc = run_train(["data=imagenet", f"data.root={tmp_path / 'data'}"] + TINY, tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "no val folder" in proc.stderr


def test_odd_batch_with_mixup_is_a_clear_error(tmp_path, data_cache):
    proc = run_train(TINY + ["train.global_batch=36", "train.micro_batch=9"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "must be even" in proc.stderr and "train.micro_batch=9" in proc.stderr
    assert not list(tmp_path.glob("outputs/wandb/offline-run-*")) and not list(tmp_path.glob("outputs/runs/*"))


def test_a_device_that_cannot_hold_a_micro_batch_is_refused_in_one_line_before_anything_is_written(tmp_path,
                                                                                                  data_cache):
    proc = run_train(TINY + ["runtime.max_batch_per_device=4"], tmp_path, data_cache, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr
    assert "runtime.max_batch_per_device=4" in lines[0] and "train.micro_batch=8" in lines[0]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.*"))


def test_unknown_model_name_is_a_clear_error(tmp_path, data_cache):
    proc = run_train(TINY + ["model.name=deit_tinny_patch16_224"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "timm has no model named 'deit_tinny_patch16_224'" in proc.stderr


def test_one_process_accumulates_the_recipes_micro_batches(one_step_run: SharedRun):
    proc = one_step_run.proc  # TINY + train.micro_batch=16 (and one step)
    assert "global batch 32 = 2 micro-batches of 16 (virtual slots), 2 per rank and step" in proc.stdout


def test_resume_mid_epoch_skips_the_batches_already_done(tmp_path, data_cache, stopped_at_step_3):
    stopped, args = stopped_at_step_3  # TINY + runtime.checkpoint_every_steps=2, run with train.max_steps=3
    run_dir = tmp_path / "run"
    shutil.copytree(stopped.cwd / "run", run_dir)
    args = args + [f"hydra.run.dir={run_dir}"]
    state = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
    assert (state["epoch"], state["batches_done"], state["step"]) == (0, 3, 3)
    RunDir(run_dir).result.unlink()  # as if the job had been preempted after step 3
    proc = run_train(args, tmp_path, data_cache)
    assert "epoch 1 (batch 3), step 3" in proc.stdout
    final = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
    assert (final["epoch"], final["step"]) == (1, 8)  # the same step count as a run never interrupted


def test_cpu_threads_sets_torch_threads_and_zero_is_refused(tmp_path, data_cache, one_step_run: SharedRun):
    proc = one_step_run.proc  # TINY + train.max_steps=1 runtime.cpu_threads=2; the environment says 1 thread
    assert "device cpu, 2 torch thread(s)" in proc.stdout
    proc = run_train(TINY + ["runtime.cpu_threads=0", "runtime.output_root=zero"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "runtime.cpu_threads=0 must be >= 1" in proc.stderr
    assert not list(tmp_path.glob("zero/runs/*"))  # no run folder left behind
