"""Whole training runs timed from outside, ours against timm's train.py: start-up, every epoch with its evaluation
and checkpoints, and the exit, as a user waits for them (the e2e_run section of scripts/bench.py)."""

from __future__ import annotations

import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deit_ablate.bench.compose import TRAIN_PY, compose_run
from deit_ablate.bench.report import Figure, Report, median
from deit_ablate.bench.runs import child_env
from deit_ablate.bench.timm_ref import timm_command


def _children_cpu_s() -> float:
    """User + system seconds of every finished child process of this one (their own waited children included)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_process(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> dict[str, float]:
    """Wall and CPU seconds of one process that must succeed, from its start to its exit."""
    cpu_before, start = _children_cpu_s(), time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return {"wall_s": wall, "cpu_s": _children_cpu_s() - cpu_before}


def our_run_command(overrides: list[str], work: Path) -> list[str]:
    """`python train.py <overrides>` with its outputs (run folder, wandb log) under `work`."""
    return [sys.executable, str(TRAIN_PY), *overrides, f"runtime.output_root={work}/outputs",
            f"hydra.run.dir={work}/run"]


@dataclass(frozen=True)
class JpegRun:
    """A whole run of the e2e_run section on JPEGs: `model` (its kwargs changed by `model_kwargs`) at `size` px with
    a global batch of `batch`, on the ImageFolder `data` (train/, val/) or on `draw` training JPEGs drawn into the
    cache (`classes` classes)."""

    data: Path | None = None
    draw: int | None = None
    classes: int = 10
    model: str = "deit_small"
    model_kwargs: dict[str, str] = field(default_factory=dict)
    size: int = 224
    batch: int = 128


def drawn_jpegs(count: int, classes: int, cache: Path, log: Callable[[str], None]) -> Path:
    """An ImageFolder of `count` training JPEGs (and an eighth as many, at least one per class, for val) of `classes`
    classes at 500x375, quality 90, drawn once into the bench cache."""
    from deit_ablate.bench import pipeline

    val = max(count // 8, classes)
    log(f"[bench] JPEG set: {count} train + {val} val images of {pipeline.JPEG_WIDTH}x{pipeline.JPEG_HEIGHT}, "
        f"{classes} classes ...")
    return pipeline.ensure_jpeg_set(count, root=cache / "bench", val_count=val, classes=classes)


def image_folder_classes(root: Path) -> int:
    """The classes of an ImageFolder tree: its train/ subfolders."""
    return sum(1 for entry in (root / "train").iterdir() if entry.is_dir())


def image_folder_overrides(run: JpegRun, workers: int, device: str, cache: Path,
                           log: Callable[[str], None] = print) -> list[str]:
    """Our side of a whole run on JPEGs (drawn first if `run` asks), as a GPU user runs it: the paper preset's
    recipe for the model at its size (eval: resize size / 0.875, centre crop), one micro-batch a step (the
    computation timm's makes) and repeated augmentation off (timm's train.py refuses it in one process)."""
    root = run.data or drawn_jpegs(run.draw or 0, run.classes, cache, log)
    kwargs = [f"++model.kwargs.{key}={value}" for key, value in run.model_kwargs.items()]
    return ["preset=paper", f"model={run.model}", *kwargs, "data=imagefolder", f"data.root={root}",
            f"data.num_classes={image_folder_classes(root)}", f"resolution.train_size={run.size}",
            f"resolution.eval_size={run.size}", "resolution.crop_pct=0.875", f"train.global_batch={run.batch}",
            f"train.micro_batch={run.batch}", f"runtime.max_batch_per_device={run.batch}", "augment.repeated_aug=1",
            f"runtime.num_workers={workers}", f"runtime.device={device}"]


def whole_run_commands(overrides: list[str], epochs: int, timm_train: Path | None, data_dir: Path, workers: int,
                       device: str) -> dict[str, Callable[[Path], list[str]]]:
    """The command of each side for a fresh work folder: ours, and timm's with the same model, data and recipe."""
    ours = [*overrides, f"train.epochs={epochs}"]
    sides: dict[str, Callable[[Path], list[str]]] = {"ours": lambda work: our_run_command(ours, work)}
    if timm_train is not None:
        sides["timm"] = lambda work: timm_command(timm_train, ours, data_dir, work / "timm-out", workers, device)
    return sides


def alternate_runs(sides: dict[str, Callable[[Path], list[str]]], pairs: int, cache: Path,
                   log: Callable[[str], None], timeout: float = 1800) -> dict[str, list[dict[str, float]]]:
    """Each side in turn (ours, timm, ours, timm, ...), `pairs` times, each in a fresh folder; their timings."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    env = child_env(cache)
    for pair in range(pairs):
        for name, command in sides.items():
            with tempfile.TemporaryDirectory(prefix=f"bench-run-{name}-") as work:
                timing = time_process(command(Path(work)), Path(work), env, timeout)
            results[name].append(timing)
            log(f"[bench] e2e_run {name} pair {pair}: {timing['wall_s']:.1f} s wall, {timing['cpu_s']:.1f} s CPU")
    return results


def add_whole_run_figures(report: Report, results: dict[str, list[dict[str, float]]],
                          commands: dict[str, str], settings: dict[str, Any]) -> None:
    """One figure per side (wall seconds, CPU seconds beside) and timm / ours, pair by pair (above 1: ours faster)."""
    for name, rows in results.items():
        walls = [row["wall_s"] for row in rows]
        report.add(Figure("e2e_run_wall", name, median(walls), "s", report.device["summary"], commands[name],
                          settings, walls, {"cpu_s": median([row["cpu_s"] for row in rows]),
                                            "cpu_s_samples": [round(row["cpu_s"], 2) for row in rows]}))
    comparison = report.compare("e2e_run_wall", "ours", "timm", target=1.05, lower_is_better=True)
    if comparison is not None and comparison.paired_ratios:
        report.notes.append(f"e2e_run: timm's wall / ours pair by pair {comparison.paired_ratios}, median "
                            f"{median(comparison.paired_ratios):.3f} (above 1: ours is faster)")


def measure(report: Report, overrides: list[str], epochs: int, timm_train: Path | None, workers: int, device: str,
            cache: Path, pairs: int, log: Callable[[str], None]) -> None:
    """Time `pairs` alternating whole runs of `epochs` epochs (ours with `overrides`, timm's when given) into
    `report`."""
    from deit_ablate.data.datasets import dataset_root

    cfg = compose_run([*overrides, f"train.epochs={epochs}"])
    data_dir = dataset_root(cfg.data)  # draws the built-in set once, before any timing
    sides = whole_run_commands(overrides, epochs, timm_train, data_dir, workers, device)
    commands = {name: "python " + " ".join(shlex.quote(arg) for arg in command(Path("WORK"))[1:])
                for name, command in sides.items()}
    for name, command in commands.items():
        log(f"[bench] e2e_run {name}: {command}")
    results = alternate_runs(sides, pairs, cache, log)
    settings = {"epochs": epochs, "batch": cfg.train.global_batch, "model": f"{cfg.model.name} "
                f"{dict(cfg.model.kwargs)}", "train_size": cfg.resolution.train_size, "data": str(data_dir),
                "eval_size": cfg.resolution.eval_size, "precision": f"train.amp={cfg.train.amp} on {device}",
                "workers": workers, "repeated_aug": "off on both sides", "pairs": pairs,
                "timed": "each process from start to exit, ours then timm's in turn, each in a fresh folder WORK"}
    add_whole_run_figures(report, results, commands, settings)
