"""timm's reference train.py: obtain it, build its command line from one of our configs, parse its step log.

timm's pip package does not ship train.py. Get the script of the installed release (or the repository head) with

    git clone --filter=blob:none https://github.com/huggingface/pytorch-image-models /tmp/timm-repo
    git -C /tmp/timm-repo show v1.0.31:train.py > /tmp/timm_train.py   # or HEAD:train.py

and pass `--timm-train /tmp/timm_train.py` to scripts/bench.py. Never commit it into this repository.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from deit_ablate.train.models import is_vision_transformer
from deit_ablate.train.optim import scaled_lr

# "Train: 0 [   5/39 ( 15%)]  Loss: ... Time: 0.201s,  638.31/s  (...)  LR: ...  Data: 0.008 (0.076)"
STEP_LINE = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+).*?Time: ([\d.]+)s,.*?Data: ([\d.]+)")


def timm_args(overrides: list[str], data_dir: Path, out_dir: Path, workers: int, device: str) -> list[str]:
    """train.py flags for the same model, data, batch and DeiT recipe as `python train.py <overrides>` (repeated
    augmentation off).

    timm takes whole warm-up epochs only; a fractional optimizer.warmup_epochs is rounded (the schedule does not
    change the speed)."""
    from deit_ablate.bench.compose import compose_run

    cfg = compose_run(overrides)
    model, aug, mix, opt, train, runtime = cfg.model, cfg.augment, cfg.mix, cfg.optimizer, cfg.train, cfg.runtime
    kwargs = dict(OmegaConf.to_container(model.kwargs, resolve=True))
    if is_vision_transformer(model.name):
        kwargs["img_size"] = cfg.resolution.train_size
    args = [
        "--data-dir", str(data_dir), "--train-split", "train", "--val-split", "val",
        "--num-classes", str(cfg.data.num_classes), "--model", model.name,
        "--img-size", str(cfg.resolution.train_size), "--drop-path", str(model.drop_path), "--drop", str(model.dropout),
        "-b", str(train.global_batch), "-vb", str(runtime.eval_batch), "-j", str(workers), "--device", device,
        "--aa", str(aug.auto_augment), "--reprob", str(aug.reprob), "--remode", aug.remode,
        "--recount", str(aug.recount), "--scale", *map(str, aug.scale), "--hflip", str(aug.hflip),
        "--color-jitter", str(aug.color_jitter), "--train-interpolation", aug.interpolation,
        "--interpolation", aug.interpolation, "--mean", *map(str, cfg.data.mean), "--std", *map(str, cfg.data.std),
        "--mixup", str(mix.mixup_alpha), "--cutmix", str(mix.cutmix_alpha), "--mixup-prob", str(mix.prob),
        "--mixup-switch-prob", str(mix.switch_prob), "--mixup-mode", mix.mode, "--smoothing", str(mix.label_smoothing),
        "--opt", opt.name, "--weight-decay", str(opt.weight_decay), "--opt-eps", str(opt.eps),
        "--lr", str(scaled_lr(opt.lr, train.global_batch, opt.lr_base_batch)), "--sched", str(opt.sched),
        "--decay-epochs", str(opt.decay_epochs), "--decay-rate", str(opt.decay_rate),
        "--warmup-epochs", str(round(opt.warmup_epochs)),
        "--warmup-lr", str(opt.warmup_lr), "--min-lr", str(opt.min_lr), "--epochs", str(train.epochs),
        "--seed", str(cfg.seed), "--log-interval", "1", "--output", str(out_dir),
    ]
    if opt.sched_on == "update":  # else timm steps it after each epoch, as the released main.py (without its lag)
        args += ["--sched-on-updates"]
    if opt.name.startswith("adam"):
        args += ["--opt-betas", *map(str, opt.betas)]
    else:
        args += ["--momentum", str(opt.momentum)]
    if kwargs:
        args += ["--model-kwargs", *(f"{key}={value}" for key, value in kwargs.items())]
    if train.ema:
        args += ["--model-ema", "--model-ema-decay", str(train.ema_decay)]
    if device.startswith("cuda") and train.amp != "fp32":
        # what our train.amp=auto/bf16 does on a GPU; fp16 takes timm's loss scaler there, as ours does
        args += ["--amp", "--amp-dtype", "float16" if train.amp == "fp16" else "bfloat16"]
    return args


def timm_command(timm_train: Path, overrides: list[str], data_dir: Path, out_dir: Path, workers: int,
                 device: str) -> list[str]:
    """The full command line of timm's train.py for the run of `overrides`."""
    return [sys.executable, str(timm_train), *timm_args(overrides, data_dir, out_dir, workers, device)]


def parse_step(line: str) -> dict[str, Any] | None:
    """One logged training step (timm logs every step with --log-interval 1), or None."""
    match = STEP_LINE.search(line)
    if match is None:
        return None
    epoch, index, total, step_s, data_s = match.groups()
    return {"epoch": int(epoch), "index": int(index), "per_epoch": int(total), "step_s": float(step_s),
            "data_s": float(data_s)}
