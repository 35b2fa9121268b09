"""Start-up and per-epoch costs kept off a run's path without changing what it writes (docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

from conftest import REPO

from deit_ablate.aggregate.reader import find_run_files, read_run_file
from deit_ablate.tracking import skip_unstaged_launch_inputs

# An offline run logged through the Tracker in a fresh interpreter; prints which wandb modules init imported.
OFFLINE_RUN = """
import json, sys
from omegaconf import OmegaConf
from deit_ablate.identity import RunIdentity
from deit_ablate.tracking import Tracker
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
