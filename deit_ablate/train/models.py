"""Models from timm by name, with DeiT's regularizers mapped onto timm's arguments."""

from __future__ import annotations

import re
import warnings
from typing import Any

import timm
import torch
from omegaconf import OmegaConf
from timm.layers import resample_abs_pos_embed
from timm.models import build_model_with_cfg, model_entrypoint
from timm.models.deit import VisionTransformerDistilled
from timm.models.mlp_mixer import MlpMixer
from torch import nn

from deit_ablate.config.schema import HeadKind, ModelConfig
from deit_ablate.core.errors import ConfigError
from deit_ablate.train.architecture import describe_architecture  # noqa: F401 (its name here, as before)
from deit_ablate.train.deeper import OPTIONS, _init_linear, apply_options, split_options
from deit_ablate.train.losses import TOKEN_KINDS

# vision_transformer_hybrid: timm's ViTs that read a ResNet's features (R50+ViT-B/16), a VisionTransformer too
_VIT_MODULES = ("vision_transformer", "vision_transformer_hybrid", "deit", "cait")
# MLP-Mixer (Tolstikhin et al. 2021, Table 1): timm's entry points fix patch size, depth and width by name
_MIXER = re.compile(r"mixer_([sbl])(\d+)_224")
_MIXER_SIZES = {"s": (8, 512), "b": (12, 768), "l": (24, 1024)}  # (num_blocks, embed_dim)


def is_vision_transformer(name: str) -> bool:
    """Whether timm builds `name` as a ViT (takes img_size, has position embeddings)."""
    return model_entrypoint(name).__module__.rsplit(".", 1)[-1] in _VIT_MODULES


def is_mixer(name: str) -> bool:
    """Whether `name` is one of timm's MLP-Mixers (`mixer_b16_224`, ...)."""
    return _MIXER.fullmatch(name) is not None


def build_mixer(name: str, pretrained: bool = False, **kwargs: Any) -> torch.nn.Module:
    """timm's Mixer `name` at the size its name says, or the one `kwargs` give (patch_size, num_blocks,
    embed_dim: timm's entry points refuse them), never with weights (`pretrained` must stay False)."""
    if pretrained:
        raise ValueError("build_mixer builds fresh Mixers only")
    size, patch = _MIXER.fullmatch(name).groups()
    blocks, width = _MIXER_SIZES[size]
    sizes = {"patch_size": int(patch), "num_blocks": blocks, "embed_dim": width, **kwargs}
    return build_model_with_cfg(MlpMixer, name, pretrained=False, **sizes)


def has_distillation_token(name: str) -> bool:
    """Whether timm's model `name` is a DeiT with a distillation token (the `*_distilled_*` models)."""
    return "_distilled_" in name


def model_family(name: str) -> str | None:
    """`vit` (timm's VisionTransformer without a distillation token), `cait` (timm's Cait), else None: which of
    the options of `deit_ablate.train.deeper` the model takes."""
    if not is_vision_transformer(name) or has_distillation_token(name):
        return None
    return "cait" if model_entrypoint(name).__module__.endswith(".cait") else "vit"


class RegisterDistilledViT(VisionTransformerDistilled):
    """timm's distilled ViT (DeiT section 5) with register tokens (Darcet et al. 2024, arXiv:2309.16588).

    timm's distilled ViT builds `reg_token` when given `reg_tokens` but never puts it in the sequence; here the
    tokens are [class, distillation, registers..., patches], so the heads still read rows 0 and 1 and every prefix
    token (registers included) has a position-embedding row, as in timm's ViT with registers."""

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        pos_embed = self.pos_embed
        if self.dynamic_img_size:
            pos_embed = resample_abs_pos_embed(pos_embed, new_size=x.shape[1:3], old_size=self.patch_embed.grid_size,
                                               num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens)
            x = x.view(batch, -1, x.shape[-1])
        prefix = [token.expand(batch, -1, -1) for token in (self.cls_token, self.dist_token, self.reg_token)]
        if self.no_embed_class:
            return self.pos_drop(torch.cat(prefix + [x + pos_embed], dim=1))
        return self.pos_drop(torch.cat(prefix + [x], dim=1) + pos_embed)


def with_registers(model: VisionTransformerDistilled) -> RegisterDistilledViT:
    """The distilled ViT `model`, built by timm with `reg_tokens`, made to use them (see RegisterDistilledViT).

    timm's entry points build their own class, so the model is re-classed in place: RegisterDistilledViT adds no
    module, it only puts the registers in the sequence, which needs one more position row per register."""
    model.__class__ = RegisterDistilledViT
    model.num_prefix_tokens = 2 + model.num_reg_tokens
    return fit_position_rows(model)


