"""The training loss of the whole global batch, whatever the layout: each rank sums its own on the device at every
step, and the ranks' sums are added together only where the loss is read (a log row, a checkpoint, the epoch's end),
so that no step waits on the host or on the other ranks for it."""

from __future__ import annotations

import torch

from deit_ablate.core.distributed import DistInfo, all_reduce_sum


class LossSums:
    """An epoch's training loss, weighted by the images each rank holds: the logged step loss is the mean over all
    micro-batches of all ranks, the number one process computing every slot logs.

    `done` is the sum of the step losses and the step count of the epoch's batches before a resume (from the
    checkpoint); every rank starts from the same one."""

    def __init__(self, info: DistInfo, done: tuple[float, int] = (0.0, 0)) -> None:
        self.info, self.done = info, (float(done[0]), int(done[1]))
        zeros = dict(dtype=torch.float64, device=info.device)
        self._local = torch.zeros(2, **zeros)  # this rank's sum of loss x images (and images) since the last reduce
        self._window = torch.zeros(2, **zeros)  # every rank's, since the last log row
        self._epoch = torch.zeros(2, **zeros)  # every rank's, over this launch's steps of the epoch
        self._local_images = 0
        self.steps = 0  # this launch's steps of the epoch
        self._pending = 0  # steps added since the last reduce: the same count on every rank

    def add(self, loss: torch.Tensor, images: int) -> None:
        """One step's loss, the mean over this rank's `images` images; on the device, no host sync."""
        self._local[0].add_(loss.detach(), alpha=images)
        self._local_images += images
        self.steps += 1
        self._pending += 1

    @property
    def reduced(self) -> bool:
        """Whether every step added so far is in the ranks' sums (window_mean and epoch_sum may be read)."""
        return self._pending == 0

    def readable(self) -> bool:
        """Whether the sums can be read now without a collective: alone, after folding this process's steps in;
        on several ranks, only at a step where every rank called reduce()."""
        if not self.info.enabled:
            self.reduce()
        return self.reduced

    def reduce(self) -> None:
        """Add the ranks' sums together: a collective, called by every rank at the same step (a no-op when
        nothing was added since the last call, on every rank alike)."""
        if self.reduced:
            return
        self._local[1].fill_(self._local_images)
        all_reduce_sum(self._local, self.info)
        self._window += self._local
        self._epoch += self._local
        self._local.zero_()
        self._local_images, self._pending = 0, 0

    def window_mean(self) -> float:
        """The mean loss of the steps since the last call, over every image of every rank (a host sync); then
        starts the next window."""
        self._require_reduced()
        loss, images = self._window.tolist()
        self._window.zero_()
        return loss / images if images else float("nan")

    def epoch_sum(self) -> float:
        """The sum of the epoch's step losses so far, the batches before a resume included: what a mid-epoch
        checkpoint keeps (every step holds the same global batch, so the image-weighted mean times the steps)."""
        self._require_reduced()
        loss, images = self._epoch.tolist()
        return self.done[0] + (loss / images * self.steps if images else 0.0)

    def epoch_mean(self) -> float:
        """The epoch's mean training loss over every step of it, the batches before a resume included."""
        return self.epoch_sum() / max(self.steps + self.done[1], 1)

    def _require_reduced(self) -> None:
        if not self.reduced:
            raise RuntimeError(f"the training loss of the last {self._pending} step(s) is not summed over the ranks "
                               "yet: LossSums.reduce() must run on every rank first")
