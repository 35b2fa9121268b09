"""Shared helpers: compose configs in-process, run train.py in a subprocess on a tiny budget."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from deit_ablate.config.compose import register_configs
from deit_ablate.config.stage_config import stage_config
from deit_ablate.config.studies import studies
from deit_ablate.data.cifar10 import CIFAR100_FILES, CIFAR100_FOLDER, FOLDER, META_FILE, TEST_FILES, TRAIN_FILES
from deit_ablate.data.transforms import TransformSpec
from deit_ablate.record.identity import RunIdentity, composed_choices, run_identity
from deit_ablate.record.resolvers import register_resolvers
from deit_ablate.record.rundir import RunDir

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
    "train.micro_batch=8",  # 4 virtual slots: the layouts of 1, 2 and 4 processes
    "finetune.micro_batch=8",
]


def tiny_with(micro: int, finetune_micro: int | None = None) -> list[str]:
    """TINY with other micro-batches: its 32 images per step as 8 slots of 4 for an 8-rank SLURM job, 16 of 2 for
    two nodes of 8 (the recipe's micro-batch decides which layouts can compute it)."""
    kept = [o for o in TINY if not o.startswith(("train.micro_batch=", "finetune.micro_batch="))]
    return [*kept, f"train.micro_batch={micro}", f"finetune.micro_batch={finetune_micro or micro}"]


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The config `python train.py <overrides>` would run, composed without running it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides or [], return_hydra_config=False)


def transform_spec(cfg: DictConfig) -> TransformSpec:
    """The pieces of `cfg` the image transforms read, as a run hands them down: its stage's (stage_config.py)."""
    applied = stage_config(cfg)
    return TransformSpec(applied.data, applied.augment, applied.resolution)


def study_rows(name: str, conf: Path = CONF) -> tuple[str, ...]:
    """The rows (options) of the study `name` as the project reads them (config/studies.py): what a count of its runs
    follows, so that a row added to the study changes no test but the row's own."""
    return next(s.rows for s in studies(conf) if s.name == name)


def one_class_imagefolder(root: Path) -> list[str]:
    """A one-class, one-image ImageFolder tree at `root` (enough for a paper-scale dry run); its data overrides."""
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        (root / split / "a" / "x.ppm").write_bytes(b"P6 1 1 255\n\x00\x00\x00")
    return [f"data.root={root}", "data.num_classes=1"]


def identity_of(overrides: list[str], conf: Path = CONF) -> RunIdentity:
    """The identity `python train.py <overrides>` would run under (composed with Hydra's node, for its choices)."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    return run_identity(cfg, overrides, composed_choices(cfg))


def mounted_tmpfs(tmp_path: Path, size: str):
    """A tmpfs of `size` (`64k`) under `tmp_path`, for a full disk; unmounted afterwards; skipped, saying why, where
    it cannot be mounted (it needs root and CAP_SYS_ADMIN). Use as a fixture's body: `yield from`."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); needs root and "
                    "CAP_SYS_ADMIN")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


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
    return straight_and_resumed(two_epochs, cwd, cache)[0]


def straight_and_resumed(two_epochs: list[str], cwd: Path, cache: Path,
                         straight_proc: subprocess.CompletedProcess | None = None,
                         ) -> tuple[tuple[dict, dict, dict], subprocess.CompletedProcess]:
    """What train_straight_and_resumed returns, and the straight run's process (its folder: `cwd`/straight; given
    as `straight_proc` when it has been trained already)."""
    import torch

    straight, resumed = cwd / "straight", cwd / "resumed"
    if straight_proc is None:
        straight_proc = run_train(two_epochs + [f"hydra.run.dir={straight}"], cwd, cache)
    run_train(two_epochs + ["train.max_steps=8", f"hydra.run.dir={resumed}"], cwd, cache)
    first_half = torch.load(RunDir(resumed).last_checkpoint, weights_only=True)
    RunDir(resumed).result.unlink()  # as if the job had been stopped after its first epoch
    proc = run_train(two_epochs + [f"hydra.run.dir={resumed}"], cwd, cache)
    assert "resuming" in proc.stdout
    a = torch.load(RunDir(straight).last_checkpoint, weights_only=True)
    b = torch.load(RunDir(resumed).last_checkpoint, weights_only=True)
    assert a["step"] == b["step"] == 16
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    return (a, b, first_half), straight_proc


# Writes offline runs with the real wandb library: two epochs of history each, then the run's summary.
WRITER = r"""
import json, os, sys
os.environ["WANDB_SILENT"] = "true"
import wandb
settings = wandb.Settings(x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
                          console="off", save_code=False, disable_git=True, x_save_requirements=False)
for r in json.load(open(sys.argv[1])):
    run = wandb.init(project="deit-ablate-test", dir=r["dir"], mode="offline", id=r["id"], name=r["id"],
                     group=r["group"], tags=r["tags"], config=r["config"], resume="allow", settings=settings)
    for epoch in range(2):
        run.log({"train/loss": 2.0 - epoch, "train/lr": 1e-3, "train/img_per_s": 100.0})
        run.log({"epoch": epoch, "val/top1": 10.0 * epoch, "val/top5": 20.0 * epoch, "val/loss": 1.0})
    run.summary.update(r["summary"])
    run.finish()
"""


