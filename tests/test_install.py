"""scripts/install.sh says which PyTorch build it installs and why, with and without a GPU (issue 47, point 9), in its
dry mode (DEIT_INSTALL_DRY=1), which prints the commands and runs none. PYTHON=false besides: a script that ignored
the dry mode would stop at its first command, installing nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

BUILD = "PyTorch: torch 2.14.1 / torchvision 0.29.1, PyPI's CUDA 13 build (6.5 GB in .venv); "


def dry_install(tmp_path: Path, nvidia_smi_status: int | None) -> subprocess.CompletedProcess:
    """install.sh in dry mode from a copy of scripts/ under `tmp_path`, with an `nvidia-smi` that exits with
    `nvidia_smi_status` first on PATH (None: no nvidia-smi at all)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install.sh", tmp_path / "scripts")
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("bash", "dirname"):
        (tools / name).symlink_to(shutil.which(name))
    if nvidia_smi_status is not None:
        (tools / "nvidia-smi").write_text(f"#!/bin/sh\necho 'GPU 0: NVIDIA H200'\nexit {nvidia_smi_status}\n")
        (tools / "nvidia-smi").chmod(0o755)
    env = {"PATH": str(tools), "PYTHON": "false", "DEIT_INSTALL_DRY": "1"}
    return subprocess.run([str(tools / "bash"), str(tmp_path / "scripts" / "install.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("nvidia_smi_status", [None, 9], ids=["no nvidia-smi", "nvidia-smi finds no GPU"])
def test_without_a_gpu_it_says_the_cuda_build_runs_on_the_cpu_and_why(tmp_path, nvidia_smi_status):
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU device: /dev/nvidia0")
    proc = dry_install(tmp_path, nvidia_smi_status)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout.splitlines()[0] == BUILD + ("no GPU is visible: it runs on the CPU (PyPI has no CPU build of "
                                                   "torchvision for x86_64, README 'Quickstart')"), proc.stdout
    assert_installs_nothing(proc, tmp_path)


def test_with_a_gpu_it_says_it_saw_one(tmp_path):
    proc = dry_install(tmp_path, 0)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout.splitlines()[0] == BUILD + "a GPU is visible (nvidia-smi -L or /dev/nvidia0)", proc.stdout
    assert_installs_nothing(proc, tmp_path)


def assert_installs_nothing(proc: subprocess.CompletedProcess, tmp_path: Path) -> None:
    """The dry run's commands, PyTorch pinned before the project, and nothing made."""
    assert proc.stdout.splitlines()[1:] == [
        "+ false -m venv .venv",
        "+ .venv/bin/python -m pip install --quiet --upgrade pip",
        "+ .venv/bin/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1",
        "+ .venv/bin/python -m pip install --quiet -e .[analysis,dev,dali]",
    ], proc.stdout
    assert not (tmp_path / ".venv").exists()


def project_install_options() -> list[str]:
    """The `--config-settings` values install.sh gives pip's install of the project (`editable_mode=compat`)."""
    line = next(line for line in (REPO / "scripts" / "install.sh").read_text().splitlines()
                if line.startswith("run ") and " -e " in line)
    return re.findall(r"--config-settings[ =](\S+)", line)


def test_the_editable_install_prints_no_warning_block_and_puts_the_checkout_on_the_path(tmp_path):
    """What pip runs for install.sh's editable install (setuptools' PEP 660 hook, with install.sh's settings) on a
    copy of the project: nothing printed (pip shows the backend's warning blocks, such as the compat mode's
    deprecation), and a .pth naming the checkout, which puts hydra_plugins/ on sys.path as deit_ablate."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project)
    for name in ("deit_ablate", "hydra_plugins"):
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    settings = dict(option.split("=", 1) for option in project_install_options())
    code = ("import sys; from setuptools import build_meta; "
            f"print(build_meta.build_editable({str(tmp_path / 'dist')!r}, {settings!r}), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = "\n".join(line for line in proc.stderr.splitlines()[:-1] if "running " not in line)
    assert "!!" not in printed and "deprecat" not in printed.lower() and "warning" not in printed.lower(), printed
    with zipfile.ZipFile(tmp_path / "dist" / proc.stderr.splitlines()[-1]) as wheel:
        pth = [name for name in wheel.namelist() if name.endswith(".pth")]
        assert len(pth) == 1 and wheel.read(pth[0]).decode().strip() == str(project.resolve()), wheel.namelist()
