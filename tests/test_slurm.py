"""Against the real one-node SLURM cluster of scripts/slurm_up.sh (16 CPUs, 8 fake GPUs): sweeps of 8-rank
jobs over Gloo, fine-tunes chained after their pre-training, requeue mid-training, errors before sbatch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.record.rundir import LAST, RESULT, SUBMITIT, RunDir, runs_root, wandb_root
from tests.conftest import REPO, TINY, run_train, tiny_with

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch: start the cluster with scripts/slurm_up.sh"),
]
# 8 tasks x 2 CPUs fit the test node; a global batch of 32 is 4 images per rank.
SLURM = ["hydra/launcher=slurm_8gpu", "hydra.launcher.cpus_per_task=2", "hydra.launcher.timeout_min=20"]
TINY_8 = tiny_with(4)  # 8 micro-batches of 4: one per rank


def _rank_logs(cwd: Path) -> list[str]:
    return [p.read_text() for p in (runs_root(cwd / "outputs") / SUBMITIT).rglob("*_log.out")]


def _results(cwd: Path) -> dict[str, dict]:
    out = {}
    for path in (runs_root(cwd / "outputs")).glob(f"*/{RESULT}"):
        overrides = RunDir(path.parent).hydra_overrides.read_text()
        out["finetune" if "stage=finetune" in overrides else "pretrain"] = json.loads(path.read_text())
    return out


def test_sweep_runs_8_rank_jobs_and_chains_the_finetune_after_its_pretraining(tmp_path, data_cache):
    proc = run_train(["-m", "stage=pretrain,finetune", "train.max_steps=3"] + SLURM + TINY_8, tmp_path, data_cache,
                     timeout=900)
    assert re.search(r"#1 : stage=finetune .* waits for job \d+", proc.stderr + proc.stdout, re.S)
    results = _results(tmp_path)
    assert set(results) == {"pretrain", "finetune"}
    assert all(r["status"] == "finished" and r["steps_done"] == 3 for r in results.values())
    logs = "\n".join(_rank_logs(tmp_path))
    for rank in range(8):  # every job formed one Gloo group of world size 8
        assert len(re.findall(rf"\[dist\] rank {rank} of 8 \(local rank {rank} on \S+\) joined the process group "
                              r"\(gloo, cpu\)", logs)) == 2
    # printed by rank 0 only
    assert logs.count("global batch 32 = 8 micro-batches of 4 (virtual slots), 1 per rank and step") == 2
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert len(runs) == 2 and {r.config["stage"] for r in runs} == {"pretrain", "finetune"}  # rank 0 only
    assert all(r.summary["world_size"] == 8 for r in runs)


def test_dry_run_on_the_slurm_launcher_plans_without_queueing(tmp_path, data_cache):
    queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    proc = run_train(["-m", "stage=pretrain,finetune", "runtime.dry_run=true"] + SLURM + TINY_8, tmp_path, data_cache)
    plan = [line for line in proc.stdout.splitlines() if line.startswith("[dry run]")]
    assert len(plan) == 2 and "train from step 0" in plan[0] and "wait for its pre-training" in plan[1]
    now = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    assert not set(now) - set(queued)  # no new job (an earlier test's job may end meanwhile)
    assert not (runs_root(tmp_path / "outputs") / SUBMITIT).exists()  # nothing submitted


def test_requeued_job_resumes_and_ends_with_the_same_step_count(tmp_path, data_cache):
    tiny = [o for o in TINY_8 if o != "train.epochs=1"]
    args = ["-m", "runtime.checkpoint_every_steps=1", "train.epochs=6"] + SLURM + tiny
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checkpoint = None
    deadline = time.time() + 600
    while time.time() < deadline and driver.poll() is None:
        found = list((runs_root(tmp_path / "outputs")).glob(f"*/{LAST}"))
        if found:
            try:
                step = torch.load(found[0], weights_only=True)["step"]
            except Exception:  # being replaced right now
                step = 0
            if step >= 3:
                checkpoint = found[0]
                break
        time.sleep(0.5)
    assert checkpoint is not None, "the job never reached step 3"
    submitit_dir = runs_root(tmp_path / "outputs") / SUBMITIT
    job_id = next(p.name for p in submitit_dir.iterdir() if p.is_dir() and p.name.isdigit())
    # What a task killed while saving its result leaves; the requeued attempt must not trip over it.
    (submitit_dir / job_id / f"{job_id}_5_result.pkl.save_tmp").write_bytes(b"")
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        output, _ = driver.communicate(timeout=900)
    finally:
        driver.kill()
        subprocess.run(["scancel", job_id], check=False)
    assert driver.returncode == 0, output
    result = json.loads(RunDir(checkpoint.parent).result.read_text())
    steps_per_epoch = 8  # 256 repeated images over 8 ranks at 4 per rank
    assert result["status"] == "finished" and result["steps_done"] == 6 * steps_per_epoch
    logs = "\n".join(_rank_logs(tmp_path))
    assert "resuming" in logs  # the requeued job started from the checkpoint, not from scratch
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert len({r.run_id for r in runs}) == 1  # one wandb run, however many attempts wrote to it


def test_config_errors_are_reported_before_anything_is_submitted(tmp_path, data_cache):
    before = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, check=True).stdout
    proc = run_train(["-m", "train.global_batch=36", "train.micro_batch=6", "mix=none,cutmix_only"] + SLURM + TINY[:5],
                     tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "cannot be dealt equally over 8 processes" in proc.stderr
    assert "Nothing was submitted" in proc.stderr
    proc = run_train(["-m", "data=imagenet", "mix=none,cutmix_only"] + SLURM + TINY_8, tmp_path, data_cache,
                     check=False)
    assert proc.returncode == 2 and "data.root" in proc.stderr
    assert not (runs_root(tmp_path / "outputs") / SUBMITIT).exists()
    after = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, check=True).stdout
    assert not set(after.split()) - set(before.split())  # no new job (an earlier test's may still be ending)


def test_two_jobs_of_one_experiment_under_two_names_started_together_train_it_once(tmp_path, data_cache):
    """`deit3=baseline` and `recipe=deit3 model=vit_base`: one experiment under two folder names, submitted by two
    sweeps at once as one-task jobs on the two-node partition, both starting before either made its folder. One
    trains it; the other waits for the holder and finds it finished, in the first's folder (the experiment's lock
    covers picking and taking the folder)."""
    one_task = ["hydra/launcher=slurm_8gpu", "hydra.launcher.partition=multi", "hydra.launcher.tasks_per_node=1",
                "hydra.launcher.gpus_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=20"]
    args = ["train.max_steps=6", "runtime.wait_for_lock=true", *one_task, *TINY]
    run_train(["runtime.dry_run=true", *TINY], tmp_path, data_cache)  # the built-in data drawn before the race
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    drivers = [subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", *row, *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for row in (["deit3=baseline"], ["recipe=deit3", "model=vit_base"])]
    outputs = [driver.communicate(timeout=900)[0] for driver in drivers]
    assert [driver.returncode for driver in drivers] == [0, 0], [out[-2000:] for out in outputs]
    logs = "\n".join(_rank_logs(tmp_path))
    folders = [p for p in runs_root(tmp_path / "outputs").iterdir() if p.is_dir() and p.name != SUBMITIT]
    assert len(folders) == 1, (folders, logs[-3000:])  # the other name's folder, empty, removed
    result = json.loads(RunDir(folders[0]).result.read_text())
    assert result["status"] == "finished" and result["steps_done"] == 6
    assert len(read_offline(wandb_root(tmp_path / "outputs"))) == 1, logs[-3000:]  # trained once
    assert "already finished" in logs, logs[-3000:]
