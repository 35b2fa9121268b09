"""Sharpness measured (deit_ablate/train/sharpness.py): lambda_max against known and dense Hessians, the noisy loss, the
seed, the command on a finished run, the end-of-run measure, and the aggregator's columns."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from deit_ablate.analysis import sharpness as sharpness_cli
from deit_ablate.analysis.aggregate import cli
from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.record.rundir import wandb_root
from deit_ablate.train.sharpness import (
    FIGURES,
    BatchLoss,
    SharpnessSettings,
    hessian_vector_product,
    measure,
    noisy_loss,
    top_eigenvalue,
)
from tests.conftest import CONF, REPO, TINY, SharedRun, compose_config, identity_of, run_train


def _quadratic_top(a: torch.Tensor, theta: torch.Tensor) -> float:
    """lambda_max of 1/2 theta^T A theta by power iteration on its Hessian-vector products."""
    params = [theta]

    def hvp(v):
        return hessian_vector_product(lambda: [0.5 * theta @ a @ theta], params, v)

    return top_eigenvalue(hvp, params, iters=500, tol=1e-12, seed=0).value


def test_lambda_max_of_a_quadratic_is_its_largest_eigenvalue() -> None:
    # A = Q diag(5, 3, 1, -2) Q^T with Q a rotation written out: eigenvalues known exactly.
    c, s = 0.6, 0.8
    q = torch.tensor([[c, -s, 0, 0], [s, c, 0, 0], [0, 0, c, -s], [0, 0, s, c]], dtype=torch.float64)
    a = q @ torch.diag(torch.tensor([5.0, 3.0, 1.0, -2.0], dtype=torch.float64)) @ q.T
    theta = torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=torch.float64, requires_grad=True)
    assert abs(_quadratic_top(a, theta) - 5.0) < 1e-4


def test_a_negative_dominant_eigenvalue_still_gives_the_largest() -> None:
    # eigenvalues (-7, 2, 1): power iteration alone finds -7; the shifted pass must find 2
    a = torch.diag(torch.tensor([-7.0, 2.0, 1.0], dtype=torch.float64))
    theta = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64, requires_grad=True)
    assert abs(_quadratic_top(a, theta) - 2.0) < 1e-4


def _tiny_mlp() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A 2-layer tanh MLP (8 -> 16 -> 4: 212 parameters) in float64 and two batches of 12 and 8 points."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    x = torch.randn(20, 8, dtype=torch.float64)
    y = torch.randint(0, 4, (20,))
    return model, [(x[:12], y[:12]), (x[12:], y[12:])]


def _dense_hessian_top(model: nn.Module, batches) -> float:
    """The largest eigenvalue of the dense Hessian of the mean cross-entropy over all the points."""
    from torch.func import functional_call

    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])

    def loss(theta: torch.Tensor) -> torch.Tensor:
        tensors, at = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            tensors[name] = theta[at: at + shape.numel()].reshape(shape)
            at += shape.numel()
        return nn.functional.cross_entropy(functional_call(model, tensors, (x,)), y)

    hessian = torch.autograd.functional.hessian(loss, flat)
    return float(torch.linalg.eigvalsh(hessian).max())


def test_lambda_max_of_a_tiny_network_matches_the_dense_hessian() -> None:
    model, batches = _tiny_mlp()
    assert sum(p.numel() for p in model.parameters()) == 212
    dense = _dense_hessian_top(model, batches)
    figures = measure(model, batches, SharpnessSettings(iters=300, tol=1e-8, draws=2), show_progress=False)
    assert abs(figures["lambda_max"] - dense) <= 0.01 * abs(dense)
    assert figures["settings"]["images"] == 20 and figures["settings"]["parameters"] == 212


def test_noise_of_sigma_zero_gives_the_training_loss_and_restores_the_weights() -> None:
    model, batches = _tiny_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    loss = BatchLoss(model, batches)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    by_hand = float(nn.functional.cross_entropy(model(x), y).detach())
    assert abs(loss.value() - by_hand) < 1e-12
    # sigma = 0: each draw is the training loss itself (the mean of three rounds in the last bit at most)
    assert abs(noisy_loss(loss, list(model.parameters()), 0.0, 3, seed=0) - loss.value()) < 1e-14
    noisy = noisy_loss(loss, list(model.parameters()), 0.5, 3, seed=0)
    assert noisy != loss.value()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_same_seed_same_figures_other_seed_other_noise() -> None:
    model, batches = _tiny_mlp()
    settings = SharpnessSettings(iters=5, tol=0.0, sigma=0.1, draws=2, seed=3)
    first = measure(model, batches, settings, show_progress=False)
    again = measure(model, batches, settings, show_progress=False)
    assert first == again
    other = measure(model, batches, SharpnessSettings(iters=5, tol=0.0, sigma=0.1, draws=2, seed=4),
                    show_progress=False)
    assert other["noisy_loss"] != first["noisy_loss"]
    assert other["train_loss"] == first["train_loss"]


# --- the command on a finished run, the end-of-run measure, the aggregator ------------------------------------------

QUICK = ["--images", "64", "--iters", "3", "--draws", "2"]  # a few seconds on the CPU
SHARP_NUMBERS = "zz_sharpness_numbers"  # a throwaway numbers file's folder in conf/ (removed after its test)
PAPER_FIGURES = {"lambda_max": 738.8, "train_loss": 0.65, "noisy_loss": 6.66}


def _measure(run_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_train([str(run_dir), *QUICK, *extra], run_dir.parents[2], cache, extra_env={"PYTHONPATH": str(REPO)},
                     module=[sys.executable, "-m", "deit_ablate.sharpness"])


def _markdown(outputs: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    assert cli.main([str(outputs), *extra]) == 0
    return capsys.readouterr().out


def _header(markdown: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith("| ablation"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def _baseline_cells(markdown: str) -> dict[str, str]:
    line = next(line for line in markdown.splitlines() if line.startswith("| baseline"))
    return dict(zip(_header(markdown), (cell.strip() for cell in line.strip("|").split("|")), strict=True))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, tiny_run: SharedRun,
             data_cache: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of the finished tiny run, measured by the command once; its run folder and the command's process."""
    cwd = tmp_path_factory.mktemp("measured")
    tiny_run.copy_into(cwd)
    run_dir = next((cwd / "outputs" / "runs").iterdir())
    return run_dir, _measure(run_dir, data_cache)


