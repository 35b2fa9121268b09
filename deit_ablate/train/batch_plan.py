"""How the recipe's global batch is computed on a layout: virtual slots of the recipe's micro-batch, per process and
step (validate.plan_batch makes one and refuses a layout that would compute something else)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is computed: `slots` virtual slots of `micro_batch` images (the recipe's "8 GPUs x
    128"), `accum_steps` of them per process and step (world size x accum_steps = slots), each run in `split`
    passes when a device cannot hold a micro-batch and splitting it computes exactly the same."""

    world_size: int
    micro_batch: int
    slots: int
    accum_steps: int
    split: int = 1

    @property
    def per_rank_batch(self) -> int:
        """Images a process takes per optimizer step."""
        return self.accum_steps * self.micro_batch

    @property
    def pass_batch(self) -> int:
        """Images of one forward/backward pass."""
        return self.micro_batch // self.split

    def slots_of(self, rank: int) -> tuple[int, ...]:
        """The slots process `rank` computes, in the order its batch holds them."""
        return tuple(range(rank * self.accum_steps, (rank + 1) * self.accum_steps))
