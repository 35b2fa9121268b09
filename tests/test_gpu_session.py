"""scripts/gpu_session.sh: its argument errors and one-line stop without a GPU, every part run (and the exit status
non-zero) when parts fail, the parts skipped when the install from a wheelhouse fails, and (slow) its whole flow on
the CPU at toy sizes (--dry) with every file in OUTDIR, and with the install from a wheelhouse over an image's
Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deit_ablate.record.rundir import RunDir
from tests.conftest import REPO
from tests.test_wheelhouse import TORCH, build_wheelhouse, image_python

SCRIPT = REPO / "scripts" / "gpu_session.sh"
PARTS = ("demo", "gpu_check", "host_step", "e2e_run")


def _run(args: list[str], tmp_path: Path, extra_env: dict | None = None, timeout: int = 120,
         drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TIMM_TRAIN", "GPU_SESSION_")) and key not in drop}
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
    (["out", "--wheelhouse"], {}, "usage:"),
    (["out", "--python", sys.executable], {}, "--python names the image's Python"),
    (["out", "--wheelhouse", "no-house"], {}, "the wheelhouse no-house is not a folder; build one with"),
])
def test_bad_arguments_stop_before_anything_is_written(args, env, says, tmp_path):
    proc = _run(args, tmp_path, env)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_relative_paths_are_the_callers(tmp_path):
    (tmp_path / "house").mkdir()
    (tmp_path / "house" / "deit_ablate-0-py3-none-any.whl").write_bytes(b"")
    _not_torch(tmp_path)
    proc = _run(["out", "--wheelhouse", "house", "--python", "python-without-torch"], tmp_path)
    # the caller's house/ and ./python-without-torch were found (not the checkout's): the check that stops it is torch
    assert proc.returncode == 2 and f"{tmp_path}/python-without-torch does not import torch" in proc.stderr, \
        proc.stderr


def _any_python(tmp_path: Path) -> Path:
    """A stand-in for the image's Python where no check reaches it: every `-c` runs (no 1.5 s torch import)."""
    script = tmp_path / "python-that-imports-torch"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    return script


def _not_torch(tmp_path: Path) -> Path:
    """A stand-in for a Python without torch: `-c ""` runs, `-c "import torch"` fails."""
    script = tmp_path / "python-without-torch"
    script.write_text('#!/bin/sh\ntest "$2" = ""\n')
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("case, says", [
    ("empty", "holds no deit_ablate wheel; build it with bash scripts/wheelhouse.sh DIR"),
    ("no-python", "--python no-python cannot be run; give the image's Python"),
    ("no-torch", "does not import torch; give the image's Python"),
    ("venv-taken", "exists and is not a venv; remove it, or set GPU_SESSION_VENV"),
    ("limits", "the parts' time limits 91 + 75 + 225 + 30 + 120 s exceed the session's 540 s"),
])
def test_bad_wheelhouse_arguments_stop_before_anything_is_written(case, says, tmp_path):
    house, venv = tmp_path / "house", tmp_path / "venv"
    house.mkdir()
    if case != "empty":
        (house / "deit_ablate-0.1.0-py3-none-any.whl").write_text("")
    python = {"no-python": "no-python", "no-torch": _not_torch}.get(case, _any_python)
    python = python if isinstance(python, str) else str(python(tmp_path))
    if case == "venv-taken":
        venv.mkdir()
    env = {"GPU_SESSION_VENV": str(venv), "GPU_SESSION_INSTALL_S": "91" if case == "limits" else "90"}
    before = sorted(tmp_path.iterdir())
    proc = _run(["out", "--dry", "--wheelhouse", str(house), "--python", python], tmp_path, env)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and sorted(tmp_path.iterdir()) == before


