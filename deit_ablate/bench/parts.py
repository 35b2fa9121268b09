"""Where a whole run's time goes, ours beside timm's train.py:

    python -m deit_ablate.bench.parts --timm-train /tmp/timm_train.py --pairs 2 -- data=imagefolder ... resolution=224px

Runs train.py as `python train.py [overrides]` would, with a timer on each part of a run (`--run OUT.json TRAIN_PY
[overrides]` runs one such process), and timm's train.py with the same model, data, batch and recipe, its parts read
from its step log (`timm_parts`). Each gives the seconds and count of each part and the whole process's wall time.
Each part's time is exclusive: the data wait of an evaluation is the evaluation's, not the training's. Nothing the
run computes changes. The parts:

- start-up: from the process's start (its start time in /proc) to the first training step's batch in hand;
- data wait: the training step waiting for its batch from the loader;
- per-batch step: host-to-device copy, float conversion, normalization and random erasing (`BatchNormalize`);
- train step: forward, backward, optimizer, EMA (`Trainer.train_step`; on a GPU its kernels are synchronized);
- logging and progress: the step hook (progress.json, mid-epoch checkpoints when due, the stop check) and the
  logged rows;
- epoch start: seeding an epoch's loader (and starting its workers the first time);
- evaluation: each evaluation of the model (and its EMA), with its loader;
- checkpoint: writing the epoch's checkpoint and copying the best one.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import runpy
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARTS = ("start-up", "data wait", "per-batch step", "train step", "logging and progress", "epoch start",
         "evaluation", "checkpoint")


def process_start_time() -> float:
    """This process's start as a time.time() value (from /proc; the interpreter's own start-up counts too)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            booted = time.time() - float(uptime.read().split()[0])
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class PartTimer:
    """Exclusive seconds and counts per part: time spent in a part entered from inside another is the inner one's."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.counts = dict.fromkeys(PARTS, 0)
        self.synchronize = synchronize
        self.stack: list[list[Any]] = []  # [part, start, seconds spent in nested parts]
        self.first_step_at: float | None = None
        self.in_training = False

    def wrap(self, part: str, function: Callable) -> Callable:
        """`function`, its calls counted and timed as `part`."""

        @functools.wraps(function)
        def timed(*args, **kwargs):
            self.stack.append([part, time.perf_counter(), 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                if part == "train step":
                    self.synchronize()
                _, start, nested = self.stack.pop()
                elapsed = time.perf_counter() - start
                self.seconds[part] += elapsed - nested
                self.counts[part] += 1
                if self.stack:
                    self.stack[-1][2] += elapsed

        return timed

    def data_wait(self, next_batch: Callable) -> Callable:
        """The loader's `__next__`, timed as the training's data wait only outside every other part."""
        timed = self.wrap("data wait", next_batch)

        @functools.wraps(next_batch)
        def wrapped(iterator):
            if self.stack or not self.in_training:
                return next_batch(iterator)
            batch = timed(iterator)
            if self.first_step_at is None:
                self.first_step_at = time.time()
            return batch

        return wrapped

    def report(self, started: float) -> dict[str, Any]:
        """The parts, start-up included, and when the report was made."""
        seconds = dict(self.seconds)
        counts = dict(self.counts)
        if self.first_step_at is not None:
            seconds["start-up"] = self.first_step_at - started
            counts["start-up"] = 1
        return {"seconds": {k: round(v, 4) for k, v in seconds.items()}, "counts": counts,
                "seconds_since_start": round(time.time() - started, 3)}


def install(out_path: str) -> PartTimer:
    """Put a timer on each part of a run; write `out_path` when the process exits."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from deit_ablate.bench.env import synchronize
    from deit_ablate.data.batch import BatchNormalize
    from deit_ablate.record import checkpoint
    from deit_ablate.record.tracking import Tracker
    from deit_ablate.run import loop
    from deit_ablate.train import trainer

    started = process_start_time()
    timer = PartTimer()
    original_steps = trainer.Trainer.train_steps
    original_step = trainer.Trainer.train_step

    @functools.wraps(original_steps)
    def train_steps(self, *args, **kwargs):
        timer.in_training = True
        timer.synchronize = functools.partial(synchronize, self.info.device)
        try:
            return original_steps(self, *args, **kwargs)
        finally:
            timer.in_training = False

    trainer.Trainer.train_steps = train_steps
    trainer.Trainer.train_step = timer.wrap("train step", original_step)
    _BaseDataLoaderIter.__next__ = timer.data_wait(_BaseDataLoaderIter.__next__)
    BatchNormalize.__call__ = timer.wrap("per-batch step", BatchNormalize.__call__)
    loop.EpochLoop.step_hook = timer.wrap("logging and progress", loop.EpochLoop.step_hook)
    loop.EpochLoop.epoch_batches = timer.wrap("epoch start", loop.EpochLoop.epoch_batches)
    loop.evaluate = timer.wrap("evaluation", loop.evaluate)
    checkpoint.save_atomic = timer.wrap("checkpoint", checkpoint.save_atomic)
    checkpoint.copy_atomic = timer.wrap("checkpoint", checkpoint.copy_atomic)
    Tracker.log = timer.wrap("logging and progress", Tracker.log)

    def write() -> None:
        with open(out_path, "w") as out:
            json.dump(timer.report(started), out, indent=1)

    atexit.register(write)
    return timer


