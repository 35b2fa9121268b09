"""The fixed teacher's table under torchrun (Gloo): each rank computes its shard of 5 images, the ranks sum their
tables, and each saves what it holds to `<out>.<rank>.pt` (tests/test_teaching.py checks it by hand)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from deit_ablate.config.schema import RuntimeConfig
from deit_ablate.core.distributed import init_distributed
from deit_ablate.run.teacher_cache import teacher_table


def teacher() -> torch.nn.Module:
    """The same linear teacher on every rank and in the test."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10))


def images() -> list[torch.Tensor]:
    """Five 3x4x4 images: an odd count, so the ranks' shards differ in size (3 and 2)."""
    return [torch.full((3, 4, 4), float(i)) + torch.arange(48.0).reshape(3, 4, 4) / 48 for i in range(5)]


def main(out: str) -> None:
    info = init_distributed("cpu")
    runtime = OmegaConf.structured(RuntimeConfig(device="cpu", num_workers=0, worker_nice=0))
    dataset = [(image, 0) for image in images()]
    torch.save(teacher_table(teacher(), dataset, 2, runtime, 10, info), f"{out}.{info.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
