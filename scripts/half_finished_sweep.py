"""Lay out an output root shaped like Table 8's 26-run sweep half-way through, for timing `deit-status` on it:
every third run finished, every third stopped with a checkpoint (8 MB) and its progress.json, the rest not started,
the folders named as the sweep's dry run names them. Nothing trains. With `--count N`, N run folders in the same
thirds (the sweep's names repeated under other seeds, checkpoints of 1 MB), each with what a real run leaves: Hydra's
whole composed config, identity.json, train.log, metrics.csv and, once finished, its result.json.

    python scripts/half_finished_sweep.py /tmp/o26
    python -m deit_ablate.status /tmp/o26
    python scripts/half_finished_sweep.py /tmp/o26 --time-refresh   # what one `deit-status --watch` refresh costs
    python scripts/half_finished_sweep.py /tmp/o1000 --count 1000   # a large sweep: the status's cost per run
"""

from __future__ import annotations

import argparse
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


def sweep_names(root: Path) -> list[str]:
    """The run folders' names the sweep's dry run gives under the output root `root`."""
    plan = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", *SWEEP, "runtime.dry_run=true",
                           f"runtime.output_root={root}"], capture_output=True, text=True, check=True).stdout
    return re.findall(r"^\[dry run\] (\S+) ", plan, re.MULTILINE)


def composed_config() -> str:
    """The whole config `python train.py` composes, as Hydra saves it in a run's .hydra/config.yaml."""
    return subprocess.run([sys.executable, str(REPO / "train.py"), "--cfg", "job"], capture_output=True, text=True,
                          check=True).stdout


def main(root: Path, count: int | None = None) -> None:
    """Write the run folders under the output root `root`: the sweep's 26, or `count` in the same thirds."""
    names = sweep_names(root)
    realistic = count is not None
    config = composed_config() if realistic else ""
    weights = 250_000 if realistic else 2_000_000  # float32s: a checkpoint of 1 MB or 8 MB
    for i in range(count or len(names)):
        name, seed = names[i % len(names)], i // len(names)
        run = RunDir(runs_root(root) / (name if seed == 0 else f"{name.rsplit('-', 1)[0]}-s{seed:08d}"))
        run.hydra_config.parent.mkdir(parents=True, exist_ok=True)
        stage = "finetune" if "stage=finetune" in name else "pretrain"
        overrides = [name.split(",")[0].rsplit("-", 1)[0], f"stage={stage}", *([f"seed={seed}"] if seed else [])]
        run.hydra_overrides.write_text(json.dumps(overrides))
        if realistic:
            config_text = re.sub(r"^stage: .*$", f"stage: {stage}", config, flags=re.MULTILINE)
            run.hydra_config.write_text(re.sub(r"^seed: .*$", f"seed: {seed}", config_text, flags=re.MULTILINE))
        else:
            run.hydra_config.write_text(json.dumps({"stage": stage, "seed": 0}))
        if realistic and i % 3 != 2:
            run.identity.write_text(json.dumps({"name": run.name, "run_id": f"{i:08x}", "experiment_digest": "0" * 16,
                                                "data_fingerprint": {"digest": "1" * 16}}))
            run.log.write_text("".join(f"2026-01-01 00:00:{s:02d} INFO epoch {s}: loss 2.3\n" for s in range(40)))
            run.metrics.write_text("epoch,train/loss,val/top1\n" + "".join(f"{e},2.3,{e}.0\n" for e in range(10)))
        if i % 3 == 0:
            run.result.write_text(json.dumps({"status": "finished", "top1": 70.0, "top1_best": 71.0,
                                              "steps_done": 300, "epochs_done": 10, "train_seconds": 1234.5}))
            if realistic:
                run.progress.write_text(json.dumps({"state": "finished", "step": 300, "total_steps": 300,
                                                    "epoch": 10, "epochs": 10, "elapsed_s": 1234.5}))
        elif i % 3 == 1:
            torch.save({"model": {"w": torch.zeros(weights)}, "optimizer": {}, "scheduler": {}, "epoch": 3,
                        "step": 120}, run.last_checkpoint)
            run.progress.write_text(json.dumps({"state": "stopped", "step": 120, "total_steps": 300, "epoch": 3,
                                                "epochs": 10}))
    print(f"{count or len(names)} run folders under {runs_root(root)}")


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the output root to lay out (or to time, with --time-refresh)")
    parser.add_argument("--count", type=int, help="how many run folders (default: the sweep's 26)")
    parser.add_argument("--time-refresh", action="store_true", help="time a --watch refresh of the sweep's runs")
    args = parser.parse_args()
    if args.time_refresh:
        time_refresh(args.root)
    else:
        main(args.root, args.count)
