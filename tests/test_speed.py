"""Start-up and per-epoch costs kept off a run's path without changing what it writes (docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import REPO

from deit_ablate.analysis.aggregate.reader import find_run_files, read_run_file
from deit_ablate.record.tracking import skip_unstaged_launch_inputs

# An offline run logged through the Tracker in a fresh interpreter; prints which wandb modules init imported.
OFFLINE_RUN = """
import json, sys
from omegaconf import OmegaConf
from deit_ablate.record.identity import RunIdentity
from deit_ablate.record.tracking import Tracker
cfg = OmegaConf.create({"seed": 0, "ablation": "baseline", "stage": "pretrain", "preset": "demo",
                        "runtime": {"output_root": sys.argv[1],
                                    "tracking": {"mode": "offline", "project": "p", "entity": None}}})
tracker = Tracker(cfg, RunIdentity("name", "speedtest01", "group", "digest"), {"digest": "d"}, enabled=True,
                  run_dir=None, write_csv=False)
launch_loaded = "wandb.sdk.launch" in sys.modules
for epoch in range(2):
    tracker.log({"epoch": epoch, "train/loss": 1.0}, step=epoch * 10 + 5)
    tracker.log({"epoch": epoch, "val/top1": 10.0 + epoch}, step=epoch * 10 + 10)
