"""A launch check that fails, whatever it raises, stops the launch with one line (exit 2) before anything is written.

Hydra turns an exception out of a callback (run/preflight.py's Preflight) into a warning and runs the job; these
tests make each check raise what no check foresees and require the launch, the dry run and the sweep to stop.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, run_train

# Run train.py with one function replaced by one that raises `TypeError("injected")`.
INJECT = """
import runpy, sys, importlib
module, name = sys.argv[1].rsplit(".", 1)
def boom(*args, **kwargs):
    raise TypeError("injected failure")
setattr(importlib.import_module(module), name, boom)
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# (what raises, the launch it is reached by)
CHECKS = [
    ("deit_ablate.run.validate.validate_launch", []),
    ("deit_ablate.run.validate.validate_launch", ["-m"]),
    ("deit_ablate.run.validate.validate_launch", ["runtime.dry_run=true"]),
    ("deit_ablate.run.plan.make_plan", ["runtime.dry_run=true"]),
    ("deit_ablate.run.plan.make_plan", ["-m", "runtime.dry_run=true"]),
    ("deit_ablate.run.lifecycle.dry_run_line", ["runtime.dry_run=true"]),
    ("deit_ablate.run.lifecycle.same_computation_lines", ["-m", "runtime.dry_run=true"]),
    ("deit_ablate.run.stages.finished_teacher_run", []),
    ("deit_ablate.run.stages.teacher_run_overrides", ["-m"]),
]
FAST = {0, 3, 8}  # the default suite's sample: a launch, a dry run, a sweep


def digests(root: Path) -> dict[str, str]:
    """Every file under `root` and the hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def launch_with_failing(target: str, args: list[str], cwd: Path, cache: Path):
    return run_train([target, str(REPO / "train.py"), *args], cwd, cache, module=[sys.executable, "-c", INJECT],
                     check=False, timeout=120)


@pytest.mark.parametrize("index", [pytest.param(i, marks=() if i in FAST else pytest.mark.slow)
                                   for i in range(len(CHECKS))])
def test_a_check_that_raises_anything_stops_the_launch(index, tmp_path, data_cache):
    target, mode = CHECKS[index]
    proc = launch_with_failing(target, [*mode, *TINY], tmp_path, data_cache)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "TypeError: injected failure" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "UserWarning" not in proc.stderr
    assert not (tmp_path / "outputs").exists()  # no run folder, no multirun.yaml, no wandb log


def test_a_dry_run_of_a_damaged_stopped_run_writes_nothing(tmp_path, data_cache):
    """A stopped run whose checkpoint holds its step as a 0-d tensor: the dry run (single and -m) used to resume it,
    train, evaluate and write result.json, metrics and a wandb log (the check's TypeError was Hydra's warning)."""
    import torch

    args = [*TINY, "runtime.checkpoint_every_steps=2"]
    run_dir = tmp_path / "outputs" / "run"
    run_train([*args, "train.max_steps=3", f"hydra.run.dir={run_dir}"], tmp_path, data_cache)
    (run_dir / "result.json").unlink()
    state = torch.load(run_dir / "checkpoint-last.pt", weights_only=True)
    state["step"] = torch.tensor(state["step"])
    torch.save(state, run_dir / "checkpoint-last.pt")
    before = digests(tmp_path / "outputs")
    into = {"single": [f"hydra.run.dir={run_dir}"],
            "sweep": ["-m", f"hydra.sweep.dir={run_dir.parent}", f"hydra.sweep.subdir={run_dir.name}"]}
    for mode in into.values():  # the stopped run's folder (train.max_steps=3 is another experiment)
        proc = run_train([*mode, *args, "runtime.dry_run=true"], tmp_path, data_cache, check=False, timeout=120)
        assert "Traceback" not in proc.stderr and "UserWarning" not in proc.stderr, proc.stderr[-3000:]
        assert "[run]" not in proc.stdout + proc.stderr  # it never started training
        assert digests(tmp_path / "outputs") == before, mode