def fit_position_rows(model: VisionTransformerDistilled) -> VisionTransformerDistilled:
    """The distilled ViT `model` with one position-embedding row per patch, plus one per prefix token unless it
    was built with `no_embed_class` (DeiT III's layout: the prefix tokens get no position).

    timm's distilled ViT sizes its position embedding for the class and distillation tokens whatever
    `no_embed_class` says, and its forward then adds it to the patches alone; a wrong size is replaced by a fresh
    embedding, a right one kept."""
    rows = model.patch_embed.num_patches + (0 if model.no_embed_class else model.num_prefix_tokens)
    if model.pos_embed.shape[1] != rows:
        model.pos_embed = nn.Parameter(torch.zeros(1, rows, model.embed_dim, device=model.pos_embed.device))
        nn.init.trunc_normal_(model.pos_embed, std=0.02)  # as timm initialises a ViT's position embedding
    return model


def register_tokens(kwargs: dict[str, Any]) -> int:
    """The number of register tokens `model.kwargs` asks for (timm's `reg_tokens`; 0 when unset)."""
    return int(kwargs.get("reg_tokens") or 0)


def check_register_tokens(name: str, kwargs: dict[str, Any]) -> None:
    """`model.kwargs.reg_tokens`: a whole number >= 0, on a model whose token sequence takes registers."""
    count = kwargs.get("reg_tokens")
    if count is None:
        return
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ConfigError(f"model.kwargs.reg_tokens={count} must be a whole number >= 0 (Darcet et al. 2024: 0, 1, 4).")
    if count and model_family(name) != "vit" and not (is_vision_transformer(name) and has_distillation_token(name)):
        raise ConfigError(f"model.kwargs.reg_tokens={count}: register tokens exist for timm's ViT and DeiT (with or "
                          f"without distillation token), which {name} is not. Remove model.kwargs.reg_tokens or "
                          "choose such a model (model=vit_demo, model=deit_base, ...).")
    if count and kwargs.get("class_attn_depth"):
        raise ConfigError(f"model.kwargs.reg_tokens={count} with model.kwargs.class_attn_depth: the class-attention "
                          "stage reads patches only and takes no registers. Set one of them to 0.")


class MlpHead(nn.Module):
    """The original ViT's pre-training head (Dosovitskiy et al. 2021, section 3.1): a pre-logits layer, Linear d->d
    then tanh, before the linear classifier: logits = fc(tanh(pre_logits(x))), x the pooled (class token) feature.

    Both layers start as timm initialises a ViT's linear layers (truncated normal, std 0.02; biases 0). It sits in
    the model's `head`, so a transfer's load_backbone drops the pre-logits layer with the classifier."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.pre_logits = nn.Linear(dim, dim)
        self.act = nn.Tanh()
        self.fc = nn.Linear(dim, num_classes)
        self.apply(_init_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.pre_logits(x)))


def check_head(head: str, name: str) -> None:
    """`model.head`: the MLP head (mlp_tanh) only on timm's ViT without a distillation token."""
    if head == HeadKind.linear or model_family(name) == "vit":
        return
    if is_vision_transformer(name) and has_distillation_token(name):
        why = (f"{name} is a DeiT with a distillation token, whose class and distillation heads DeiT trains as "
               "single linear layers (distill=hard_token and soft_token train this twin)")
    else:
        why = f"{name} is not timm's ViT"
    raise ConfigError(f"model.head={head} is the original ViT's MLP head (a pre-logits layer, Linear then tanh, before "
                      f"the classifier), built for timm's ViT without a distillation token, and {why}. Set "
                      "model.head=linear, or train such a ViT (model=vit_base, model=deit_base, model=vit_demo with "
                      "distill=none, hard or soft).")


def build_model(model_cfg: ModelConfig, num_classes: int, img_size: int, name: str | None = None) -> torch.nn.Module:
    """A freshly initialised timm model (`name`, else model.name); never loads weights from a hub."""
    name = name or model_cfg.name
    kwargs = dict(OmegaConf.to_container(model_cfg.kwargs, resolve=True))
    options, kwargs = split_options(kwargs, model_family(name))
    head_drop = model_cfg.dropout
    if options["class_attn_depth"]:
        kwargs.update(class_token=False, global_pool="avg")  # the trunk of CaiT's class-attention model
    if is_vision_transformer(name):
        kwargs["img_size"] = img_size
        # DeiT's --drop went through timm 0.3.2's ViT: after the position embedding, in the attention projection
        # and in the MLP, never before the head. timm 1.0 names these pos_drop_rate and proj_drop_rate; its
        # drop_rate is a dropout before the head, which DeiT did not have.
        kwargs.update(pos_drop_rate=model_cfg.dropout, proj_drop_rate=model_cfg.dropout)
        head_drop = 0.0
    if is_mixer(name):  # its patch grid sizes the token-mixing MLPs; --drop goes in its MLPs, as in a ViT's
        kwargs.update(img_size=img_size, proj_drop_rate=model_cfg.dropout)
        head_drop = 0.0
    model = (build_mixer if is_mixer(name) else timm.create_model)(
        name,
        pretrained=False,
        num_classes=num_classes,
        drop_rate=head_drop,
        drop_path_rate=model_cfg.drop_path,
        **kwargs,
    )
    if isinstance(model, VisionTransformerDistilled):
        model = with_registers(model) if register_tokens(kwargs) else fit_position_rows(model)
    head = model_cfg.get("head", HeadKind.linear)
    check_head(head, name)
    if head == HeadKind.mlp_tanh:
        model.head = MlpHead(model.head.in_features, num_classes)
    if options == OPTIONS:
        return model
    return apply_options(model, options, model_cfg.drop_path, kwargs.get("init_values"))