def test_the_command_records_the_figures_in_result_json_and_prints_them(measured, tiny_run: SharedRun) -> None:
    run_dir, proc = measured
    before = json.loads((tiny_run.run_dir() / "result.json").read_text())
    result = json.loads((run_dir / "result.json").read_text())
    sharp = result.pop("sharpness")
    assert result == before  # the run's own summary is kept as it was
    assert set(sharp) == {"lambda_max", "train_loss", "noisy_loss", "settings"}
    settings = sharp["settings"]
    assert (settings["images"], settings["iters"], settings["draws"], settings["seed"]) == (64, 3, 2, 0)
    assert settings["sigma"] == 0.01 and settings["checkpoint"] == "checkpoint-last.pt"
    assert settings["hessian_vector_products"] == 3 and settings["split"] == "train"
    assert sharp["lambda_max"] > 0 and sharp["train_loss"] > 0 and sharp["noisy_loss"] > 0
    assert f"lambda_max   {sharp['lambda_max']:.4g}" in proc.stdout
    assert f"train loss   {sharp['train_loss']:.4f}" in proc.stdout
    assert "recorded in" in proc.stdout and "wandb summary of run id" in proc.stdout


@pytest.mark.slow
def test_the_same_seed_measures_the_same_figures_again(measured, data_cache: Path) -> None:
    run_dir, _ = measured
    first = json.loads((run_dir / "result.json").read_text())["sharpness"]
    _measure(run_dir, data_cache, "--no-wandb")
    assert json.loads((run_dir / "result.json").read_text())["sharpness"] == first


