"""Sharpness measured (deit_ablate/sharpness.py): lambda_max against known and dense Hessians, the noisy loss, the
seed, the command on a finished run, the end-of-run measure, and the aggregator's columns."""

from __future__ import annotations

import torch
from torch import nn

from deit_ablate.sharpness import (
    BatchLoss,
    SharpnessSettings,
    hessian_vector_product,
    measure,
    noisy_loss,
    top_eigenvalue,
)


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
