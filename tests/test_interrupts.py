"""Ctrl-C at any moment of any command is one line and exit status 130 (issue 52, point 8): while Python imports the
packages (torch, timm, omegaconf, wandb), while the configs are registered and composed, while the command works and
while it exits; never a KeyboardInterrupt traceback, nor another error a library raises when the interrupt lands
inside it (omegaconf's flag_override: an AttributeError and exit status 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

COMMANDS = {
    "train.py": [sys.executable, str(REPO / "train.py"), "runtime.dry_run=true"],
    "deit-status": [sys.executable, "-m", "deit_ablate.status", "outputs"],
    "deit-aggregate": [sys.executable, str(REPO / "scripts" / "aggregate.py"), "outputs"],
    "sharpness": [sys.executable, "-m", "deit_ablate.sharpness", "outputs/runs/x"],
    "disagreement": [sys.executable, "-m", "deit_ablate.disagreement", "a", "b"],
}
DELAYS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0)  # seconds after the start: the imports, the configs, the work
FINISHING_S = 0.5  # a command whose work was done when Ctrl-C came ends as it would have, within this
SAMPLED = {"train.py": (0.1, 0.5), "deit-status": (0.1, 0.3), "deit-aggregate": (0.1, 0.8),
           "sharpness": (0.2,), "disagreement": (0.05,)}  # the default suite's draw of (command, delay)


def interrupt(command: list[str], delay: float, cwd: Path) -> tuple[int | None, str, float]:
    """Run `command`, send Ctrl-C to its process group after `delay` s; its exit status (None: it had ended before
    the signal), its stderr and the seconds it ran on after the signal."""
    (cwd / "outputs" / "runs").mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "DEIT_ABLATE_CACHE": str(cwd / "cache")}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(delay)
    ended_before = proc.poll() is not None
    if not ended_before:
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the process group
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    return (None if ended_before else proc.returncode), err, time.monotonic() - sent


def check(name: str, delay: float, cwd: Path) -> None:
    status, err, after = interrupt(COMMANDS[name], delay, cwd)
    if status is None or (status in (0, 2) and after < FINISHING_S):  # it had done its work (exit 2: refused its
        assert "Traceback" not in err, err[-3000:]  # argument) before the signal came: it ends as it would have
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 130 and "Traceback" not in err, f"{name} after {delay} s: exit {status}\n{err[-3000:]}"
    stops = [line for line in lines if "Ctrl-C" in line or "SIGINT" in line]
    assert stops == lines[-1:], f"{name} after {delay} s:\n{err}"  # what it said before (a warning), then the stop


@pytest.mark.parametrize(("name", "delay"), [(n, d) for n, delays in SAMPLED.items() for d in delays])
def test_ctrl_c_at_a_sampled_moment_is_one_line_and_exit_130(name, delay, tmp_path):
    check(name, delay, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_ctrl_c_at_every_moment_of_every_command_is_one_line_and_exit_130(name, tmp_path):
    for delay in DELAYS:
        check(name, delay, tmp_path)