def test_bad_input_is_one_line(tmp_path: Path, tiny_run: SharedRun, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_run.copy_into(tmp_path)
    run_dir = next((tmp_path / "outputs" / "runs").iterdir())

    def refused(argv: list[str], message: str) -> None:
        assert sharpness_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err

    refused([str(tmp_path)], "is not a run folder")
    with pytest.raises(SystemExit) as refusal:  # an out-of-range number is argparse's error, before any reading
        sharpness_cli.main([str(run_dir), "--sigma", "-1"])
    assert refusal.value.code == 2 and "argument --sigma: -1 is out of range" in capsys.readouterr().err
    (run_dir / "checkpoint-last.pt").unlink()
    refused([str(run_dir)], "has no checkpoint-last.pt")
    (run_dir / "result.json").unlink()
    refused([str(run_dir)], "has not finished (unfinished: 1 of 1 epochs")


def test_the_aggregator_shows_the_columns_when_a_run_has_figures(measured, tiny_run: SharedRun,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert "λ_max" not in _header(_markdown(tiny_run.outputs, capsys))  # hidden: no run measured
    run_dir, _ = measured
    sharp = json.loads((run_dir / "result.json").read_text())["sharpness"]
    cells = _baseline_cells(_markdown(run_dir.parents[1], capsys))
    assert "paper λ_max" not in cells  # Table 8's numbers have no sharpness figures
    assert cells["λ_max"] == f"{sharp['lambda_max']:.1f}"
    assert cells["train loss"] == f"{sharp['train_loss']:.3f}"
    assert cells["noisy loss"] == f"{sharp['noisy_loss']:.3f}"


@pytest.fixture
def paper_figures() -> Iterator[str]:
    """A throwaway numbers file whose `baseline` row has Chen et al.'s ViT-B/16 figures; its table's name."""
    folder = CONF / SHARP_NUMBERS
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    table = {"title": "sharpness figures", "citation": "Chen, Hsieh & Gong (2022)", "model": "ViT-B/16",
             "rows_key": "ablation", "baseline": "baseline", "columns": {"pretrain": "224"},
             "rows": [{"key": "baseline", "label": "original ViT recipe", "pretrain": 74.6,
                       "sharpness": PAPER_FIGURES}, {"key": "sgd", "label": "SGD", "pretrain": 71.5}]}
    try:
        (folder / "numbers.json").write_text(json.dumps({"zz_sharp": table}))
        yield "zz_sharp"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_aggregator_puts_the_papers_figures_beside_ours(measured, paper_figures: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _ = measured
    outputs = run_dir.parents[1]
    cells = _baseline_cells(_markdown(outputs, capsys, "--paper", paper_figures))
    assert (cells["paper λ_max"], cells["paper train loss"], cells["paper noisy loss"]) == ("738.8", "0.65", "6.66")
    assert cli.main([str(outputs), "--paper", paper_figures, "--format", "json"]) == 0
    (row,) = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["key"] == "baseline"]
    figures = row["cells"]["pretrain"]["sharpness"]
    assert figures["lambda_max"]["paper"] == 738.8 and figures["lambda_max"]["n"] == 1
    sharp = json.loads((run_dir / "result.json").read_text())["sharpness"]
    assert figures["noisy_loss"]["mean"] == sharp["noisy_loss"]


def test_sharpness_settings_leave_the_run_identity_alone() -> None:
    plain = identity_of(TINY)
    measured_too = identity_of([*TINY, "sharpness.at_end=true", "sharpness.images=8", "sharpness.sigma=0.1"])
    assert (measured_too.name, measured_too.run_id) == (plain.name, plain.run_id)


AT_END = ["sharpness.at_end=true", "sharpness.images=64", "sharpness.iters=3", "sharpness.draws=2"]


@pytest.fixture(scope="module")
def at_end_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> SharedRun:
    """TINY for 2 steps with sharpness.at_end=true (and QUICK's settings), trained once."""
    cwd = tmp_path_factory.mktemp("at_end")
    return SharedRun(cwd, run_train([*TINY, "train.max_steps=2", *AT_END], cwd, data_cache))


def _logged_figures(outputs: Path) -> dict[str, float]:
    (logged,) = read_offline(wandb_root(outputs), warn=lambda m: None)
    return {k: logged.summary[f"sharpness/{k}"] for k in FIGURES}


@pytest.mark.slow
def test_at_end_measures_the_final_weights_as_the_command_does(at_end_run: SharedRun, data_cache: Path,
                                                               tmp_path: Path) -> None:
    proc = at_end_run.proc
    sharp = json.loads((at_end_run.run_dir() / "result.json").read_text())["sharpness"]
    assert "[run] sharpness:" in proc.stdout + proc.stderr and "sharpness lambda_max" in proc.stdout
    assert _logged_figures(at_end_run.outputs) == {k: sharp[k] for k in FIGURES}
    # the command on a copy, same settings: the same images, weights and seed give the same figures
    at_end_run.copy_into(tmp_path)
    run_dir = next((tmp_path / "outputs" / "runs").iterdir())
    _measure(run_dir, data_cache, "--no-wandb")
    again = json.loads((run_dir / "result.json").read_text())["sharpness"]
    for name in FIGURES:
        assert again[name] == pytest.approx(sharp[name], rel=1e-5)


@pytest.mark.slow
def test_a_lost_wandb_log_gets_the_figures_again(at_end_run: SharedRun, data_cache: Path, tmp_path: Path) -> None:
    sharp = json.loads((at_end_run.run_dir() / "result.json").read_text())["sharpness"]
    outputs = at_end_run.copy_into(tmp_path)
    shutil.rmtree(outputs / "wandb")
    # the relaunch that skips the finished run logs it again from result.json: the figures as the summary has them
    assert "already finished" in run_train([*TINY, "train.max_steps=2", *AT_END], tmp_path, data_cache).stdout
    assert _logged_figures(outputs) == {k: sharp[k] for k in FIGURES}


def test_a_distilled_model_is_measured_on_its_class_head() -> None:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, num_classes=3, img_size=16,
                              patch_size=8, embed_dim=16, depth=1, num_heads=2).eval()
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 1])
    with torch.no_grad():
        tokens = model.forward_features(images)
        by_hand = float(nn.functional.cross_entropy(model.head(tokens[:, 0]), labels))
        fused = float(nn.functional.cross_entropy(model(images), labels))  # timm's eval output: the heads' mean
    assert abs(BatchLoss(model, [(images, labels)]).value() - by_hand) < 1e-6
    assert abs(fused - by_hand) > 1e-4  # the class head is not the fused output
    figures = measure(model, [(images, labels)], SharpnessSettings(iters=3, draws=1), show_progress=False)
    assert figures["lambda_max"] == figures["lambda_max"]  # finite: double backward through timm's attention


