"""The training step: gradient accumulation is the same update as one big batch."""

from __future__ import annotations

import copy

import torch

from deit_ablate.core.distributed import DistInfo
from deit_ablate.train.models import build_model
from deit_ablate.train.optim import build_optimizer, build_scheduler
from deit_ablate.train.trainer import Diverged, Trainer, evaluate
from tests.conftest import compose_config


def _trainer(model, accum_steps, optimizer_name="adamw"):
    optimizer = build_optimizer(model, optimizer_name, lr=1e-3, weight_decay=0.05)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=0, min_lr=1e-5, warmup_lr=1e-6)
    criterion = torch.nn.CrossEntropyLoss()
    return Trainer(model=model, optimizer=optimizer, scheduler=scheduler,
                   loss_fn=lambda images, outputs, targets: criterion(outputs, targets), info=DistInfo(),
                   accum_steps=accum_steps)


def _deterministic_model():
    cfg = compose_config(["model.drop_path=0", "model.kwargs.depth=2", "model.kwargs.embed_dim=32",
                          "model.kwargs.num_heads=2"])
    torch.manual_seed(0)
    return build_model(cfg.model, num_classes=10, img_size=32)


def test_two_accumulation_steps_of_half_batch_equal_one_step_of_full_batch():
    model = _deterministic_model()
    twin = copy.deepcopy(model)
    images, targets = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    # SGD: its update is linear in the gradient. Adam's first step is sign(g) * lr, which blows float noise in
    # gradients that are zero in exact arithmetic (the attention key bias) up to full-size steps.
    loss_one = _trainer(model, 1, "sgd").train_step(images, targets)
    loss_two = _trainer(twin, 2, "sgd").train_step(images, targets)
    assert torch.allclose(loss_one, loss_two, atol=1e-6)
    moved = 0
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
        moved += 1
    assert moved > 10
    # And the step did something: the weights left their initial values.
    fresh = _deterministic_model()
    assert not torch.allclose(fresh.head.weight, model.head.weight)


def test_non_finite_loss_raises_diverged_at_the_logging_interval():
    model = _deterministic_model()
    trainer = _trainer(model, 1)
    trainer.loss_fn = lambda images, outputs, targets: outputs.sum() * float("nan")
    trainer.log_interval = 1
    loader = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))] * 3
    try:
        trainer.train_steps(loader, epoch=0)
    except Diverged as diverged:
        assert diverged.step == 1
    else:
        raise AssertionError("a NaN loss did not end the epoch as diverged")


def test_evaluate_counts_top1_and_top5():
    class Fixed(torch.nn.Module):
        def forward(self, images):
            # Every image ranks the classes 3 > 7 > 0 > 1 > 2 > 4 > 5 > 6 > 8 > 9.
            scores = torch.tensor([0.5, 0.4, 0.3, 2.0, 0.2, 0.1, 0.0, 1.0, -0.1, -0.2])
            return scores.expand(images.shape[0], 10)

    targets = torch.tensor([3, 3, 1, 9])
    metrics = evaluate(Fixed(), [(torch.zeros(2, 3, 8, 8), targets[:2]), (torch.zeros(2, 3, 8, 8), targets[2:])],
                       DistInfo())
    assert metrics["top1"] == 50.0  # the two class-3 images
    assert metrics["top5"] == 75.0  # class 1 is fourth, class 9 last
