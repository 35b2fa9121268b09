"""Models from timm by name, with DeiT's regularizers mapped onto timm's arguments."""

from __future__ import annotations

import warnings

import timm
import torch
from omegaconf import DictConfig, OmegaConf
from timm.layers import resample_abs_pos_embed
from timm.models import model_entrypoint

_VIT_MODULES = ("vision_transformer", "deit", "cait")


def is_vision_transformer(name: str) -> bool:
    """Whether timm builds `name` as a ViT (takes img_size, has position embeddings)."""
    return model_entrypoint(name).__module__.rsplit(".", 1)[-1] in _VIT_MODULES


def has_distillation_token(name: str) -> bool:
    """Whether timm's model `name` is a DeiT with a distillation token (the `*_distilled_*` models)."""
    return "_distilled_" in name


def build_model(model_cfg: DictConfig, num_classes: int, img_size: int, name: str | None = None) -> torch.nn.Module:
    """A freshly initialised timm model (`name`, else model.name); never loads weights from a hub."""
    name = name or model_cfg.name
    kwargs = dict(OmegaConf.to_container(model_cfg.kwargs, resolve=True))
    head_drop = model_cfg.dropout
    if is_vision_transformer(name):
        kwargs["img_size"] = img_size
        # DeiT's --drop went through timm 0.3.2's ViT: after the position embedding, in the attention projection
        # and in the MLP, never before the head. timm 1.0 names these pos_drop_rate and proj_drop_rate; its
        # drop_rate is a dropout before the head, which DeiT did not have.
        kwargs.update(pos_drop_rate=model_cfg.dropout, proj_drop_rate=model_cfg.dropout)
        head_drop = 0.0
    return timm.create_model(
        name,
        pretrained=False,
        num_classes=num_classes,
        drop_rate=head_drop,
        drop_path_rate=model_cfg.drop_path,
        **kwargs,
    )


def set_training_mode(model: torch.nn.Module, train: bool) -> None:
    """Train mode, or eval mode for training (DeiT's fine-tune: no drop path, no dropout) that keeps a
    distilled ViT returning both heads' logits."""
    model.train(train)
    module = getattr(model, "module", model)
    if not train and getattr(module, "distilled_training", False):
        # timm's distilled ViT returns (class, distillation) logits only when its own `training` flag is set;
        # set it on that one module, which no dropout or drop-path layer reads (they are its children).
        module.training = True


def compile_in_place(model: torch.nn.Module) -> bool:
    """torch.compile the model in place (state_dict keys unchanged); where it cannot, stay eager with a warning.

    Returns whether compilation was set up."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a graph that fails to compile runs eagerly
    try:
        model.compile()
    except Exception as error:  # noqa: BLE001 - any backend failure means: train eagerly
        warnings.warn(f"train.compile: torch.compile is unavailable here ({error}); training eagerly.", stacklevel=2)
        return False
    return True


def drop_path_rates(model: torch.nn.Module) -> list[float]:
    """The stochastic-depth rate of each residual block, in order (0 where a block has none)."""
    rates = []
    for block in getattr(model, "blocks", []):
        drop = getattr(block, "drop_path1", None)
        rates.append(float(getattr(drop, "drop_prob", 0.0)))
    return rates


def resize_pos_embed_state(
    state_dict: dict[str, torch.Tensor], model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Copy of ``state_dict`` with ``pos_embed`` fitted to ``model`` (prefix rows kept, grid bicubic)."""
    out = dict(state_dict)
    if "pos_embed" not in out or not hasattr(model, "pos_embed"):
        return out
    src = out["pos_embed"]
    dst_shape = model.pos_embed.shape
    if src.shape == dst_shape:
        return out
    n_prefix = 0 if getattr(model, "no_embed_class", False) else int(getattr(model, "num_prefix_tokens", 1))
    if src.ndim != 3 or src.shape[-1] != dst_shape[-1]:
        raise ValueError(
            f"pos_embed of shape {tuple(src.shape)} cannot be resized to {tuple(dst_shape)}: the embedding "
            "width differs, so the checkpoint is from another architecture."
        )
    old_patches = src.shape[1] - n_prefix
    side = int(round(old_patches**0.5))
    if old_patches <= 0 or side * side != old_patches:
        raise ValueError(
            f"pos_embed has {src.shape[1]} rows, which is not {n_prefix} prefix rows plus a square patch "
            f"grid; the checkpoint's prefix tokens (class/distillation) differ from the model's "
            f"({n_prefix}). Load a checkpoint of the same model family (distilled into distilled)."
        )
    new_grid = list(model.patch_embed.grid_size)
    out["pos_embed"] = resample_abs_pos_embed(
        src,
        new_size=new_grid,
        old_size=[side, side],
        num_prefix_tokens=n_prefix,
        interpolation="bicubic",
        antialias=False,  # plain bicubic, as in the released DeiT fine-tuning code (timm defaults to True)
        align_corners=False,
    )
    return out
