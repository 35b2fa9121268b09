"""Lay out an output root shaped like Table 8's 26-run sweep half-way through, for timing `deit-status` on it:
every third run finished, every third stopped with a checkpoint (8 MB) and its progress.json, the rest not started,
the folders named as the sweep's dry run names them. Nothing trains.

    python scripts/half_finished_sweep.py /tmp/o26
    python -m deit_ablate.status /tmp/o26
    python scripts/half_finished_sweep.py /tmp/o26 --time-refresh   # what one `deit-status --watch` refresh costs
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from deit_ablate.record.rundir import RunDir, runs_root

SWEEP = ["ablation=glob(*)", "stage=pretrain,finetune"]
REPO = Path(__file__).resolve().parents[1]


def main(root: Path) -> None:
    """Write the run folders under the output root `root`."""
    plan = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", *SWEEP, "runtime.dry_run=true",
                           f"runtime.output_root={root}"], capture_output=True, text=True, check=True).stdout
    names = re.findall(r"^\[dry run\] (\S+) ", plan, re.MULTILINE)
    for i, name in enumerate(names):
        run = RunDir(runs_root(root) / name)
        run.hydra_config.parent.mkdir(parents=True, exist_ok=True)
        stage = "finetune" if "stage=finetune" in name else "pretrain"
        run.hydra_overrides.write_text(json.dumps([name.split(",")[0].rsplit("-", 1)[0], f"stage={stage}"]))
        run.hydra_config.write_text(json.dumps({"stage": stage, "seed": 0}))
        if i % 3 == 0:
            run.result.write_text(json.dumps({"status": "finished", "top1": 70.0, "top1_best": 71.0}))
        elif i % 3 == 1:
            torch.save({"model": {"w": torch.zeros(2_000_000)}, "optimizer": {}, "scheduler": {}, "epoch": 3,
                        "step": 120}, run.last_checkpoint)
            run.progress.write_text(json.dumps({"state": "stopped", "step": 120, "total_steps": 300, "epoch": 3,
                                                "epochs": 10}))
    print(f"{len(names)} run folders under {runs_root(root)}")


def time_refresh(root: Path, refreshes: int = 20) -> None:
    """Plan the sweep once, as `deit-status -m ... --watch` does, then time its refreshes (each rereads the folders)."""
    from deit_ablate.analysis.status.cli import collect
    from deit_ablate.analysis.status.sweep import sweep_runs
    from deit_ablate.run.commands import prepare_configs

    prepare_configs()
    start = time.perf_counter()
    runs = sweep_runs([*SWEEP, f"runtime.output_root={root}"])
    planned = time.perf_counter() - start
    seconds = []
    for _ in range(refreshes):
        start = time.perf_counter()
        collect(runs, stall_after=600.0)
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    print(f"{len(runs)} runs planned once in {planned:.2f} s (imports included); a refresh: median "
          f"{seconds[len(seconds) // 2] * 1000:.0f} ms, max {seconds[-1] * 1000:.0f} ms over {refreshes}")


if __name__ == "__main__":
    if "--time-refresh" in sys.argv:
        time_refresh(Path(sys.argv[1]))
    else:
        main(Path(sys.argv[1]))
