"""The two stages of Table 8: pre-training from scratch, then fine-tuning at a higher resolution."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from deit_ablate import checkpoint as ckpt
from deit_ablate.errors import ConfigError
from deit_ablate.identity import current_override_dirname, pretrain_run_name
from deit_ablate.models import resize_pos_embed_state


@dataclass(frozen=True)
class StageRecipe:
    """The optimizer settings and length of this stage, and the weights it starts from."""

    optimizer: str
    lr: float  # per lr_base_batch images
    weight_decay: float
    epochs: int
    warmup_epochs: float
    min_lr: float
    init_checkpoint: Path | None = None


def pretrain_checkpoint(cfg: DictConfig) -> Path:
    """The finished pre-training checkpoint of this run's own row and seed (or finetune.init_checkpoint)."""
    if cfg.finetune.init_checkpoint:
        path = Path(cfg.finetune.init_checkpoint).expanduser()
        if not path.is_file():
            raise ConfigError(f"finetune.init_checkpoint={path} does not exist. Point it at a checkpoint written by "
                              "a pre-training run (outputs/runs/<run>/checkpoint-last.pt).")
        return path
    name = pretrain_run_name(current_override_dirname())
    run_dir = Path(cfg.output_root) / "runs" / name
    result = run_dir / "result.json"
    if not result.exists():
        raise ConfigError(
            f"stage=finetune starts from the pre-training run '{name}', which has not finished "
            f"({result} is missing). Run the pre-training first (the same command without stage=finetune), "
            "sweep both stages in one command (stage=pretrain,finetune, pre-training listed first), or set "
            "finetune.init_checkpoint=/path/to/checkpoint.pt."
        )
    status = json.loads(result.read_text())["status"]
    if status != "finished":
        raise ConfigError(f"the pre-training run '{name}' ended as '{status}'; there is no model to fine-tune. "
                          "Fine-tuning is skipped for it (Table 8 shows such rows as did-not-train).")
    return run_dir / "checkpoint-last.pt"


def stage_recipe(cfg: DictConfig) -> StageRecipe:
    """Pre-training uses `optimizer`/`train`; fine-tuning the `finetune` block (Table 8, second column)."""
    if cfg.stage == "pretrain":
        opt = cfg.optimizer
        return StageRecipe(opt.name, opt.lr, opt.weight_decay, cfg.train.epochs, opt.warmup_epochs, opt.min_lr)
    ft = cfg.finetune
    return StageRecipe(ft.optimizer or cfg.optimizer.name, ft.lr, ft.weight_decay, ft.epochs, ft.warmup_epochs,
                       ft.min_lr, init_checkpoint=pretrain_checkpoint(cfg))


def load_pretrained(model: torch.nn.Module, path: str | Path) -> None:
    """Load pre-trained weights into `model`, resizing the position embeddings to its grid."""
    state = resize_pos_embed_state(ckpt.model_state(ckpt.load(path)), model)
    model.load_state_dict(state)