def test_a_failed_install_skips_the_other_parts(tmp_path):
    """A wheelhouse whose deit_ablate wheel is no wheel: pip fails, the parts after it are skipped, the exit is 1."""
    house, venv, out = tmp_path / "house", tmp_path / "venv", tmp_path / "out"
    house.mkdir()
    (house / "deit_ablate-0.1.0-py3-none-any.whl").write_text("not a zip")
    venv.mkdir()
    (venv / "bin").mkdir()  # a venv to reuse (its python fails: the venv is not made again, pip cannot run)
    (venv / "bin" / "python").symlink_to("/bin/false")
    proc = _run([str(out), "--dry", "--wheelhouse", str(house), "--python", str(_any_python(tmp_path))], tmp_path,
                {"GPU_SESSION_VENV": str(venv)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    statuses = {part["part"]: part["status"] for part in summary["parts"]}
    assert statuses == {"install": "failed", **{name: "skipped: install failed" for name in PARTS}}
    assert summary["failed"] is True and summary["wheelhouse"] == str(house)
    assert "reusing the venv" in (out / "install.log").read_text()
    assert "skipped: the install failed" in (out / "demo.log").read_text()
    assert "skipped: install failed" in (out / "summary.txt").read_text()


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
                {"GPU_SESSION_DEMO_S": "1", "GPU_SESSION_CHECK_S": "1", "GPU_SESSION_HOST_S": "1",
                 "GPU_SESSION_RUNS_S": "1"})
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
    assert statuses == {"demo": "ok", "gpu_check": "ok", "host_step": "ok", "e2e_run": "skipped: no timm train.py"}
    for name in PARTS:
        assert (out / f"{name}.log").is_file(), name
    assert "e2e_run skipped: timm's train.py is not given" in (out / "e2e_run.log").read_text()
    [run] = [path for path in (out / "demo" / "runs").iterdir() if path.is_dir()]
    assert RunDir(run).result.is_file()
    assert "top-1" in (out / "demo.log").read_text()
    host = json.loads((out / "host_step.json").read_text())
    assert {f["name"] for f in host["figures"]} >= {"host_step", "host_step_32px", "loader_per_core"}
    check = json.loads((out / "gpu_check.json").read_text())
    assert check["dry"] is True and check["results"]["train_step_eager"]["images_per_s"] > 0
    table = (out / "summary.txt").read_text()
    assert all(name in table for name in PARTS) and "part" in table.splitlines()[1]


@pytest.mark.slow
def test_dry_session_installs_from_a_wheelhouse_over_an_image_python(tmp_path, data_cache):
    """About 3 minutes on the shared 2-core machine (2:53: the wheelhouse and the stand-in image with torch 65 s, the
    session 55 s, of which the install 18 s): a
    wheelhouse of this Python, a node's image (a venv with torch and torchvision only, as tests/test_wheelhouse.py
    makes it), then `gpu_session.sh OUTDIR --dry --wheelhouse DIR --python IMAGE`: the install part makes a venv over
    the image and installs the wheelhouse with --no-index, and every other part runs with that venv's python."""
    house, out, venv = tmp_path / "house", tmp_path / "out", tmp_path / "node-venv"
    started = time.monotonic()
    assert build_wheelhouse(house, tmp_path).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    image = image_python(tmp_path / "image", env)
    image_done = time.monotonic()
    # PYTHON names no python: a part that ran with it rather than the install's venv would fail
    proc = _run([str(out), "--dry", "--wheelhouse", str(house), "--python", str(image)], tmp_path,
                {"GPU_SESSION_VENV": str(venv), "DEIT_ABLATE_CACHE": str(data_cache), "PYTHON": "no-python"},
                timeout=900, drop=("PYTHONPATH", "VIRTUAL_ENV", "PIP_FIND_LINKS"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    statuses = {part["part"]: part["status"] for part in summary["parts"]}
    assert statuses == {"install": "ok", "demo": "ok", "gpu_check": "ok", "host_step": "ok",
                        "e2e_run": "skipped: no timm train.py"}
    assert summary["python"] == str(venv / "bin" / "python") and summary["wheelhouse"] == str(house)
    install = (out / "install.log").read_text()
    assert f"torch {TORCH}" in install and "CUDA available: False" in install, install[-3000:]
    assert "_image_site_packages.pth adds its site-packages" in install  # the stand-in image is a venv
    assert f"deit_ablate {venv}/lib/" in install  # the wheel's package, not the checkout's
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not (site / "torch").exists() and (site / "timm").is_dir()  # torch is the image's, timm the wheelhouse's
    assert f"the parts run with {venv}/bin/python" in proc.stdout
    assert "top-1" in (out / "demo.log").read_text()
    assert json.loads((out / "gpu_check.json").read_text())["dry"] is True
    assert {f["name"] for f in json.loads((out / "host_step.json").read_text())["figures"]} >= {"host_step"}
    parts = {part["part"]: part["seconds"] for part in summary["parts"]}
    print(f"wheelhouse and image {image_done - started:.0f} s, session {time.monotonic() - image_done:.0f} s: {parts}")
