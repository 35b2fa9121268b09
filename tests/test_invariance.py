"""The invariance audit: one experiment, one computation, and the same numbers logged, whatever the hardware.

A row with every per-batch and per-sample ingredient on (repeated augmentation x3, Mixup/CutMix, random erasing, drop
path, EMA and SAM) is trained on several layouts and compared with one process accumulating every slot without loader
workers: the weights (the EMA's and BatchNorm's running statistics included), the training loss logged at every step,
each epoch's training loss, and each evaluation (loss, top-1 and top-5 of the model and its EMA; for a BatchNorm model
they depend on its running statistics).

- short (default suite): the demo ViT, 3 steps of 4 slots of 8; with 2 loader workers, on 2 torchrun ranks, and
  stopped after step 1 on 2 ranks then resumed on one process.
- long (slow): the demo ViT, 3 epochs of 10 steps of 12 slots of 2; with 2 workers, on 2, 3 and 4 ranks, and stopped
  at step 15 (mid-epoch) on 2 ranks then resumed on one process.
- batchnorm (slow): the demo CNN, 2 epochs of 2 steps of 6 slots of 8; on 2 and 3 ranks, and stopped at step 3 on
  2 ranks then resumed on one process.

Tolerances, from float rounding. The layouts add the same per-slot gradients, losses and counts in another order
(accumulation in one process, Gloo's all-reduce across ranks), which changes float32 sums in their last bits, and
training carries those differences on. Measured: the ViT's weights differ by 2e-6 to 3e-6 after 3 steps (tolerance
1e-5) and by 6.5e-6 (2 ranks) and 1.4e-5 (3 ranks) after 30, under 0.2 % of them by more than 1e-6 (tolerance 1e-4);
logged losses by about 1e-7 relative (tolerance 1e-5). AdamW divides each gradient by its own running size, so an
element whose gradient is at rounding level still moves by up to the lr: the demo CNN's weights differ by 1.5e-5 (3
ranks) and 4.0e-4 (2 ranks) after 4 steps at lr 4.7e-4 (tolerance 1e-3), its losses by under 2e-6 relative. Its
batch-8 BatchNorm over 1x1 maps amplifies rounding within 8 to 14 steps (to 6e-3 in the weights and 2e-4 in the loss
after 10 steps), so its audit stays short; the ViT's does not.

What the audit must catch is a different draw, and a run with exactly one (the negative control `other_draw`: one
micro-batch's Mixup/CutMix at the first step drawn from another seed, tests/other_draw) differs by far more: the
ViT's weights by 2.4e-2 and its losses by 1.3e-3 after 30 steps, the CNN's weights by 5.9e-2 and its losses by up to
2.9e-3 after 4 steps; a test holds the losses at least 100 times their tolerance away, the weights 100 times (ViT) and
20 times (CNN). So the tolerances tell rounding from a different draw. Workers and a resume on the same layout are
bit for bit.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from deit_ablate.analysis.aggregate.reader import find_run_files
from deit_ablate.analysis.aggregate.wandb_log import read_log
from deit_ablate.record.rundir import RunDir, wandb_root
from deit_ablate.record.tracking import read_epoch_rows
from tests.conftest import run_train

REPO = Path(__file__).resolve().parents[1]
EVERY_INGREDIENT = ("train.ema=true", "optimizer.sam_rho=0.05", "optimizer.warmup_epochs=0", "runtime.eval_batch=20",
                    "runtime.log_interval=1", "runtime.max_batch_per_device=8")
VIT = ("model.kwargs.depth=2", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2")
CNN = ("model=cnn_demo", "model.drop_path=0.05")


@dataclass(frozen=True)
class Audit:
    """One audit: its row (the model included), its length, where its resumed layout stops, its layouts and its
    tolerances."""

    name: str
    overrides: tuple[str, ...]
    steps: int
    stop_at: int  # the resumed layout's first launch, on 2 ranks, stops after this step
    layouts: tuple[str, ...]
    weights: float  # the largest weight difference that is rounding
    losses: float  # the largest relative difference of a logged loss that is rounding
    weight_gap: int = 100  # the negative control's weights differ by at least this many times `weights`


SHORT = Audit("short", ("data.builtin.train_per_class=10",  # 100 images: 25 positions per slot, 3 steps of 4 x 8
                        "data.builtin.val_per_class=2", "train.global_batch=32", "train.micro_batch=8",
                        "train.epochs=1", "optimizer.lr=0.04", *EVERY_INGREDIENT, *VIT),
              steps=3, stop_at=1, layouts=("two_workers", "two_ranks", "resumed_across"), weights=1e-5, losses=1e-5)
LONG = Audit("long", ("data.builtin.train_per_class=36",  # 360 images, RASampler's 256: 21 per slot, 10 steps of 12 x 2
                      "data.builtin.val_per_class=4", "train.global_batch=24", "train.micro_batch=2", "train.epochs=3",
                      "optimizer.lr=0.04", *EVERY_INGREDIENT, *VIT),
             steps=30, stop_at=15, layouts=("two_workers", "two_ranks", "three_ranks", "four_ranks", "resumed_across"),
             weights=1e-4, losses=1e-5)
BATCHNORM = Audit("batchnorm", ("data.builtin.train_per_class=13",  # 130 images, 128 of them: 2 steps of 6 x 8
                                "data.builtin.val_per_class=4", "train.global_batch=48", "train.micro_batch=8",
                                "train.epochs=2", "optimizer.lr=0.005", *EVERY_INGREDIENT, *CNN),
                  steps=4, stop_at=3, layouts=("two_ranks", "three_ranks", "resumed_across"), weights=1e-3,
                  losses=1e-5, weight_gap=20)
CONTROL_GAP = 100  # the negative control's losses differ by at least this many times the tolerance
OTHER_DRAW = "0,0,5"  # (epoch, step, slot) of the control's one other draw: slot 5's Mixup/CutMix at the first step
RANKS = {"two_ranks": 2, "three_ranks": 3, "four_ranks": 4}
_ports = itertools.count(29571)


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--master_port={next(_ports)}", "--no-python", sys.executable, str(REPO / "train.py")]


def train_layout(layout: str, audit: Audit, cwd: Path, cache: Path) -> Path:
    """Train the audit's row on `layout` in `cwd` (its own wandb root); its run folder."""
    folder = cwd / "run"
    args = [*audit.overrides, f"hydra.run.dir={folder}",
            f"runtime.num_workers={2 if layout == 'two_workers' else 0}"]
    if layout in RANKS:
        run_train(args, cwd, cache, module=_torchrun(RANKS[layout]))
    elif layout == "resumed_across":  # stopped mid-epoch on 2 ranks, resumed on one process
        run_train([*args, f"train.max_steps={audit.stop_at}"], cwd, cache, module=_torchrun(2))
        RunDir(folder).result.unlink()
        run_train(args, cwd, cache)
    elif layout == "other_draw":
        path = os.pathsep.join(filter(None, [str(REPO / "tests" / "other_draw"), os.environ.get("PYTHONPATH")]))
        run_train(args, cwd, cache, extra_env={"PYTHONPATH": path, "DEIT_OTHER_DRAW": OTHER_DRAW})
    else:
        run_train(args, cwd, cache)
    return folder


