"""The README's main job, `python train.py`, as a new user runs it (slow: a few minutes)."""

from __future__ import annotations

import json

import pytest

from deit_ablate.record.rundir import RunDir, runs_root
from tests.conftest import run_train


@pytest.mark.slow
@pytest.mark.alone  # the demo as a user runs it, on both cores: beside another test it runs several times slower
def test_default_demo_learns_well_above_chance(tmp_path, data_cache):
    proc = run_train([], tmp_path, data_cache, extra_env={"OMP_NUM_THREADS": "2"}, timeout=900)
    run_dir = next((runs_root(tmp_path / "outputs")).glob("default-*"))
    result = json.loads(RunDir(run_dir).result.read_text())
    assert result["status"] == "finished" and result["epochs_done"] == 10
    assert result["top1"] >= 30.0  # 3x chance on 10 classes, with every ingredient of the recipe on
    assert "rand-m9-mstd0.5-inc1" in RunDir(run_dir).hydra_config.read_text()
    print(f"demo: top-1 {result['top1']:.1f}% in {result['train_seconds']:.0f}s of training")
    assert "status    finished" in proc.stdout
