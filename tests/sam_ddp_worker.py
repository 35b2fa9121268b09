"""One SAM step of a linear model under torchrun (Gloo): each rank steps on its own two rows and saves what it
ended with to `<out>.<rank>.pt` (tests/test_sam.py computes the same step by hand)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from deit_ablate.core.distributed import init_distributed
from deit_ablate.train.optim import build_scheduler
from deit_ablate.train.trainer import Trainer

RHO, LR = 0.5, 0.1
WEIGHT, BIAS = [[0.5, -1.0]], [0.25]
# Each rank's shard: (inputs, targets). The two shards' gradients point different ways, so each rank's own
# perturbation differs from the one of the averaged gradient.
SHARDS = (
    (torch.tensor([[1.0, 2.0], [3.0, -1.0]]), torch.tensor([[1.0], [0.0]])),
    (torch.tensor([[-2.0, 1.0], [0.5, 0.5]]), torch.tensor([[2.0], [-1.0]])),
)


def mse(images: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean squared error of a batch."""
    return ((outputs - targets) ** 2).mean()


def main(out: str) -> None:
    info = init_distributed("cpu")
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(WEIGHT))
        model.bias.copy_(torch.tensor(BIAS))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=0, min_lr=LR, warmup_lr=LR)
    trainer = Trainer(model=ddp, optimizer=optimizer, scheduler=scheduler, loss_fn=mse, info=info, sam_rho=RHO)
    images, targets = SHARDS[info.rank]
    trainer.train_step(images, targets)
    torch.save({"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone(),
                "grad_weight": model.weight.grad.clone(), "grad_bias": model.bias.grad.clone()},
               f"{out}.{info.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