@pytest.fixture(scope="module")
def audit_runs(tmp_path_factory, data_cache):
    """An audit's row trained on a layout, on first use: `audit_runs(audit, layout)` is its run folder."""
    trained: dict[tuple[str, str], Path] = {}

    def get(audit: Audit, layout: str) -> Path:
        if (audit.name, layout) not in trained:
            cwd = tmp_path_factory.mktemp(f"{audit.name}-{layout}")
            trained[audit.name, layout] = train_layout(layout, audit, cwd, data_cache)
        return trained[audit.name, layout]

    return get


def weights(folder: Path, steps: int) -> dict[str, torch.Tensor]:
    """The model's and the EMA's state (BatchNorm's buffers included) in a run's last checkpoint."""
    state = torch.load(RunDir(folder).last_checkpoint, weights_only=True)
    assert state["step"] == steps
    found = {f"model.{k}": v for k, v in state["model"].items()}
    found.update({f"ema.{k}": v for k, v in state["ema"].items()})
    return found


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


def step_losses(cwd: Path) -> dict[int, float]:
    """The training loss logged at each step in the wandb logs under `cwd`/outputs (a resumed run's later launch
    logging the steps after its resume point)."""
    from wandb.proto.wandb_internal_pb2 import Record

    losses, record = {}, Record()
    for path in sorted(find_run_files(wandb_root(cwd / "outputs"))):
        for payload in read_log(path).records:
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                if "train/loss" in row:
                    losses[int(row["_step"])] = float(row["train/loss"])
    return losses


