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
from deit_ablate.identity import RunIdentity, composed_choices, run_identity
from deit_ablate.resolvers import register_resolvers

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


def identity_of(overrides: list[str], conf: Path = CONF) -> RunIdentity:
    """The identity `python train.py <overrides>` would run under (composed with Hydra's node, for its choices)."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    return run_identity(cfg, overrides, composed_choices(cfg))


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


def train_straight_and_resumed(two_epochs: list[str], cwd: Path, cache: Path) -> tuple[dict, dict, dict]:
    """Train two epochs straight, and one epoch (8 steps) + a resume + one; the checkpoints of the straight run,
    the resumed run and the first half."""
    import torch

    straight, resumed = cwd / "straight", cwd / "resumed"
    run_train(two_epochs + [f"hydra.run.dir={straight}"], cwd, cache)
    run_train(two_epochs + ["train.max_steps=8", f"hydra.run.dir={resumed}"], cwd, cache)
    first_half = torch.load(resumed / "checkpoint-last.pt", weights_only=True)
    (resumed / "result.json").unlink()  # as if the job had been stopped after its first epoch
    proc = run_train(two_epochs + [f"hydra.run.dir={resumed}"], cwd, cache)
    assert "resuming" in proc.stdout
    a = torch.load(straight / "checkpoint-last.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint-last.pt", weights_only=True)
    assert a["step"] == b["step"] == 16
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    return a, b, first_half