def write_offline_runs(runs: list[dict], tmp: Path) -> None:
    """Write `runs` (each `{id, root, group, tags, config, summary}`) as offline wandb runs under tmp/<root>/wandb,
    in one subprocess (no W&B server)."""
    spec = [{**r, "dir": str(tmp / r["root"])} for r in runs]
    for d in {s["dir"] for s in spec}:
        Path(d).mkdir(parents=True, exist_ok=True)
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    subprocess.run([sys.executable, "-c", WRITER, str(tmp / "spec.json")], check=True, env=env, timeout=120)


# --- end-to-end runs shared by the tests of a session ---------------------------------------------------------------
# A test that only reads a run asserts on the shared one; a test that changes it (a relaunch, a deleted or damaged
# file) works on a copy in its own tmp_path (SharedRun.copy_into), never on the shared folder.

@dataclass(frozen=True)
class SharedRun:
    """A train.py launch made once per session: the folder it ran in (`cwd`, outputs under it) and its process."""

    cwd: Path
    proc: subprocess.CompletedProcess

    @property
    def outputs(self) -> Path:
        """Its output root: runs/ and wandb/."""
        return self.cwd / "outputs"

    def run_dir(self, fragment: str = "") -> Path:
        """Its one run folder (or the one whose name holds `fragment`)."""
        (found,) = [p for p in (self.outputs / "runs").iterdir() if p.is_dir() and fragment in p.name]
        return found

    def copy_into(self, cwd: Path) -> Path:
        """Copy its outputs/ (run folders and wandb logs) under `cwd` for a test that changes them, beside what is
        there already; the copy."""
        target = cwd / "outputs"

        def links_there(folder: str, names: list[str]) -> list[str]:
            """wandb's links (latest-run, debug.log) that `target` has already: its own are kept."""
            there = target / Path(folder).relative_to(self.outputs)
            return [name for name in names if (Path(folder) / name).is_symlink() and (there / name).is_symlink()]

        shutil.copytree(self.outputs, target, symlinks=True, dirs_exist_ok=True, ignore=links_there)
        return target


def shared_run(factory: pytest.TempPathFactory, cache: Path, name: str, args: list[str]) -> SharedRun:
    """Launch train.py with `args` in a fresh session folder; the SharedRun."""
    cwd = factory.mktemp(name)
    return SharedRun(cwd, run_train(args, cwd, cache))


@pytest.fixture(scope="session")
def tiny_data(data_cache: Path) -> Path:
    """TINY's built-in dataset, drawn in this process (what a dry run of TINY draws); its folder."""
    from deit_ablate.data.builtin import ensure_builtin_dataset

    return ensure_builtin_dataset(data_cache / "builtin", 40, 30, 10, 0)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> SharedRun:
    """TINY trained once: one epoch of 8 steps, finished."""
    return shared_run(tmp_path_factory, data_cache, "tiny_run", TINY)


def two_epochs(workers: int = 0) -> list[str]:
    """TINY for two epochs with `workers` loader workers; its min lr above the peak lr (a warning in train.log)."""
    tiny = [item for item in TINY if not item.startswith("runtime.num_workers=")] + [f"runtime.num_workers={workers}"]
    return tiny + ["train.epochs=2", "mix=mixup_cutmix", "optimizer.min_lr=0.5"]


@dataclass(frozen=True)
class ResumedRuns:
    """two_epochs(workers) trained straight (folder `cwd`/straight, process `run.proc`) and 1 + resume + 1
    (`cwd`/resumed), the weights equal (checked); the checkpoints: straight, resumed, first half."""

    run: SharedRun
    args: list[str]
    checkpoints: tuple[dict, dict, dict]


@pytest.fixture(scope="session")
def straight_runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Callable[[int], SharedRun]:
    """two_epochs(workers) trained straight (run folder `cwd`/straight), on first use for a worker count."""
    made: dict[int, SharedRun] = {}

    def get(workers: int) -> SharedRun:
        if workers not in made:
            cwd = tmp_path_factory.mktemp(f"two_epochs_w{workers}")
            proc = run_train(two_epochs(workers) + [f"hydra.run.dir={cwd / 'straight'}"], cwd, data_cache)
            made[workers] = SharedRun(cwd, proc)
        return made[workers]

    return get


@pytest.fixture(scope="session")
def resumed_runs(straight_runs: Callable[[int], SharedRun], data_cache: Path) -> Callable[[int], ResumedRuns]:
    """ResumedRuns for a worker count (beside its straight run), trained on first use."""
    made: dict[int, ResumedRuns] = {}

    def get(workers: int) -> ResumedRuns:
        if workers not in made:
            run, args = straight_runs(workers), two_epochs(workers)
            checkpoints, _ = straight_and_resumed(args, run.cwd, data_cache, straight_proc=run.proc)
            made[workers] = ResumedRuns(run, args, checkpoints)
        return made[workers]

    return get


