"""Shared helpers: compose configs in-process, run train.py in a subprocess on a tiny budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from deit_ablate.config import register_configs
from deit_ablate.identity import register_resolvers

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

register_configs()
register_resolvers()

# A run small enough for a test: 300 training images, a 1-block ViT, batch 32.
TINY = [
    "data.builtin.train_per_class=30",
    "data.builtin.val_per_class=10",
    "model.kwargs.depth=1",
    "model.kwargs.embed_dim=32",
    "model.kwargs.num_heads=2",
    "train.global_batch=32",
    "runtime.eval_batch=50",
    "train.epochs=1",
    "runtime.log_interval=2",
    "runtime.num_workers=0",
]


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The config `python train.py <overrides>` would run, composed without running it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides or [], return_hydra_config=False)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One built-in dataset cache for the whole session."""
    return Path(os.environ.get("DEIT_ABLATE_CACHE") or tmp_path_factory.mktemp("cache"))


def run_train(args: list[str], cwd: Path, cache: Path, extra_env: dict | None = None, module: list[str] | None = None,
              check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train.py (or another launcher command) in `cwd` with outputs there; returns the finished process."""
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", **(extra_env or {})}
    command = (module or [sys.executable, str(REPO / "train.py")]) + args
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc
