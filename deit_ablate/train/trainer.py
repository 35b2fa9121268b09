"""The computation of training: one optimizer step (Trainer.train_step), the steps of an epoch's batches
(Trainer.train_steps; run/loop.py's EpochLoop is the loop over epochs), and the evaluation."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from timm.data import Mixup
from timm.utils import ModelEmaV3
from torch.nn.modules.batchnorm import _NormBase

from deit_ablate.core.distributed import DistInfo, all_reduce_sum, broadcast_tensors
from deit_ablate.core.logs import progress_bar
from deit_ablate.core.streams import EpochStreams, RunStreams, Stream, slot_positions
from deit_ablate.record.predictions import LocalPredictions
from deit_ablate.train.artifacts import HighNormCounter, high_norm_percent, measures_high_norm
from deit_ablate.train.loss_sums import LossSums
from deit_ablate.train.losses import distilled_eval_outputs, distilled_head_logits
from deit_ablate.train.models import set_training_mode
from deit_ablate.train.sam import (
    GRAD_EVALS_PER_STEP,
    PassTimer,
    frozen_running_stats,
    perturbation,
    perturbed,
    rng_state,
    set_rng_state,
    with_grad,
)

if TYPE_CHECKING:
    from deit_ablate.train.batch_plan import BatchPlan

LossFn = Callable[[torch.Tensor, object, torch.Tensor], torch.Tensor]  # (images, model outputs, targets) -> loss


class Diverged(RuntimeError):
    """The training loss became NaN or infinite: a result for Table 8, not a crash."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"training loss is {loss} at step {step}")
        self.step = step
        self.loss = loss


@dataclass
class Trainer:
    """What one optimizer step needs, and the step counter it advances."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    loss_fn: LossFn
    info: DistInfo
    accum_steps: int = 1  # forward/backward passes per step (set from `batch` when given)
    batch: BatchPlan | None = None  # the virtual slots this process computes; None: one slot per pass (tests)
    mixup: Mixup | None = None
    ema: ModelEmaV3 | None = None
    amp_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None  # fp16 only: scales the loss, skips steps with inf/NaN gradients
    clip_grad: float | None = None
    batch_transform: Callable[..., torch.Tensor] | None = None  # (images, out=) on the device, before Mixup
    log_interval: int = 10
    train_mode: bool = True  # False: eval mode while training (DeiT's fine-tune), see models.set_training_mode
    sam_rho: float = 0.0  # SAM's radius (Foret et al. 2021); 0: the plain step, see _sam_chunk
    step: int = 0
    on_log: Callable[[dict, int], None] = field(default=lambda metrics, step: None)
    _skipped: torch.Tensor | None = field(default=None, init=False, repr=False)  # on the device: no host sync
    _sam_timer: PassTimer | None = field(default=None, init=False, repr=False)
    _epoch: EpochStreams | None = field(default=None, init=False, repr=False)  # this epoch's draws, by train_steps
    losses: LossSums | None = field(default=None, init=False, repr=False)  # this epoch's loss, set by train_steps

    def __post_init__(self) -> None:
        if self.batch is not None:
            self.accum_steps = self.batch.accum_steps * self.batch.split
        self._slots = self.batch.slots_of(self.info.rank) if self.batch is not None else tuple(range(self.accum_steps))
        self._keeps_running_stats = any(isinstance(m, _NormBase) and m.track_running_stats
                                        for m in self.module.modules())
        if self.scaler is not None:
            self._skipped = torch.zeros((), dtype=torch.long, device=self.info.device)
        if self.sam_rho:
            self._sam_timer = PassTimer(self.info.device)

    @property
    def amp_skipped_steps(self) -> int:
        """Optimizer steps the fp16 loss scaler skipped (inf/NaN gradients) over the whole run."""
        return 0 if self._skipped is None else int(self._skipped.item())

    def amp_metrics(self) -> dict[str, float]:
        """The loss scaler's scale and skipped steps for a log row; empty without a scaler."""
        if self.scaler is None:
            return {}
        return {"train/loss_scale": self.scaler.get_scale(), "train/amp_skipped_steps": self.amp_skipped_steps}

    def sam_metrics(self) -> dict[str, float]:
        """SAM's cost for a log row: gradient evaluations per step and the second passes' measured share of the
        step time since the last row; empty without SAM."""
        if self._sam_timer is None:
            return {}
        metrics = {"train/sam_grad_evals_per_step": float(GRAD_EVALS_PER_STEP)}
        share = self._sam_timer.share()
        if share is not None:
            metrics["train/sam_second_pass_share"] = share
        return metrics

    def autocast(self):
        """Autocast to the configured dtype (bf16 or fp16), a no-op context without one."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.info.device.type, dtype=self.amp_dtype)

    @property
    def module(self) -> torch.nn.Module:
        """The model without its DDP wrapper."""
        return getattr(self.model, "module", self.model)

    def state_dict(self) -> dict:
        """Weights, optimizer, schedule, EMA, loss scaler and step count: what a resume needs of the trainer."""
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "step": self.step}
        if self.ema is not None:
            state["ema"] = self.ema.module.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
            state["amp_skipped_steps"] = self.amp_skipped_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None and "ema" in state:
            self.ema.module.load_state_dict(state["ema"])
        if self.scaler is not None and "scaler" in state:  # a checkpoint without one starts a fresh scaler
            self.scaler.load_state_dict(state["scaler"])
            self._skipped.fill_(int(state.get("amp_skipped_steps", 0)))
        self.step = int(state["step"])

    def train_step(self, images: torch.Tensor, targets: torch.Tensor, step_in_epoch: int = 0) -> torch.Tensor:
        """One optimizer step on this process's micro-batches of the global batch; the mean training loss at the
        weights the step starts from.

        Each micro-batch is one virtual slot, one GPU of the reference's run: it draws its own Mixup/CutMix (lambda,
        box, which of the two) and drop path, keyed by (epoch, step, slot) once train_steps has set the epoch's
        streams; with SAM it is perturbed by its own gradient (see _sam_chunk); BatchNorm's running statistics
        follow slot 0's micro-batches, as DDP's buffer broadcast from rank 0 makes them on G GPUs."""
        self.optimizer.zero_grad(set_to_none=True)
        if self._sam_timer is not None:
            self._sam_timer.start_step()
        total = torch.zeros((), device=images.device)
        chunks = list(zip(images.chunk(self.accum_steps), targets.chunk(self.accum_steps), strict=False))
        passes = self.batch.split if self.batch is not None else 1  # passes per micro-batch
        for index, (chunk_images, chunk_targets) in enumerate(chunks):
            slot = self._slots[index // passes]
            if self._epoch is not None:
                self._epoch.seed_chunk(step_in_epoch, slot)
            if self.mixup is not None:
                chunk_images, chunk_targets = self.mixup(chunk_images, chunk_targets)
            last = index == len(chunks) - 1
            with self._running_stats_of(slot):
                if self.sam_rho:
                    loss = self._sam_chunk(chunk_images, chunk_targets, len(chunks), last)
                else:
                    with self._no_sync(last):
                        with self.autocast():
                            outputs = self.model(chunk_images)
                            loss = self.loss_fn(chunk_images, outputs, chunk_targets)
                        self._backward(loss / len(chunks))
            total += loss.detach() / len(chunks)
        self._optimizer_step()
        # A step the fp16 scaler skipped still advances the step counter, the schedule and the EMA, so step counts,
        # checkpoints and resumes never depend on skips; the released code likewise stepped its schedule per epoch
        # and updated its EMA after every iteration, skipped or not.
        self.step += 1
        self.scheduler.step_update(num_updates=self.step)
        if self.ema is not None:
            self.ema.update(getattr(self.model, "module", self.model), step=self.step)
        if self._sam_timer is not None:
            self._sam_timer.mark()
        return total

    def _running_stats_of(self, slot: int):
        """BatchNorm's running statistics updated by slot 0's micro-batch only (frozen for the others): DDP
        broadcasts rank 0's buffers before every forward, so on G GPUs they follow the first GPU's batches."""
        if slot == 0 or not self._keeps_running_stats:
            return contextlib.nullcontext()
        return frozen_running_stats(self.module)

    def sample_seeds(self, stream: Stream, step_in_epoch: int) -> list[int] | None:
        """The seeds of this process's samples at `step_in_epoch`, in batch order (None before train_steps sets
        the epoch, or without a batch plan)."""
        if self._epoch is None or self.batch is None:
            return None
        positions = slot_positions(self.batch.slots, self._slots, self.batch.micro_batch, step_in_epoch)
        return [self._epoch.sample_seed(stream, position) for position in positions]

    def _no_sync(self, last: bool = False):
        """DDP's no_sync (gradients stay on this rank) unless `last`; a no-op without DDP."""
        return contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()

    def _sam_chunk(self, images: torch.Tensor, targets: torch.Tensor, chunks: int, last: bool) -> torch.Tensor:
        """Add one chunk's SAM gradient, grad L(theta + eps) with eps = rho g / ||g|| and g = grad L(theta) on the
        same chunk, to the step's gradient; its loss at theta.

        Foret et al. 2021 (arXiv:2010.01412) §4.1, m-sharpness: each chunk (one GPU of the reference's run, a rank
        without accumulation) is perturbed by its own g, never all-reduced, and the chunks' and ranks' g_SAM are
        averaged as plain gradients are. The earlier chunks' g_SAM is set aside during the first pass, so g is this
        chunk's alone. The second pass sees the same mixed images and targets and redraws the first pass's drop
        path and dropout masks, so g_SAM is the gradient of the same sampled loss at theta + eps."""
        accumulated = {p: p.grad for p in self.module.parameters()}
        for p in accumulated:
            p.grad = None
        state = rng_state(self.info.device)
        with self._no_sync():  # the first backward stays on this rank
            with self.autocast():
                loss = self.loss_fn(images, self.model(images), targets)
            self._backward(loss / chunks)
        params = with_grad(self.module)
        eps, finite = perturbation([p.grad for p in params], self.sam_rho)
        for p, grad in accumulated.items():
            p.grad = grad
        set_rng_state(state, self.info.device)
        self._sam_timer.mark()
        with perturbed(params, eps), frozen_running_stats(self.module), self._no_sync(last):
            del eps
            with self.autocast():
                second = self.loss_fn(images, self.model(images), targets)
            if self.scaler is not None:  # a first pass that overflowed makes the step one the scaler skips
                second = second * torch.where(finite, 1.0, float("nan"))
            self._backward(second / chunks)
        self._sam_timer.mark()
        return loss

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of one chunk's share of the loss, scaled first under fp16."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def _optimizer_step(self) -> None:
        """Clip (when set) and step; under fp16 through the scaler, which skips a step with inf/NaN gradients and
        halves its scale, so a skip shows as a lower scale."""
        if self.scaler is None:
            self._clip()
            self.optimizer.step()
            return
        if self.clip_grad:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        self._clip()
        # the scale tensor itself: get_scale() would stop the host at every step to read it
        before = self.scaler._get_scale_async().clone()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._skipped += self.scaler._get_scale_async() < before

    def _clip(self) -> None:
        """Clip the gradients' global norm to optimizer.clip_grad when it is set."""
        if self.clip_grad:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)

    def train_steps(self, loader, epoch: int, max_steps: int | None = None,
                    step_hook: Callable[[int], None] | None = None, streams: RunStreams | None = None,
                    first_step: int = 0, done: tuple[float, int] = (0.0, 0)) -> float:
        """Run the epoch's batches (from its step `first_step` on, after a resume); returns the mean training loss of
        the epoch over every rank's images, the loss sum and count of the batches `done` before a resume included
        (`losses`: the running sums, for a mid-epoch checkpoint). With the run's `streams`, every draw is keyed by
        (epoch, step, slot) or the sample's position (streams.py).
        Raises Diverged on a non-finite loss."""
        set_training_mode(self.model, self.train_mode)
        self._epoch = EpochStreams(streams, epoch) if streams is not None else None
        bar = progress_bar(loader, desc=f"epoch {epoch + 1}", disable=not self.info.is_main, dynamic_ncols=True,
                           leave=False, mininterval=1.0)  # plain lines, not a redrawn bar, in a log file
        losses = self.losses = LossSums(self.info, done)
        steps_in_epoch, window_images = 0, 0
        window_start = time.perf_counter()
        reused = None  # on CPU, the float batch of the per-batch step: a fresh 38 MB tensor per step costs page faults
        for images, targets, *erasing in bar:  # erasing: the loader workers' erasing boxes, where they draw them
            if max_steps is not None and self.step >= max_steps:
                break
            images = images.to(self.info.device, non_blocking=True)
            targets = targets.to(self.info.device, non_blocking=True)
            step_in_epoch = first_step + steps_in_epoch
            if self.batch_transform is not None:
                boxes = erasing[0] if erasing else None
                erases = getattr(self.batch_transform, "erasing", None) is not None
                seeds = self.sample_seeds(Stream.ERASING, step_in_epoch) if erases and boxes is None else None
                images = self.batch_transform(images, out=reused, seeds=seeds, boxes=boxes)
                reused = images if images.device.type == "cpu" else None
            losses.add(self.train_step(images, targets, step_in_epoch), images.shape[0])
            steps_in_epoch += 1
            window_images += images.shape[0] * self.info.world_size
            if self.step % self.log_interval == 0:
                # The only host-device sync of the loop, once per logging interval: the ranks' loss sums added up.
                losses.reduce()
                mean_loss = losses.window_mean()
                rate = window_images / (time.perf_counter() - window_start)
                lr = self.optimizer.param_groups[0]["lr"]
                bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}", img_s=f"{rate:.0f}")
                self.on_log({"train/loss": mean_loss, "train/lr": lr, "train/img_per_s": rate, "epoch": epoch,
                             **self.amp_metrics(), **self.sam_metrics()}, self.step)
                if not math.isfinite(mean_loss):
                    raise Diverged(self.step, mean_loss)
                window_images = 0
                window_start = time.perf_counter()
            if step_hook is not None:
                step_hook(steps_in_epoch)
        bar.close()
        losses.reduce()
        mean = losses.epoch_mean()
        if not math.isfinite(mean):
            raise Diverged(self.step, mean)
        return mean


def _head_scores(model: torch.nn.Module, images: torch.Tensor, fusion: str) -> dict[str, torch.Tensor]:
    """Scores to rank classes by: the logits, or for a distilled ViT each head and both fusion rules."""
    if hasattr(model, "head_dist"):
        cls_logits, dist_logits = distilled_head_logits(model, images)
        return distilled_eval_outputs(cls_logits.float(), dist_logits.float(), fusion)
    return {"main": model(images).float()}


_HEADS = ((4, "cls"), (5, "dist"), (6, "fused_alt"))


@torch.inference_mode()
def evaluate(model: torch.nn.Module, loader, info: DistInfo, amp_dtype: torch.dtype | None = None,
             max_batches: int | None = None, fusion: str = "prob",
             predictions: LocalPredictions | None = None) -> dict[str, float]:
    """Top-1, top-5 (in percent) and mean cross-entropy over the whole eval set, summed across ranks; with
    `predictions`, each image's predicted class per head is kept there too (this rank's, in its loader's order).

    A model with a distillation token is ranked by its fused prediction (rule `fusion`); the class head, the
    distillation head and the other fusion rule are reported as top1_cls, top1_dist and top1_fused_alt. A ViT also
    reports high_norm_tokens: the percentage of its output patch tokens of high norm (deit_ablate.train.artifacts).
    Every rank scores with the running statistics one process has (share_running_stats)."""
    model = getattr(model, "module", model)
    share_running_stats(model, info)
    model.eval()
    counter = HighNormCounter(model, info.device) if measures_high_norm(model) else None
    try:
        metrics = _evaluate(model, loader, info, amp_dtype, max_batches, fusion, predictions)
    finally:
        if counter is not None:
            counter.remove()
    if counter is not None:
        all_reduce_sum(counter.sums, info)
        metrics["high_norm_tokens"] = high_norm_percent(counter.sums)
    return metrics