@pytest.fixture(scope="session")
def teacher_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> SharedRun:
    """A demo CNN teacher run on TINY's data, finished after 8 steps: 1 of its 2 epochs (run_dir("model=cnn_demo"))."""
    data = [item for item in TINY if not item.startswith(("model.", "train.epochs="))]
    return shared_run(tmp_path_factory, data_cache, "teacher", ["model=cnn_demo", "train.epochs=2",
                                                                "train.max_steps=8"] + data)


@pytest.fixture(scope="session")
def mix_sweep(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> SharedRun:
    """`-m mix=none,mixup_only,cutmix_only` at TINY's scale for two epochs: three runs in one sweep folder."""
    two_epochs = [item for item in TINY if not item.startswith("train.epochs=")] + ["train.epochs=2"]
    return shared_run(tmp_path_factory, data_cache, "mix_sweep", ["-m", "mix=none,mixup_only,cutmix_only", *two_epochs])


@pytest.fixture(scope="session")
def one_step_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> SharedRun:
    """TINY for one step (`train.max_steps=1`) as a sweep of one run (`-m seed=0`: the default seed, and Hydra's
    runs/multirun.yaml), with 2 torch threads (a runtime setting) and micro-batches of 16."""
    return shared_run(tmp_path_factory, data_cache, "one_step", ["-m", "seed=0"] + TINY + [
        "train.max_steps=1", "runtime.cpu_threads=2", "train.micro_batch=16"])


@pytest.fixture(scope="session")
def stopped_at_step_3(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> tuple[SharedRun, list[str]]:
    """TINY saving every 2 steps, stopped by `train.max_steps=3` mid-epoch (run folder `cwd`/run); the overrides
    without max_steps and run folder, which finish it."""
    args = TINY + ["runtime.checkpoint_every_steps=2"]
    cwd = tmp_path_factory.mktemp("stopped_at_step_3")
    proc = run_train(args + ["train.max_steps=3", f"hydra.run.dir={cwd / 'run'}"], cwd, data_cache)
    return SharedRun(cwd, proc), args


CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cifar10(root: Path, per_class: int = 2, protocol: int = pickle.DEFAULT_PROTOCOL,
                  ) -> dict[str, tuple[np.ndarray, list[int]]]:
    """The CIFAR-10 pickle layout under `root` with `per_class` images of each class per batch file: each image's
    pixels hold its batch index, class and place (pickled with `protocol`); the rows written, by file."""
    folder = root / FOLDER
    folder.mkdir(parents=True)
    written = {}
    for batch, name in enumerate((*TRAIN_FILES, *TEST_FILES)):
        labels = [label for label in range(10) for _ in range(per_class)]
        data = np.zeros((len(labels), 3 * 32 * 32), dtype=np.uint8)
        for row, label in enumerate(labels):
            planes = data[row].reshape(3, 32, 32)
            planes[0], planes[1], planes[2] = batch, label, row
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, handle, protocol)
        written[name] = (data, labels)
    with open(folder / META_FILE, "wb") as handle:
        pickle.dump({b"label_names": [c.encode() for c in CIFAR_CLASSES], b"num_vis": 3072}, handle, protocol)
    return written


def write_cifar100(root: Path, train_per_class: int = 1) -> None:
    """torchvision's CIFAR-100 pickle layout under `root`: train, test (one image per class) and meta."""
    folder = root / CIFAR100_FOLDER
    folder.mkdir(parents=True)
    for name, per_class in (("train", train_per_class), ("test", 1)):
        labels = [label for label in range(100) for _ in range(per_class)]
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": np.zeros((len(labels), 3072), dtype=np.uint8), b"fine_labels": labels,
                         b"coarse_labels": [label // 5 for label in labels]}, handle)
    with open(folder / CIFAR100_FILES["meta"], "wb") as handle:
        pickle.dump({b"fine_label_names": [f"c{k}".encode() for k in range(100)]}, handle)


def lr_trace(cfg: DictConfig, steps_per_epoch: int) -> tuple[float, list[float]]:
    """(peak lr, the lr of every update) of the stage `cfg` describes, as a run builds and steps it."""
    import torch

    from deit_ablate.run.assemble import stage_scheduler
    from deit_ablate.run.stages import stage_recipe
    from deit_ablate.train.optim import scaled_lr

    recipe = stage_recipe(cfg)
    peak = scaled_lr(recipe.lr, recipe.global_batch, recipe.lr_base_batch)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = stage_scheduler(optimizer, recipe, steps_per_epoch)
    lrs = []
    for step in range(1, recipe.epochs * steps_per_epoch + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step_update(step)
    return peak, lrs
