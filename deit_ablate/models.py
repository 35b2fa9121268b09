"""Models from timm by name, with DeiT's regularizers mapped onto timm's arguments."""

from __future__ import annotations

import timm
import torch
from omegaconf import DictConfig, OmegaConf
from timm.layers import resample_abs_pos_embed
from timm.models import model_entrypoint

_VIT_MODULES = ("vision_transformer", "deit", "cait")


def is_vision_transformer(name: str) -> bool:
    """Whether timm builds `name` as a ViT (takes img_size, has position embeddings)."""
    return model_entrypoint(name).__module__.rsplit(".", 1)[-1] in _VIT_MODULES


def build_model(model_cfg: DictConfig, num_classes: int, img_size: int) -> torch.nn.Module:
    """A freshly initialised timm model; never loads weights from a hub."""
    kwargs = dict(OmegaConf.to_container(model_cfg.kwargs, resolve=True))
    if is_vision_transformer(model_cfg.name):
        kwargs["img_size"] = img_size
        # DeiT's "dropout" (timm 0.3, Table 8) dropped after the position embedding, attention projection and
        # MLP; timm 1.0 splits that into three rates.
        kwargs.update(pos_drop_rate=model_cfg.dropout, proj_drop_rate=model_cfg.dropout)
    return timm.create_model(
        model_cfg.name,
        pretrained=False,
        num_classes=num_classes,
        drop_rate=model_cfg.dropout,
        drop_path_rate=model_cfg.drop_path,
        **kwargs,
    )


def drop_path_rates(model: torch.nn.Module) -> list[float]:
    """The stochastic-depth rate of each residual block, in order (0 where a block has none)."""
    rates = []
    for block in getattr(model, "blocks", []):
        drop = getattr(block, "drop_path1", None)
        rates.append(float(getattr(drop, "drop_prob", 0.0)))
    return rates


def resize_pos_embed_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Resample a checkpoint's position table bicubically to `model`'s patch grid; prefix-token rows are kept."""
    if "pos_embed" not in state or not hasattr(model, "pos_embed"):
        return state
    old, target = state["pos_embed"], model.pos_embed
    if old.shape == target.shape:
        return state
    prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
    grid = model.patch_embed.grid_size
    return {**state, "pos_embed": resample_abs_pos_embed(old, new_size=list(grid), num_prefix_tokens=prefix,
                                                         interpolation="bicubic", antialias=True)}