def share_running_stats(model: torch.nn.Module, info: DistInfo) -> None:
    """Give every rank rank 0's BatchNorm running statistics (a collective; nothing to do without BatchNorm).

    Only slot 0's micro-batches update them (Trainer._running_stats_of) and rank 0 computes slot 0, so its buffers,
    and its EMA's, are the ones one process computing every slot has, and the ones it saves; another rank's lag a
    step behind, where DDP last broadcast rank 0's before slot 0's update, and its EMA averages those."""
    stats = [buffer for module in model.modules() if isinstance(module, _NormBase) and module.track_running_stats
             for buffer in module.buffers(recurse=False)]
    broadcast_tensors(stats, info)


def _evaluate(model: torch.nn.Module, loader, info: DistInfo, amp_dtype: torch.dtype | None,
              max_batches: int | None, fusion: str, predictions: LocalPredictions | None = None) -> dict[str, float]:
    """evaluate's accuracy and loss."""
    sums = torch.zeros(7, dtype=torch.float64, device=info.device)  # correct@1, @5, loss, count, then _HEADS
    autocast = (torch.autocast(device_type=info.device.type, dtype=amp_dtype) if amp_dtype is not None
                else contextlib.nullcontext())
    for index, (images, targets) in enumerate(loader):
        if max_batches is not None and index >= max_batches:
            break
        images = images.to(info.device, non_blocking=True)
        targets = targets.to(info.device, non_blocking=True)
        with autocast:
            scores = _head_scores(model, images, fusion)
        ranked = scores.get("main", scores.get("fused"))
        top5 = ranked.topk(min(5, ranked.shape[1]), dim=1).indices
        hits = top5.eq(targets[:, None])
        if predictions is not None:
            predictions.add(scores, top5[:, 0], targets)
        sums[0] += hits[:, 0].sum()
        sums[1] += hits.any(dim=1).sum()
        sums[2] += torch.nn.functional.cross_entropy(scores.get("main", scores.get("cls")), targets, reduction="sum")
        sums[3] += targets.numel()
        for slot, head in _HEADS:
            if head in scores:
                sums[slot] += scores[head].argmax(dim=1).eq(targets).sum()
    all_reduce_sum(sums, info)
    count = max(sums[3].item(), 1.0)
    metrics = {"top1": 100 * sums[0].item() / count, "top5": 100 * sums[1].item() / count,
               "loss": sums[2].item() / count}
    if hasattr(model, "head_dist"):
        metrics.update({f"top1_{head}": 100 * sums[slot].item() / count for slot, head in _HEADS})
    return metrics
