"""scripts/gpu_check.sh: its argument handling, its one-line stop without a GPU, its table, and (slow) its whole
flow on the CPU at 224 px with a narrow DeiT (--dry), which writes the JSON a GPU session commits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from deit_ablate.bench.env import cpu_calls
from deit_ablate.bench.gpu_check import NO_GPU_EXIT, TARGETS, _sizes, measure_fp16, table
from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _run(args: list[str], tmp_path, extra_env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_without_a_gpu_it_stops_at_once_with_one_line(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run([str(out)], tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == NO_GPU_EXIT == 3
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA GPU is visible" in lines[0] and "--dry" in lines[0], proc.stderr
    assert not out.exists() and "Traceback" not in proc.stderr


def test_usage_errors(tmp_path):
    for args in ([], ["--dry"]):
        proc = _run(args, tmp_path)
        assert proc.returncode == 2 and "usage: bash scripts/gpu_check.sh OUT.json" in proc.stderr
    proc = _run([str(tmp_path / "gpu.json")], tmp_path, {"PYTHON": str(tmp_path / "no-python")})
    assert proc.returncode == 2 and "bash scripts/install.sh" in proc.stderr


def test_table_marks_the_issues_targets():
    results = {"matmul_bf16_tflops": 700.0, "matmul_dtype": "bfloat16", "host_syncs_per_step": 0.0,
               "train_step_eager": {"images_per_s": 3100.0, "mfu": 0.41, "model": "deit_base_patch16_224"},
               "train_step_compile": {"images_per_s": 3500.0, "mfu": 0.46, "model": "deit_base_patch16_224"},
               "pipeline_pil": {"images_per_s": 3000.0}, "pipeline_dali": {"images_per_s": 3900.0},
               "distill_hard_token_step": {"images_per_s": 1200.0}, "peak_memory_gib": 40.0,
               "train_step_fp16": {"images_per_s": 3300.0, "amp_skipped_steps": 4, "steps": 67,
                                   "loss_scale": 4096.0}}
    text = table({"device": {"summary": "H200"}, "seconds": 300.0, "results": results})
    lines = {line.split("  ")[1].strip(): line for line in text.splitlines()[1:] if line.strip()}
    assert "target >= 3,000: met" in lines["train step eager (deit_base_patch16_224)"]
    assert "target >= 4,000: NOT met" in lines["pipeline dali"]
    assert "41.0 %" in text and "46.0 %" in text and "40.0 GiB" in text
    assert "3,300.0 images/s" in lines["train step fp16 (loss scaler)"]
    assert re.search(r"\n    fp16 skipped steps / final loss scale +4 of 67 / 4,096\n", text)
    assert TARGETS == {"train_step_eager_images_per_s": 3000.0, "pipeline_dali_images_per_s": 4000.0}


def test_fp16_entry_trains_with_the_loss_scaler_on_the_cpu_at_dry_sizes(data_cache):
    results = {}
    measure_fp16(_sizes(dry=True), torch.device("cpu"), str(data_cache / "builtin"), results, cpu_calls())
    fp16 = results["train_step_fp16"]
    assert fp16["amp"] == "fp16" and fp16["images_per_s"] > 0 and all(v > 0 for v in fp16["samples"])
    assert fp16["steps"] == 1 + 1 + 2 + 1  # first loss, warm-up, one repeat of 2, last loss
    assert 0 <= fp16["amp_skipped_steps"] <= fp16["steps"]
    assert fp16["loss_scale"] == 2.0**16 * 0.5 ** fp16["amp_skipped_steps"]  # no growth within 2000 steps
    assert fp16["loss_first"] > 0 and fp16["loss_last"] > 0


@pytest.mark.slow
def test_dry_run_writes_every_figure(tmp_path, data_cache):
    out = tmp_path / "gpu.json"
    proc = _run([str(out), "--dry"], tmp_path, {"DEIT_ABLATE_CACHE": str(data_cache)}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["dry"] is True and report["command"].startswith("bash scripts/gpu_check.sh")
    assert results["matmul_bf16_tflops"] > 0
    for key in ("train_step_eager", "train_step_compile", "train_step_fp16", "distill_hard_token_step", "pipeline_pil",
                "pipeline_dali"):
        assert results[key]["images_per_s"] > 0 and all(v > 0 for v in results[key]["samples"]), key
    assert 0 < results["train_step_eager"]["mfu"] and results["train_step_eager"]["train_gflops_per_image"] > 0
    assert results["train_step_eager"]["size"] == results["pipeline_pil"]["train_size"] == 224
    assert results["train_step_eager"]["model"] == "deit_tiny_patch16_224"  # narrowed: one block of width 48
    assert results["host_syncs_per_step"] == 0.0  # train_steps ran on the loader's uint8 batches (HostReads)
    assert results["distill_hard_token_step"]["student"] == "VisionTransformerDistilled"
    assert results["train_step_fp16"]["amp"] == "fp16" and results["train_step_fp16"]["loss_scale"] > 0
    assert 0 <= results["train_step_fp16"]["amp_skipped_steps"] <= results["train_step_fp16"]["steps"]
    assert "pipeline dali" in proc.stdout and f"wrote {out}" in proc.stdout