def student_name(name: str, distilled_name: str | None, kind: str) -> str:
    """The timm model a run trains: model.name, or its distilled twin (model.distilled_name) for the token kinds.

    DeiT's Table 3 trains plain DeiT for no distillation and the class-token kinds, and DeiT⚗ (with a
    distillation token) for the token kinds; a distilled model given a class-token kind would train the average
    of its two heads (timm's forward), which no row of the paper does, so it is refused."""
    twin = distilled_name
    distilled = "_distilled_" in name
    if kind in TOKEN_KINDS:
        if distilled:
            return name
        if twin:
            return twin
        raise ConfigError(f"distill={kind} trains a distillation token, but model.name={name} has none and "
                          "model.distilled_name is unset. Use a DeiT model option (model=deit_base, "
                          "model=vit_demo, ...), whose distilled twin is picked for you, or distill=hard / "
                          "distill=soft.")
    if distilled:
        raise ConfigError(f"model.name={name} has a distillation token, which distill={kind} does not train: timm "
                          "would train the average of its two heads, and DeiT's Table 3 trains the plain model for "
                          "this row. Use the model without the token (model=vit_demo, model=deit_base, ... instead "
                          "of their _distilled options); distill=hard_token and distill=soft_token pick the "
                          "distilled twin themselves.")
    return name


def architecture(model: torch.nn.Module, name: str) -> dict[str, Any]:
    """What `model` is, read from its built modules: patch size, width, depth (+ class-attention blocks) and heads of
    a ViT or CaiT, and the parameter count of any model (all a CNN gets)."""
    model = getattr(model, "module", model)  # DDP
    arch: dict[str, Any] = {"name": name}
    patch_embed, blocks = getattr(model, "patch_embed", None), getattr(model, "blocks", None)
    if patch_embed is not None and blocks is not None and len(blocks) > 0:
        patch = tuple(patch_embed.patch_size)
        arch.update(patch_size=patch[0] if len(set(patch)) == 1 else list(patch), width=int(model.embed_dim),
                    depth=len(blocks))
        class_attn = getattr(model, "blocks_token_only", None)
        if class_attn is not None:
            arch["class_attn_depth"] = len(class_attn)
        arch["heads"] = int(blocks[0].attn.num_heads)
    arch["params"] = sum(p.numel() for p in model.parameters())
    return arch


def set_training_mode(model: torch.nn.Module, train: bool) -> None:
    """Train mode, or eval mode for training (DeiT's fine-tune: no drop path, no dropout) that keeps a
    distilled ViT returning both heads' logits."""
    model.train(train)
    module = getattr(model, "module", model)
    if not train and getattr(module, "distilled_training", False):
        # timm's distilled ViT returns (class, distillation) logits only when its own `training` flag is set;
        # set it on that one module, which no dropout or drop-path layer reads (they are its children).
        module.training = True


def compile_in_place(model: torch.nn.Module, backend: str = "inductor") -> bool:
    """torch.compile the model in place (state_dict keys unchanged); where it cannot, stay eager with a warning.
    `backend` is torch.compile's (the benchmarks' CPU dry run takes "aot_eager": the graph capture, no code generation).

    Returns whether compilation was set up."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a graph that fails to compile runs eagerly
    try:
        model.compile(backend=backend)
    except Exception as error:  # noqa: BLE001 - any backend failure means: train eagerly
        warnings.warn(f"runtime.compile: torch.compile is unavailable here ({error}); training eagerly.", stacklevel=2)
        return False
    return True


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
    # the position rows that are not patches (class/distillation/register tokens; none in CaiT, whose class token
    # enters late): kept as they are, only the grid is resized
    n_prefix = dst_shape[1] - model.patch_embed.num_patches
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
            f"grid; the checkpoint's prefix tokens (class/distillation/registers) differ from the "
            f"model's ({n_prefix}). Load a checkpoint of the same model family (distilled into distilled, the same "
            "model.kwargs.reg_tokens)."
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