# timm's train.py with --log-interval 1: "Train: 0 [   5/39 ( 15%)]  Loss: ... Time: 0.201s, ... Data: 0.008 (0.076)"
_TIMM_STEP = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+).*?Time: ([\d.]+)s,.*?Data: ([\d.]+)")


def timm_parts(lines: list[tuple[float, str]], started: float, ended: float) -> dict[str, Any]:
    """The same parts for timm's train.py, from its step log (`--log-interval 1`) with each line's arrival time:
    its own Time and Data of each step, start-up to the first step's batch in hand, and everything between an
    epoch's last step and the next one (evaluation, checkpoints, the next epoch's start) as evaluation."""
    steps = [(at, _TIMM_STEP.search(line)) for at, line in lines]
    steps = [(at, match) for at, match in steps if match is not None]
    seconds = dict.fromkeys(PARTS, 0.0)
    counts = dict.fromkeys(PARTS, 0)
    if not steps:
        return {"seconds": seconds, "counts": counts, "seconds_since_start": round(ended - started, 3)}
    first_at, first = steps[0]
    seconds["start-up"] = first_at - float(first.group(4)) + float(first.group(5)) - started
    counts["start-up"] = 1
    for index, (at, match) in enumerate(steps):
        step_s, data_s = float(match.group(4)), float(match.group(5))
        seconds["data wait"] += data_s if index else 0.0  # the first step's wait is start-up
        seconds["train step"] += step_s - data_s
        counts["train step"] += 1
        counts["data wait"] += 1
        following = steps[index + 1] if index + 1 < len(steps) else None
        if following is None or following[1].group(1) != match.group(1):  # an epoch's last step
            resumed = following[0] - float(following[1].group(4)) if following is not None else ended
            seconds["evaluation"] += max(resumed - at, 0.0)
            counts["evaluation"] += 1
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()}, "counts": counts,
            "seconds_since_start": round(ended - started, 3)}


def run_timestamped(command: list[str], cwd: str, env: dict[str, str] | None = None) -> tuple[list[tuple[float, str]],
                                                                                                float, float, int]:
    """Run `command`, each line of its output with the time it arrived; its start, its end and its exit code."""
    started = time.time()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1)
    lines = [(time.time(), line) for line in process.stdout]
    code = process.wait()
    return lines, started, time.time(), code