def epoch_rows(folder: Path) -> list[dict]:
    """Each epoch's row of a run's metrics.csv: its training loss and evaluation."""
    return read_epoch_rows(RunDir(folder).metrics)


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def worst_loss_difference(reference: Path, other: Path) -> tuple[float, str]:
    """The largest relative difference of two runs' logged training losses (every step's, every epoch's) and
    validation losses, and where it is."""
    steps, other_steps = step_losses(reference.parent), step_losses(other.parent)
    assert steps.keys() == other_steps.keys(), (sorted(steps), sorted(other_steps))
    found = [(relative_difference(loss, other_steps[step]), f"train/loss at step {step}") for step, loss in
             steps.items()]
    rows, other_rows = epoch_rows(reference), epoch_rows(other)
    assert [r["epoch"] for r in rows] == [r["epoch"] for r in other_rows]
    for row, other_row in zip(rows, other_rows, strict=True):
        for key in ("train/epoch_loss", "val/loss", "val_ema/loss"):
            found.append((relative_difference(row[key], other_row[key]), f"{key} of epoch {row['epoch']}"))
    return max(found)


RUNS = [*(pytest.param(SHORT, layout, id=f"short-{layout}") for layout in SHORT.layouts),
        *(pytest.param(audit, layout, id=f"{audit.name}-{layout}", marks=pytest.mark.slow)
          for audit in (LONG, BATCHNORM) for layout in audit.layouts)]


@pytest.mark.parametrize(("audit", "layout"), RUNS)
def test_every_layout_computes_the_same_weights(audit_runs, audit, layout):
    reference = weights(audit_runs(audit, "one_process"), audit.steps)
    difference = max_difference(reference, weights(audit_runs(audit, layout), audit.steps))
    assert difference <= audit.weights, f"{audit.name} on {layout}: weights differ by {difference:.2e}"


@pytest.mark.parametrize(("audit", "layout"), RUNS)
def test_every_layout_logs_the_same_losses(audit_runs, audit, layout):
    # the training loss of each step and epoch is the whole global batch's (every micro-batch of every rank), and the
    # validation loss is one process's (BatchNorm's running statistics as one process has them)
    reference, other = audit_runs(audit, "one_process"), audit_runs(audit, layout)
    assert len(step_losses(reference.parent)) == audit.steps
    difference, where = worst_loss_difference(reference, other)
    assert difference <= audit.losses, f"{audit.name} on {layout}: {where} differs by {difference:.2e} (relative)"


@pytest.mark.parametrize(("audit", "layout"), RUNS)
def test_every_layout_ranks_the_same_predictions(audit_runs, audit, layout):
    # top-1 equal; top-5 within one image: at chance level a 5th and a 6th class's logits can be near enough for
    # rounding to swap them (the validation loss, compared to 1e-5, is the exact check)
    rows, other = epoch_rows(audit_runs(audit, "one_process")), epoch_rows(audit_runs(audit, layout))
    one_image = 100 / (10 * int(next(o for o in audit.overrides if "val_per_class" in o).split("=")[1]))
    for row, other_row in zip(rows, other, strict=True):
        for head in ("val", "val_ema"):
            assert other_row[f"{head}/top1"] == row[f"{head}/top1"], (audit.name, layout, row["epoch"], head)
            assert abs(other_row[f"{head}/top5"] - row[f"{head}/top5"]) <= one_image + 1e-9, (audit.name, layout)


def test_the_weights_moved_far_more_than_the_tolerance(audit_runs):
    # the audit can fail: the 3 steps move the weights a thousand times the tolerance (the resumed run's first
    # launch stopped after step 1)
    final = weights(audit_runs(SHORT, "one_process"), SHORT.steps)
    after_one = torch.load(RunDir(audit_runs(SHORT, "resumed_across")).previous_checkpoint, weights_only=True)
    assert after_one["step"] == 1
    moved = max_difference({f"model.{k}": v for k, v in after_one["model"].items()},
                           {k: v for k, v in final.items() if k.startswith("model.")})
    assert moved > 100 * SHORT.weights


@pytest.mark.slow
@pytest.mark.parametrize("audit", [LONG, BATCHNORM], ids=lambda audit: audit.name)
def test_one_other_draw_differs_by_far_more_than_the_tolerance(audit_runs, audit):
    # the negative control: one micro-batch's Mixup/CutMix drawn otherwise, nothing else; rounding stays within the
    # tolerances, one different draw does not come near them
    reference, control = audit_runs(audit, "one_process"), audit_runs(audit, "other_draw")
    difference = max_difference(weights(reference, audit.steps), weights(control, audit.steps))
    assert difference > audit.weight_gap * audit.weights, f"{audit.name}: one other draw: weights by {difference:.2e}"
    loss_difference, where = worst_loss_difference(reference, control)
    assert loss_difference > CONTROL_GAP * audit.losses, f"{audit.name}: {where} differs by {loss_difference:.2e}"


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
