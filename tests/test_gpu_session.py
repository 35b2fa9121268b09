"""scripts/gpu_session.sh: its argument errors and one-line stop without a GPU, every part run (and the exit status
non-zero) when parts fail, and (slow) its whole flow on the CPU at toy sizes (--dry) with every file in OUTDIR."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deit_ablate.record.rundir import RunDir
from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_session.sh"
PARTS = ("demo", "gpu_check", "e2e_run")


def _run(args: list[str], tmp_path: Path, extra_env: dict | None = None, timeout: int = 120
         ) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TIMM_TRAIN", "GPU_SESSION_"))}
    env.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(extra_env or {})})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, env, says", [
    ([], {}, "usage: bash scripts/gpu_session.sh OUTDIR"),
    (["out", "other"], {}, "usage:"),
    (["out", "--fast"], {}, "usage:"),
    (["out", "--timm-train"], {}, "usage:"),
    (["out", "--timm-train", "no_train.py"], {}, "timm's train.py no_train.py is not a file"),
    (["out"], {"TIMM_TRAIN": "no_train.py"}, "timm's train.py no_train.py is not a file"),
    (["out", "--dry"], {"GPU_SESSION_CHECK_S": "400"}, "exceed the session's 540 s"),
    (["out", "--dry"], {"GPU_SESSION_DEMO_S": "1m"}, "time limit '1m' is not a positive number"),
    (["out"], {"PYTHON": "no-python"}, "no-python not found"),
])
def test_bad_arguments_stop_before_anything_is_written(args, env, says, tmp_path):
    proc = _run(args, tmp_path, env)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_without_a_gpu_it_stops_at_once_with_one_line(tmp_path):
    proc = _run(["out"], tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 3
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA GPU is visible" in lines[0] and "--dry" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_every_part_runs_and_the_exit_is_1_when_parts_fail(tmp_path):
    timm = tmp_path / "timm_train.py"
    timm.write_text("")
    out = tmp_path / "out"
    proc = _run([str(out), "--dry", "--timm-train", str(timm)], tmp_path,
                {"GPU_SESSION_DEMO_S": "1", "GPU_SESSION_CHECK_S": "1", "GPU_SESSION_RUNS_S": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [part["part"] for part in summary["parts"]] == list(PARTS) and summary["failed"] is True
    for part in summary["parts"]:
        assert part["status"] == "timed out after 1 s" and part["exit"] == 124 and part["seconds"] < 20, part
        assert (out / f"{part['part']}.log").is_file()
    assert "timed out after 1 s" in (out / "summary.txt").read_text()


@pytest.mark.slow
def test_dry_session_runs_every_part_into_outdir(tmp_path, data_cache):
    out = tmp_path / "out"
    proc = _run([str(out), "--dry"], tmp_path, {"DEIT_ABLATE_CACHE": str(data_cache)}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry"] is True and summary["failed"] is False
    statuses = {part["part"]: part["status"] for part in summary["parts"]}
    assert statuses == {"demo": "ok", "gpu_check": "ok", "e2e_run": "skipped: no timm train.py"}
    for name in PARTS:
        assert (out / f"{name}.log").is_file(), name
    assert "e2e_run skipped: timm's train.py is not given" in (out / "e2e_run.log").read_text()
    [run] = [path for path in (out / "demo" / "runs").iterdir() if path.is_dir()]
    assert RunDir(run).result.is_file()
    assert "top-1" in (out / "demo.log").read_text()
    check = json.loads((out / "gpu_check.json").read_text())
    assert check["dry"] is True and check["results"]["train_step_eager"]["images_per_s"] > 0
    table = (out / "summary.txt").read_text()
    assert all(name in table for name in PARTS) and "part" in table.splitlines()[1]
