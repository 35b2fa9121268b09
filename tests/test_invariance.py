"""The invariance audit: one experiment, one computation, whatever the hardware computes it on.

The demo model with every per-batch and per-sample ingredient on (repeated augmentation x3, Mixup/CutMix, random
erasing, drop path, EMA and SAM) trains 4 virtual slots of 8 images for one epoch of 3 optimizer steps, on five
layouts: one process accumulating all slots without loader workers; the same with 2 workers; torchrun 2 ranks;
torchrun 4 ranks; and the first layout stopped after one step mid-epoch and resumed. The weights after the 3 steps
must agree within float summation order; so for a BatchNorm model (the demo CNN teacher).

Tolerance 1e-5: the layouts add the same per-slot gradients in another order (accumulation in one process, Gloo's
all-reduce across ranks), which changes float32 sums in the last bits; measured 2e-6 to 3e-6 after 3 AdamW steps at
lr 2.5e-3 (workers and the resume: bit for bit). Different draws (what this audit catches) moved the weights by
4e-3 to 1e-2 (the ViT) and 0.3 to 1.6 (BatchNorm) on the code before the keyed streams.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deit_ablate.analysis.aggregate.reader import find_run_files
from deit_ablate.analysis.aggregate.wandb_log import read_log
from deit_ablate.record.rundir import RunDir, wandb_root
from tests.conftest import run_train

TOLERANCE = 1e-5
AUDIT = [
    "data.builtin.train_per_class=10",  # 100 images: 25 positions per slot, 3 steps of 4 x 8 per epoch
    "data.builtin.val_per_class=2",
    "train.global_batch=32", "train.micro_batch=8", "train.epochs=1",
    "train.ema=true", "optimizer.sam_rho=0.05", "optimizer.warmup_epochs=0", "optimizer.lr=0.04",
    "runtime.eval_batch=20", "runtime.log_interval=1", "runtime.max_batch_per_device=8",
]
VIT = ["model.kwargs.depth=2", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"]
MODELS = {"vit": VIT, "batchnorm": ["model=cnn_demo", "model.drop_path=0.05"]}
LAYOUTS = ("one_process", "two_workers", "two_ranks", "four_ranks", "resumed")


def _torchrun(ranks: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}",
            "--no-python", sys.executable]


def _train(layout: str, model: list[str], folder: Path, cwd: Path, cache: Path, port: int) -> None:
    """Train the audit row on `layout` into `folder`."""
    args = [*AUDIT, *model, f"hydra.run.dir={folder}"]
    workers = "runtime.num_workers=2" if layout == "two_workers" else "runtime.num_workers=0"
    if layout in ("two_ranks", "four_ranks"):
        ranks = 2 if layout == "two_ranks" else 4
        command = [*_torchrun(ranks, port), str(Path(__file__).resolve().parents[1] / "train.py")]
        run_train([*args, workers], cwd, cache, module=command)
        return
    if layout == "resumed":
        run_train([*args, workers, "train.max_steps=1"], cwd, cache)  # stopped after step 1 of 3, mid-epoch
        RunDir(folder).result.unlink()
    run_train([*args, workers], cwd, cache)


@pytest.fixture(scope="module")
def audit_runs(tmp_path_factory, data_cache):
    """A model trained on every layout, on first use: the run folders by layout (`audit_runs("vit")`)."""
    cwd, trained = tmp_path_factory.mktemp("invariance"), {}

    def get(name: str) -> dict[str, Path]:
        if name not in trained:
            (cwd / name).mkdir()
            port = 29571 + 10 * list(MODELS).index(name)
            trained[name] = {}
            for offset, layout in enumerate(LAYOUTS):
                folder = cwd / name / layout
                _train(layout, MODELS[name], folder, cwd / name, data_cache, port + offset)
                trained[name][layout] = folder
        return trained[name]

    return get


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    state = torch.load(RunDir(folder).last_checkpoint, weights_only=True)
    assert state["step"] == 3
    weights = {f"model.{k}": v for k, v in state["model"].items()}
    weights.update({f"ema.{k}": v for k, v in state["ema"].items()})
    return weights


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of two state dicts' floating-point tensors (and equality of the rest)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name, tensor in a.items():
        if tensor.is_floating_point():
            worst = max(worst, (tensor - b[name]).abs().max().item())
        else:
            assert torch.equal(tensor, b[name]), name  # BatchNorm's batch counter
    return worst


# the BatchNorm half is slow (about 40 s): .ci/run runs it
@pytest.mark.parametrize("model", ["vit", pytest.param("batchnorm", marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_every_layout_computes_the_same_weights(audit_runs, model, layout):
    reference = _weights(audit_runs(model)["one_process"])
    difference = max_difference(reference, _weights(audit_runs(model)[layout]))
    assert difference <= TOLERANCE, f"{model} on {layout}: weights differ by {difference:.2e}"


def test_the_weights_moved_far_more_than_the_tolerance(audit_runs):
    # the audit can fail: the 3 steps move the weights a thousand times the tolerance (the resumed run's first
    # launch stopped after step 1)
    final = _weights(audit_runs("vit")["one_process"])
    after_one = torch.load(RunDir(audit_runs("vit")["resumed"]).previous_checkpoint, weights_only=True)
    assert after_one["step"] == 1
    moved = max_difference({f"model.{k}": v for k, v in after_one["model"].items()},
                           {k: v for k, v in final.items() if k.startswith("model.")})
    assert moved > 100 * TOLERANCE


def step_losses(cwd: Path) -> list[tuple[int, float]]:
    """(step, training loss) of every step a run's wandb log holds (its only run under `cwd`/outputs)."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = find_run_files(wandb_root(cwd / "outputs"))
    losses, record = [], Record()
    for payload in read_log(path).records:
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "train/loss" in row:
                losses.append((int(row["_step"]), float(row["train/loss"])))
    return losses


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory, data_cache) -> dict[int, Path]:
    """The demo row (4 slots of 32) for one epoch at a test's size, logged every step, with 0 and 2 workers."""
    folders = {}
    for workers in (0, 2):
        cwd = tmp_path_factory.mktemp(f"workers{workers}")
        run_train(["data.builtin.train_per_class=40", "data.builtin.val_per_class=2", *VIT, "train.epochs=1",
                   "runtime.eval_batch=20", "runtime.log_interval=1",
                   f"runtime.num_workers={workers}"], cwd, data_cache)
        folders[workers] = cwd
    return folders


def test_workers_change_no_logged_training_loss(worker_runs):
    # python train.py runtime.num_workers=0 and =2: the same training loss at every step of the first epoch
    zero, two = step_losses(worker_runs[0]), step_losses(worker_runs[2])
    assert len(zero) == 2 and zero == two  # 400 images: 256 positions per epoch for each of 4 slots of 32
