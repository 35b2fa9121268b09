"""scripts/wheelhouse.sh: its argument errors, the requirement list it downloads (torch and torchvision left out),
and (slow) a wheelhouse for this Python installed with --no-index into a fresh venv that has torch, where train.py
composes its config."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "wheelhouse.sh"


def _run(args: list[str], cwd, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_usage_errors(tmp_path):
    for args in ([], ["--list"], ["--python"], [str(tmp_path / "a"), str(tmp_path / "b")], ["--bogus", "x"]):
        proc = _run(args, tmp_path)
        assert proc.returncode == 2 and "usage: bash scripts/wheelhouse.sh DIR" in proc.stderr, (args, proc.stderr)
    proc = _run([str(tmp_path / "w"), "--python", "three"], tmp_path)
    assert proc.returncode == 2 and "--python takes X.Y" in proc.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.whl").write_text("")
    proc = _run([str(tmp_path / "full")], tmp_path)
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing written


def test_list_leaves_torch_and_torchvision_out(tmp_path):
    proc = _run([str(tmp_path / "w"), "--list"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    wanted = [line.split("#")[0].strip() for line in proc.stdout.splitlines() if not line.startswith("#")]
    names = {req.split("=")[0].split(">")[0].split("<")[0] for req in wanted}
    assert {"timm", "hydra-core", "wandb", "submitit", "antlr4-python3-runtime", "deit-ablate"} <= names
    assert not names & {"torch", "torchvision", "nvidia-dali-cuda130", "pytest"}, wanted
    assert "Python 3.12 on manylinux_2_28_x86_64" in proc.stdout and "left out: nvidia-dali" in proc.stdout
    assert not (tmp_path / "w").exists()

    proc = _run([str(tmp_path / "w"), "--list", "--with-dev", "--with-dali", "--python", "local"], tmp_path)
    names = {line.split(">")[0].split("=")[0] for line in proc.stdout.splitlines() if not line.startswith("#")}
    assert {"pytest", "ruff", "nvidia-dali-cuda130"} <= names and not names & {"torch", "torchvision"}
    assert f"Python {sys.version_info.major}.{sys.version_info.minor} on" in proc.stdout


@pytest.mark.slow
def test_wheelhouse_installs_without_an_index_beside_torch(tmp_path):
    """9 minutes on the shared 2-core machine: the wheelhouse 27 s, torch and torchvision (from local disk) 6
    minutes, the install from the wheelhouse 98 s, the imports and train.py 37 s."""
    house, venv, checkout = tmp_path / "house", tmp_path / "venv", tmp_path / "checkout"
    started = time.monotonic()
    proc = _run([str(house), "--python", "local"], tmp_path, timeout=600)
    house_done = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    wheels = sorted(p.name for p in house.iterdir())
    assert not [w for w in wheels if w.lower().startswith(("torch-", "torchvision-", "triton-", "nvidia"))], wheels
    assert any(w.startswith("deit_ablate-") for w in wheels) and any(w.startswith("antlr4_") for w in wheels)
    assert "in all" in proc.stdout and "nvidia-dali left out" in proc.stdout

    # A node's image: a venv with torch and torchvision in it, and nothing of this checkout's .venv.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [python, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.14.1", "torchvision==0.29.1"], check=True, env=env, timeout=900)
    torch_done = time.monotonic()
    install = subprocess.run([*pip, "--no-index", "--find-links", str(house), "deit-ablate"], env=env,
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    install_done = time.monotonic()

    imports = "import deit_ablate, hydra, timm, wandb, submitit"
    subprocess.run([python, "-c", imports], check=True, env=env, cwd=tmp_path)
    checkout.mkdir()
    shutil.copy(REPO / "train.py", checkout)
    shutil.copytree(REPO / "conf", checkout / "conf")
    job = subprocess.run([python, "train.py", "--cfg", "job"], cwd=checkout, env=env, capture_output=True, text=True,
                         timeout=300)
    assert job.returncode == 0 and "model:" in job.stdout, job.stderr
    where = subprocess.run([python, "-c", "import deit_ablate; print(deit_ablate.__file__)"], cwd=checkout, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert str(venv) in where  # the wheel's package, not this checkout's
    print(f"wheelhouse {house_done - started:.0f} s, torch {torch_done - house_done:.0f} s, install from the "
          f"wheelhouse {install_done - torch_done:.0f} s, checks {time.monotonic() - install_done:.0f} s")