tracker.summary({"status": "finished", "top1": 11.0})
tracker.finish()
print(json.dumps({"launch_loaded": launch_loaded}))
"""


def test_offline_init_skips_the_launch_import_and_the_log_stays_complete(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", OFFLINE_RUN, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"launch_loaded": False}
    files = find_run_files(tmp_path)
    assert len(files) == 1
    info, warnings = read_run_file(files[0], history=True)
    assert info is not None and not warnings
    assert info.run_id == "speedtest01" and info.status == "finished" and info.summary["top1"] == 11.0
    assert info.history == [{"epoch": 0, "val/top1": 10.0}, {"epoch": 1, "val/top1": 11.0}]
    assert info.config["run_id"] == "speedtest01" and info.exit_code == 0


def _fake_wandb(calls: list[str]) -> types.SimpleNamespace:
    """A stand-in for the wandb module with the one method the skip wraps."""

    class Run:
        def _detect_and_apply_job_inputs(self) -> None:
            calls.append("applied")

    return types.SimpleNamespace(sdk=types.SimpleNamespace(wandb_run=types.SimpleNamespace(Run=Run)))


def test_staged_launch_inputs_are_still_applied(monkeypatch) -> None:
    calls: list[str] = []
    fake = _fake_wandb(calls)
    skip_unstaged_launch_inputs(fake)
    skip_unstaged_launch_inputs(fake)  # a second Tracker in the process wraps it once
    run = fake.sdk.wandb_run.Run()
    monkeypatch.delitem(sys.modules, "wandb.sdk.launch.inputs.internal", raising=False)
    run._detect_and_apply_job_inputs()
    assert calls == []  # nothing can be staged: the module that stages inputs was never imported
    monkeypatch.setitem(sys.modules, "wandb.sdk.launch.inputs.internal", types.ModuleType("staged"))
    run._detect_and_apply_job_inputs()
    assert calls == ["applied"]  # a W&B Launch job staged its inputs: wandb's own method applies them


def test_a_wandb_without_the_method_is_left_alone() -> None:
    fake = types.SimpleNamespace(sdk=types.SimpleNamespace(wandb_run=types.SimpleNamespace(Run=type("Run", (), {}))))
    skip_unstaged_launch_inputs(fake)
    skip_unstaged_launch_inputs(types.SimpleNamespace())
    assert not hasattr(fake.sdk.wandb_run.Run, "_detect_and_apply_job_inputs")


def test_whole_runs_time_both_sides_with_the_same_recipe(tmp_path: Path) -> None:
    from deit_ablate.bench.whole_run import whole_run_commands

    overrides = ["runtime.num_workers=2", "augment.repeated_aug=1"]
    sides = whole_run_commands(overrides, 4, tmp_path / "timm_train.py", tmp_path / "data", 2, "cpu")
    ours, timm = sides["ours"](tmp_path / "w"), " ".join(sides["timm"](tmp_path / "w"))
    assert ours[1].endswith("train.py") and "train.epochs=4" in ours and "augment.repeated_aug=1" in ours
    assert f"runtime.output_root={tmp_path}/w/outputs" in ours and f"hydra.run.dir={tmp_path}/w/run" in ours
    for flag in ["--epochs 4", "-b 128", "-j 2", "--model deit_tiny_patch16_224", f"--output {tmp_path}/w/timm-out"]:
        assert flag in timm, flag
    assert "--aug-repeats" not in timm
    assert list(whole_run_commands(overrides, 4, None, tmp_path, 2, "cpu")) == ["ours"]


def test_whole_run_ratio_is_timm_over_ours_pair_by_pair() -> None:
    from deit_ablate.bench.report import Report
    from deit_ablate.bench.whole_run import add_whole_run_figures

    report = Report({"summary": "test"}, "cmd")
    results = {"ours": [{"wall_s": 40.0, "cpu_s": 70.0}, {"wall_s": 50.0, "cpu_s": 80.0}],
               "timm": [{"wall_s": 44.0, "cpu_s": 75.0}, {"wall_s": 60.0, "cpu_s": 90.0}]}
    add_whole_run_figures(report, results, {"ours": "python train.py", "timm": "python timm"}, {"epochs": 4})
    assert report.get("e2e_run_wall", "ours").value == 45.0 and report.get("e2e_run_wall", "timm").value == 52.0
    assert report.get("e2e_run_wall", "ours").extra["cpu_s"] == 75.0
    (comparison,) = report.comparisons
    assert comparison.ratio == 52.0 / 45.0 and comparison.paired_ratios == [1.1, 1.2] and comparison.meets
    assert "median 1.150" in report.notes[0]


def test_time_process_counts_the_child_cpu_and_names_a_failure(tmp_path: Path) -> None:
    from deit_ablate.bench.whole_run import time_process

    timing = time_process([sys.executable, "-c", "sum(range(3 * 10**6))"], tmp_path, dict(os.environ), 60)
    assert timing["wall_s"] > 0 and 0 < timing["cpu_s"]
    with pytest.raises(RuntimeError, match="failed \\(3\\)"):
        time_process([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], tmp_path, dict(os.environ), 60)


def test_the_best_checkpoint_is_a_copy_of_the_last_one_that_outlives_both_files_changing(tmp_path: Path) -> None:
    import torch

    from deit_ablate.record.checkpoint import copy_atomic, load, save_atomic
    from deit_ablate.record.rundir import TEMP_PATTERNS, RunDir

    run = RunDir(tmp_path)
    last, prev, best = run.last_checkpoint, run.previous_checkpoint, run.best_checkpoint
    save_atomic({"step": 1, "w": torch.ones(3)}, last, keep_previous=prev)
    copy_atomic(last, best)
    assert best.read_bytes() == last.read_bytes() and os.stat(best).st_ino != os.stat(last).st_ino
    save_atomic({"step": 2, "w": torch.zeros(3)}, last, keep_previous=prev)  # the next epoch
    assert load(best)["step"] == 1 and load(prev)["step"] == 1 and load(last)["step"] == 2
    torch.save({"step": 9, "w": torch.zeros(3)}, best)  # someone rewrites the best one in place
    assert load(prev)["step"] == 1 and load(last)["step"] == 2  # the resume's files are not touched
    copy_atomic(last, best)
    assert load(best)["step"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == [best.name, last.name, prev.name]
    stale = best.with_name(f".{best.name}.x1y2z3.tmp")  # atomic.atomic_write's temp name
    assert any(stale.match(pattern) for pattern in TEMP_PATTERNS)  # a killed copy's leftover is cleaned up


def _train_script() -> types.ModuleType:
    """train.py loaded as a module (its `__main__` block does not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_exit_status_is_pythons_own(capsys) -> None:
    exit_status = _train_script().exit_status
    assert [exit_status(SystemExit(code)) for code in (None, 0, 2, 130, 143)] == [0, 0, 2, 130, 143]
    assert exit_status(SystemExit("a message")) == 1 and capsys.readouterr().err == "a message\n"


FAST_EXIT = """
import os, runpy, sys, threading
real_exit = os._exit
main_pid = os.getpid()
def spy(status):
    if os.getpid() == main_pid:
        print("fast exit", status, file=sys.stderr)
    real_exit(status)
os._exit = spy
if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, args=(3,)).start()  # a non-daemon thread still running
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("thread", [False, True])
def test_train_py_ends_fast_with_its_status_and_output_or_normally(tmp_path: Path, thread: bool) -> None:
    proc = subprocess.run([sys.executable, "-c", FAST_EXIT, "thread" if thread else "no", str(REPO / "train.py"),
                           "model=no_such_model", f"runtime.output_root={tmp_path}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1  # Hydra's status for an unknown option
    assert "no_such_model" in proc.stderr  # its message flushed before the end
    assert ("fast exit 1" in proc.stderr) is not thread  # a running thread gets the normal exit, which joins it
    assert not list(tmp_path.iterdir())


def test_a_profiled_train_py_still_writes_its_profile(tmp_path: Path) -> None:
    stats = tmp_path / "profile.out"
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(stats), str(REPO / "train.py"),
                           "model=no_such_model", f"runtime.output_root={tmp_path / 'out'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert "no_such_model" in proc.stderr  # (cProfile ends with status 0 after a script's SystemExit, as ever)
    assert stats.stat().st_size > 0  # cProfile writes it after the script: the normal exit