@pytest.mark.slow
def test_two_ranks_measure_on_rank_0_only_and_agree_with_the_command(tmp_path: Path, data_cache: Path) -> None:
    run_dir = tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29741",
                str(REPO / "train.py")]
    run_train([*TINY, "train.max_steps=2", *AT_END, f"hydra.run.dir={run_dir}"], tmp_path, data_cache,
              module=torchrun)
    assert "measuring the sharpness" in (run_dir / "train.log").read_text()
    assert "measuring the sharpness" not in (run_dir / "train-rank1.log").read_text()  # rank 1 waited
    sharp = json.loads((run_dir / "result.json").read_text())["sharpness"]
    _measure(run_dir, data_cache, "--no-wandb")
    again = json.loads((run_dir / "result.json").read_text())["sharpness"]
    for name in FIGURES:
        assert again[name] == pytest.approx(sharp[name], rel=1e-5)


def test_settings_out_of_range_are_refused_before_a_launch() -> None:
    from deit_ablate.core.errors import ConfigError
    from deit_ablate.run.validate import check_ranges

    for override, message in (("sharpness.iters=0", "sharpness.iters=0 must be >= 1"),
                              ("sharpness.sigma=-0.1", "sharpness.sigma=-0.1 must be >= 0.0"),
                              ("sharpness.tol=0", "sharpness.tol=0.0 must be > 0.0")):
        with pytest.raises(ConfigError, match=message):
            check_ranges(compose_config([override]))
    check_ranges(compose_config(["sharpness.at_end=true", "sharpness.sigma=0"]))  # sigma 0: the training loss
