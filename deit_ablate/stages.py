"""The two stages of Table 8: pre-training from scratch, then fine-tuning at a higher resolution."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from deit_ablate import checkpoint as ckpt
from deit_ablate.config import compose_run_config
from deit_ablate.errors import ConfigError
from deit_ablate.identity import folder_name, pretrain_overrides, run_identity, task_overrides
from deit_ablate.models import resize_pos_embed_state
from deit_ablate.rundir import RunDir


@dataclass(frozen=True)
class StageRecipe:
    """The batch, optimizer settings and length of this stage, and the weights it starts from."""

    global_batch: int
    optimizer: str
    lr: float  # per lr_base_batch images
    weight_decay: float
    epochs: int
    warmup_epochs: float
    warmup_lr: float
    min_lr: float
    train_mode: bool = True  # False: the model stays in eval mode while it trains (DeiT's fine-tune)
    init_checkpoint: Path | None = None


def stage_global_batch(cfg: DictConfig) -> tuple[int, str]:
    """This stage's global batch and the key that sets it (finetune.global_batch, else train.global_batch)."""
    if cfg.stage == "finetune" and cfg.finetune.global_batch is not None:
        return cfg.finetune.global_batch, "finetune.global_batch"
    return cfg.train.global_batch, "train.global_batch"


def pretrain_run_dir(cfg: DictConfig) -> RunDir:
    """The folder of the pre-training run this fine-tune stage starts from: the run of the same overrides without
    the stage, resolution and finetune.* ones (which never change a pre-training), composed as Hydra would."""
    overrides = pretrain_overrides(task_overrides())
    upstream = compose_run_config(overrides)
    runs_root = Path(cfg.runtime.output_root) / "runs"
    return RunDir(runs_root / folder_name(run_identity(upstream, overrides), runs_root))


def pretrain_status(cfg: DictConfig) -> str:
    """How the pre-training run ended ("finished", "diverged", ...); a ConfigError if it has not."""
    if cfg.finetune.init_checkpoint:
        path = Path(cfg.finetune.init_checkpoint).expanduser()
        if not path.is_file():
            raise ConfigError(f"finetune.init_checkpoint={path} does not exist. Point it at a checkpoint written "
                              "by a pre-training run (outputs/runs/<run>/checkpoint-last.pt).")
        return "finished"
    upstream = pretrain_run_dir(cfg)
    result = upstream.read_result()
    if result is None:
        raise ConfigError(
            f"stage=finetune starts from the pre-training run '{upstream.name}', which has not finished "
            f"({upstream.result} is missing). Run the pre-training first (the same command without stage=finetune), "
            "sweep both stages in one command (stage=pretrain,finetune, pre-training listed first), or set "
            "finetune.init_checkpoint=/path/to/checkpoint.pt."
        )
    return result["status"]


def pretrain_checkpoint(cfg: DictConfig) -> Path:
    """The weights a fine-tune stage starts from: finetune.init_checkpoint, else its pre-training's last."""
    if cfg.finetune.init_checkpoint:
        return Path(cfg.finetune.init_checkpoint).expanduser()
    return pretrain_run_dir(cfg).last_checkpoint


def stage_recipe(cfg: DictConfig) -> StageRecipe:
    """Pre-training uses `optimizer`/`train`; fine-tuning the `finetune` block (Table 8, second column)."""
    global_batch, _ = stage_global_batch(cfg)
    if cfg.stage == "pretrain":
        opt = cfg.optimizer
        return StageRecipe(global_batch, opt.name, opt.lr, opt.weight_decay, cfg.train.epochs, opt.warmup_epochs,
                           opt.warmup_lr, opt.min_lr)
    ft = cfg.finetune
    return StageRecipe(global_batch, ft.optimizer, ft.lr, ft.weight_decay, ft.epochs, ft.warmup_epochs,
                       ft.warmup_lr, ft.min_lr, train_mode=ft.train_mode, init_checkpoint=pretrain_checkpoint(cfg))


def pretrained_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights a pre-training run ended with: its EMA's when it kept one (the `ema` row's result)."""
    source = f"The pre-trained checkpoint {path}"
    if Path(path).suffix == ".safetensors":
        return ckpt.read_weights(path, source=source)
    state = ckpt.load(path, source)  # read once: a paper-scale checkpoint is about a gigabyte
    if isinstance(state, dict) and isinstance(state.get("ema"), dict):
        state = {"model": state["ema"]}
    return ckpt.extract_state_dict(state, source=source)


def load_pretrained(model: torch.nn.Module, path: str | Path) -> None:
    """Load pre-trained weights into `model`, resizing the position embeddings to its grid."""
    model.load_state_dict(resize_pos_embed_state(pretrained_weights(path), model))
