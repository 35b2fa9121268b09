"""Whole-process measurements: short real training runs (ours, timm's), startup, composing a sweep."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deit_ablate.bench.compose import REPO, TRAIN_PY
from deit_ablate.bench.report import Figure, Report, median
from deit_ablate.bench.timm_ref import parse_step


def child_env(cache: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a measured child process runs in."""
    return {**os.environ, "DEIT_ABLATE_CACHE": str(cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
            **(extra or {})}


def _env_prefix(extra: dict[str, str] | None) -> str:
    return "".join(f"{key}={value} " for key, value in (extra or {}).items())


def _stop(proc: subprocess.Popen) -> None:
    """End a child started in its own session, and its workers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def summarize_steps(steps: list[dict[str, float]], batch: int, launched: float, warmup: int) -> dict[str, Any]:
    """Steady-state rate, data-wait fraction and compute-only rate over steps after `warmup`, and wall to the last."""
    window = steps[warmup:] if len(steps) > warmup + 1 else steps[1:] or steps
    window_s = sum(s["step_s"] for s in window)
    return {
        "steps": len(steps), "warmup_steps": len(steps) - len(window), "batch": batch,
        "images_per_s": len(window) * batch / window_s,
        "median_step_images_per_s": batch / median([s["step_s"] for s in window]),
        "data_wait_fraction": sum(s["data_s"] for s in window) / window_s,
        "compute_images_per_s": batch / median([s["compute_s"] for s in window]),
        "wall_to_last_step_s": steps[-1]["end"] - launched,
        "images_per_s_incl_startup": len(steps) * batch / (steps[-1]["end"] - launched),
        "step_s": [round(s["step_s"], 4) for s in steps], "data_s": [round(s["data_s"], 4) for s in steps],
    }


def run_ours(overrides: list[str], steps: int, batch: int, cache: Path, warmup: int, timeout: float = 900,
             extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """`python train.py <overrides> train.max_steps=<steps>` with every step timed (bench.instrument)."""
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as work:
        log = Path(work) / "steps.jsonl"
        args = [*overrides, f"train.max_steps={steps}", f"runtime.output_root={work}/outputs",
                f"hydra.run.dir={work}/run"]
        command = [sys.executable, "-m", "deit_ablate.bench.instrument", str(log), str(TRAIN_PY), *args]
        launched = time.time()
        proc = subprocess.Popen(command, cwd=work, env=child_env(cache, extra_env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        finally:
            _stop(proc)
        finished = time.time()
        if proc.returncode != 0:
            raise RuntimeError(f"our train.py failed ({proc.returncode}):\n{output[-3000:]}")
        records = [json.loads(line) for line in log.read_text().splitlines()]
    timed = []
    for index, record in enumerate(records):
        previous_end = records[index - 1]["exit"] if index else launched
        timed.append({"end": record["exit"], "step_s": record["exit"] - previous_end,
                      "data_s": record["enter"] - previous_end,
                      "compute_s": record["exit"] - record["enter"] - record["mixup_s"]})
    summary = summarize_steps(timed, batch, launched, warmup)
    summary["process_wall_s"] = finished - launched
    arguments = " ".join(shlex.quote(a) for a in [*overrides, f"train.max_steps={steps}"])
    summary["command"] = f"{_env_prefix(extra_env)}python train.py {arguments}"
    return summary


def run_timm(command: list[str], steps: int, batch: int, cache: Path, warmup: int, timeout: float = 900,
             extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """timm's train.py until it has logged `steps` training steps (then stopped), every step timed from its log."""
    with tempfile.TemporaryDirectory(prefix="bench-timm-") as work:
        launched = time.time()
        proc = subprocess.Popen(command, cwd=work, env=child_env(cache, extra_env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        timed, tail = [], []
        try:
            deadline = launched + timeout
            for line in proc.stdout:
                tail = (tail + [line])[-40:]
                step = parse_step(line)
                if step is not None:
                    timed.append({"end": time.time(), "step_s": step["step_s"], "data_s": step["data_s"],
                                  "compute_s": step["step_s"] - step["data_s"]})
                if len(timed) >= steps or time.time() > deadline:
                    break
        finally:
            _stop(proc)
    if len(timed) < steps:
        raise RuntimeError(f"timm's train.py logged {len(timed)} of {steps} steps:\n{''.join(tail)[-3000:]}")
    summary = summarize_steps(timed, batch, launched, warmup)
    summary["command"] = f"{_env_prefix(extra_env)}python " + " ".join(shlex.quote(a) for a in command[1:])
    return summary


def add_run_figures(report: Report, name: str, rows: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    """The e2e section's figures of one variant: steady images/s, images/s from process start, the step rate."""
    device, command = report.device["summary"], rows[0]["command"]
    keys = ("data_wait_fraction", "wall_to_last_step_s", "compute_images_per_s", "images_per_s_incl_startup",
            "median_step_images_per_s")
    extra = {key: median([row[key] for row in rows]) for key in keys}
    extra["step_s_first_run"] = rows[0]["step_s"]
    report.add(Figure("e2e_train", name, median([r["images_per_s"] for r in rows]), "images/s", device, command,
                      settings, [r["images_per_s"] for r in rows], extra))
    report.add(Figure("e2e_incl_startup", name, extra["images_per_s_incl_startup"], "images/s", device, command,
                      settings, [r["images_per_s_incl_startup"] for r in rows],
                      {"wall_to_last_step_s": extra["wall_to_last_step_s"]}))
    report.add(Figure("train_step_in_run", name, extra["compute_images_per_s"], "images/s", device, command,
                      settings, [r["compute_images_per_s"] for r in rows],
                      {"what": "batch / median step time without data wait and Mixup/CutMix"}))


def time_command(command: list[str], cache: Path, cwd: Path = REPO) -> float:
    """Wall seconds of a command that must succeed."""
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=child_env(cache), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    return seconds


COMPOSE_SWEEP = """
import sys, time
start = time.perf_counter()
from deit_ablate.bench.compose import compose_run, sweep_overrides
runs = sweep_overrides()
for overrides in runs:
    compose_run(overrides)
print(len(runs), time.perf_counter() - start)
"""


def compose_sweep_command() -> list[str]:
    """A fresh interpreter that composes the 26 configs of the sweep with Hydra's compose API."""
    return [sys.executable, "-c", COMPOSE_SWEEP]