def table(sides: dict[str, dict[str, Any]]) -> str:
    """The parts side by side, seconds (count), and each side's wall time."""
    names = list(sides)
    rows = [f"{'part':<22}" + "".join(f"{name:>18}" for name in names)]
    for part in PARTS:
        rows.append(f"{part:<22}" + "".join(
            f"{sides[n]['seconds'][part]:>11.2f} s ({sides[n]['counts'][part]:>3})" for n in names))
    rows.append(f"{'whole process':<22}" + "".join(f"{sides[n]['seconds_since_start']:>17.2f}s" for n in names))
    return "\n".join(rows)


def run_ours(overrides: list[str], work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Our train.py with `overrides`, its parts timed from inside, its outputs under `work`."""
    from deit_ablate.bench.whole_run import our_run_command

    out = work / "parts.json"
    command = our_run_command(overrides, work)
    command[1:2] = ["-m", "deit_ablate.bench.parts", "--run", str(out), command[1]]
    lines, started, ended, code = run_timestamped(command, str(work), env)
    if code != 0:
        raise RuntimeError(f"our run failed ({code}):\n{''.join(line for _, line in lines[-40:])}")
    parts = json.loads(out.read_text())
    parts["seconds_since_start"] = round(ended - started, 3)  # the exit counts too
    return {**parts, "command": " ".join(command)}


def run_timm(overrides: list[str], timm_train: Path, work: Path, workers: int, device: str,
             env: dict[str, str]) -> dict[str, Any]:
    """timm's train.py for the same run, its parts read from its step log."""
    from deit_ablate.bench.compose import compose_run
    from deit_ablate.bench.timm_ref import timm_command
    from deit_ablate.data.datasets import dataset_root

    data_dir = dataset_root(compose_run(overrides).data)
    command = timm_command(timm_train, overrides, data_dir, work / "timm-out", workers, device)
    lines, started, ended, code = run_timestamped(command, str(work), env)
    if code != 0:
        raise RuntimeError(f"timm's train.py failed ({code}):\n{''.join(line for _, line in lines[-40:])}")
    return {**timm_parts(lines, started, ended), "command": " ".join(command)}


def compare(argv: list[str]) -> int:
    """Ours and timm's train.py (when given) in turn, `--pairs` times; the parts of each, side by side."""
    import argparse
    import tempfile

    from deit_ablate.bench.pipeline import cache_root
    from deit_ablate.bench.runs import child_env

    parser = argparse.ArgumentParser(prog="python -m deit_ablate.bench.parts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="parts.json", help="JSON of every run's parts (default: parts.json)")
    parser.add_argument("--timm-train", type=Path, help="timm's train.py (deit_ablate/bench/timm_ref.py says how)")
    parser.add_argument("--workers", type=int, default=2, help="loader workers of timm's side (ours: the overrides)")
    parser.add_argument("--device", default="cpu", help="timm's --device (ours: runtime.device in the overrides)")
    parser.add_argument("--pairs", type=int, default=1, help="runs of each side, in turn")
    parser.add_argument("overrides", nargs="*", help="our train.py overrides (after --)")
    args = parser.parse_args(argv)
    env = child_env(cache_root())
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "timm": []}
    for _ in range(args.pairs):
        with tempfile.TemporaryDirectory(prefix="parts-ours-") as work:
            runs["ours"].append(run_ours(args.overrides, Path(work), env))
        if args.timm_train is not None:
            with tempfile.TemporaryDirectory(prefix="parts-timm-") as work:
                runs["timm"].append(run_timm(args.overrides, args.timm_train, Path(work), args.workers, args.device,
                                             env))
    Path(args.out).write_text(json.dumps(runs, indent=1))
    for index in range(args.pairs):
        print(table({name: rows[index] for name, rows in runs.items() if rows}))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`--run OUT.json TRAIN_PY [overrides]`: one instrumented run; otherwise the side-by-side comparison."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["--run"]:
        return compare(argv)
    out_path, train_py, *overrides = argv[1:]
    install(out_path)
    sys.argv = [train_py, *overrides]
    runpy.run_path(train_py, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
