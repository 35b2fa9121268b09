"""Model options of CaiT's "going deeper" ablations (Touvron et al. 2021b) that timm's ViT lacks.

timm already has LayerScale (`init_values`), average pooling without a class token (`class_token=False,
global_pool='avg'`) and CaiT's class-attention blocks (`timm.models.cait`); this module adds the rest, applied to
a timm VisionTransformer after it is built: a uniform stochastic-depth rate (section 4.1), a ReZero-style scalar
per residual branch with LayerNorm and warm-up kept (section 4.1, "adapted" Fixup/T-Fixup), LayerScale
initialised at 0 or U[0, 2ε], or fixed, at ε or at the values another run learned (appendix A), talking-heads
attention in every block (section 4.3), and the class-attention stage on top of a ViT trunk (section 3). They are
read from `model.kwargs` under the names of `OPTIONS`, before timm sees the rest.
"""

from __future__ import annotations

import hashlib
import re
from functools import partial
from typing import Any

import torch
from timm.layers import Attention, DropPath, LayerScale
from timm.models.cait import Cait, ClassAttn, LayerScaleBlockClassAttn, TalkingHeadAttn
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from deit_ablate.core.errors import ConfigError

# Our options and their defaults (the default of each is timm's/DeiT's behaviour: no change).
OPTIONS: dict[str, Any] = {
    "drop_path_schedule": "linear",  # linear: timm/DeiT, linspace(0, p, depth); uniform: p in every block
    "branch_scale": "none",  # none; scalar: one learnable α per residual branch (ReZero-style, LN and warm-up kept)
    "branch_scale_init": 0.0,  # α at initialisation (ReZero: 0)
    "layer_scale_init": "const",  # LayerScale diagonal at init: const ε (timm), zero, uniform U[0, 2ε]
    "layer_scale_learned": True,  # False: the LayerScale diagonal stays at its initial values
    "layer_scale_from": None,  # a `cait` row: start from the diagonal its run learned (deit_ablate.run.stages)
    "talking_heads": False,  # True: talking-heads attention (heads mixed before and after the softmax)
    "class_attn_depth": 0,  # CaiT's class-attention stage: this many CA+FFN blocks after the trunk (0: none)
    "class_attn_layer_scale": True,  # False: no LayerScale in the class-attention blocks (CaiT appendix B)
}
# The options a timm CaiT (`Cait`, which has its own class attention, LayerScale and uniform drop path) takes.
CAIT_OPTIONS = ("class_attn_layer_scale",)
SCHEDULES = ("linear", "uniform")
BRANCH_SCALES = ("none", "scalar")
LAYER_SCALE_INITS = ("const", "zero", "uniform")
# timm's names of the LayerScale diagonals of a ViT's blocks (their attention and MLP branch).
LAYER_SCALE_KEY = re.compile(r"blocks\.(\d+)\.ls[12]\.gamma")


class ScalarScale(nn.Module):
    """One learnable scalar α multiplying a residual branch (ReZero, Bachlechner et al. 2020)."""

    def __init__(self, init: float = 0.0) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.alpha


class TalkingHeadsAttention(TalkingHeadAttn):
    """timm's talking-heads attention (Shazeer et al. 2020, as CaiT uses it) in place of a ViT block's `attn`,
    which timm's `Block` calls with a mask argument that this attention does not take."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("talking-heads attention takes no attention mask")
        return super().forward(x)


class ClassAttentionViT(nn.Module):
    """CaiT's two stages (section 3): a ViT trunk without class token, then CA+FFN blocks that update only the
    class embedding, which alone is normalised and classified. Parameter names follow timm's `Cait`."""

    def __init__(self, trunk: VisionTransformer, depth: int = 2, init_values: float | None = None,
                 learned: bool = True) -> None:
        super().__init__()
        if trunk.cls_token is not None:
            raise ValueError("the trunk of a class-attention model must be built without a class token")
        dim = trunk.embed_dim
        num_heads = trunk.blocks[0].attn.num_heads
        self.embed_dim = self.num_features = dim
        self.num_classes = trunk.num_classes
        self.num_prefix_tokens = 0  # pos_embed covers the patches only
        self.patch_embed, self.pos_embed, self.pos_drop = trunk.patch_embed, trunk.pos_embed, trunk.pos_drop
        self.norm_pre, self.blocks = trunk.norm_pre, trunk.blocks
        self.head_drop, self.head = trunk.head_drop, trunk.head
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        norm = type(trunk.blocks[0].norm1)
        eps = trunk.blocks[0].norm1.eps
        # timm's class-attention block always carries LayerScale; without it in the trunk its diagonal is a
        # fixed 1 (no LayerScale), with it the block's starts at the trunk's ε and is learned as the trunk's is.
        self.blocks_token_only = nn.ModuleList(
            LayerScaleBlockClassAttn(dim, num_heads, qkv_bias=True, norm_layer=partial(norm, eps=eps),
                                     attn_block=ClassAttn, init_values=init_values or 1.0)
            for _ in range(depth)
        )
        for block in self.blocks_token_only:
            block.apply(_init_linear)
        if not init_values:
            _without_layer_scale(self.blocks_token_only)
        elif not learned:
            for block in self.blocks_token_only:
                block.gamma_1.requires_grad_(False)
                block.gamma_2.requires_grad_(False)
        self.norm = norm(dim, eps=eps)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters kept out of weight decay, as timm's Cait keeps them."""
        return {"pos_embed", "cls_token"}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised class embedding after both stages."""
        x = self.norm_pre(self.pos_drop(self.patch_embed(x) + self.pos_embed))
        x = self.blocks(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        for block in self.blocks_token_only:
            cls = block(x, cls)  # the patches are read, never written
        return self.norm(cls)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_drop(self.forward_features(x)))

    def get_classifier(self) -> nn.Module:
        """The classification head, as timm's models name it (a transfer replaces it)."""
        return self.head


def _init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def split_options(kwargs: dict[str, Any], family: str | None = "vit") -> tuple[dict[str, Any], dict[str, Any]]:
    """`model.kwargs` as (our options with their defaults, the rest for timm); bad values are a ConfigError.

    `family`: `vit` (timm's VisionTransformer without a distillation token), `cait` (timm's Cait) or None."""
    ours = {key: kwargs.pop(key) for key in list(kwargs) if key in OPTIONS}
    options = {**OPTIONS, **ours}
    changed = [key for key in OPTIONS if options[key] != OPTIONS[key]]
    takes = set(OPTIONS) if family == "vit" else set(CAIT_OPTIONS) if family == "cait" else set()
    if [key for key in changed if key not in takes]:
        what = ", ".join(f"model.kwargs.{key}" for key in changed if key not in takes)
        raise ConfigError(f"{what}: options of timm's VisionTransformer without distillation token (DeiT, ViT; "
                          "class_attn_layer_scale also of timm's Cait), which this model is not. Remove them or "
                          "choose such a model.")
    for key, allowed in (("drop_path_schedule", SCHEDULES), ("branch_scale", BRANCH_SCALES),
                         ("layer_scale_init", LAYER_SCALE_INITS)):
        if options[key] not in allowed:
            raise ConfigError(f"model.kwargs.{key}={options[key]} is not one of {', '.join(allowed)}.")
    depth = options["class_attn_depth"]
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise ConfigError(f"model.kwargs.class_attn_depth={depth} must be a whole number >= 0 (CaiT: 2).")
    if options["branch_scale"] == "scalar" and kwargs.get("init_values"):
        raise ConfigError("model.kwargs.branch_scale=scalar and model.kwargs.init_values (LayerScale) both scale "
                          "the residual branches; choose one (set init_values to null for the scalar α).")
    source = options["layer_scale_from"]
    if (options["layer_scale_init"] != "const" or not options["layer_scale_learned"] or source) \
            and not kwargs.get("init_values"):
        raise ConfigError("model.kwargs.layer_scale_init / layer_scale_learned / layer_scale_from change LayerScale, "
                          "which is off: set model.kwargs.init_values (ε) too.")
    if source is not None and (not isinstance(source, str) or not source):
        raise ConfigError(f"model.kwargs.layer_scale_from={source} must name a row of the cait study whose run "
                          "learns LayerScale (e.g. depth18_layerscale), or be null.")
    if source and options["layer_scale_init"] != "const":
        raise ConfigError(f"model.kwargs.layer_scale_from={source} and model.kwargs.layer_scale_init="
                          f"{options['layer_scale_init']} both set the initial LayerScale diagonal; choose one.")
    if not isinstance(options["talking_heads"], bool):
        raise ConfigError(f"model.kwargs.talking_heads={options['talking_heads']} must be true or false.")
    return options, kwargs


def drop_path_rates(model: nn.Module) -> list[tuple[float, float]]:
    """Each block's stochastic-depth rates (attention branch, MLP branch); 0 where there is none."""
    def rate(module: nn.Module) -> float:
        return module.drop_prob if isinstance(module, DropPath) else 0.0

    return [(rate(block.drop_path1), rate(block.drop_path2)) for block in model.blocks]


def apply_options(model: VisionTransformer, options: dict[str, Any], drop_path: float,
                  init_values: float | None) -> nn.Module:
    """The timm ViT `model` with our options applied (the model itself, or the class-attention model around it);
    for a timm Cait, only whether its class-attention blocks keep LayerScale."""
    if isinstance(model, Cait):
        if not options["class_attn_layer_scale"]:
            _without_layer_scale(model.blocks_token_only)
        return model
    if options["drop_path_schedule"] == "uniform":
        for block in model.blocks:  # section 4.1: the same rate d_r in every block
            block.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
            block.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
    if options["branch_scale"] == "scalar":
        for block in model.blocks:
            block.ls1 = ScalarScale(options["branch_scale_init"])
            block.ls2 = ScalarScale(options["branch_scale_init"])
    if options["talking_heads"]:
        for block in model.blocks:
            block.attn = talking_heads_like(block.attn)
    if init_values:
        for block in model.blocks:
            for layer_scale in (block.ls1, block.ls2):
                if not isinstance(layer_scale, LayerScale):
                    raise ConfigError(f"model.kwargs.init_values={init_values}: this model's blocks have no "
                                      "LayerScale to initialise.")
                if options["layer_scale_init"] == "zero":  # appendix A: like ReZero, but per channel
                    nn.init.zeros_(layer_scale.gamma)
                elif options["layer_scale_init"] == "uniform":  # appendix A: U[0, 2ε], the same mean as ε
                    nn.init.uniform_(layer_scale.gamma, 0.0, 2 * init_values)
                layer_scale.gamma.requires_grad_(bool(options["layer_scale_learned"]))
    if options["class_attn_depth"]:
        ca_init = init_values if options["class_attn_layer_scale"] else None
        return ClassAttentionViT(model, options["class_attn_depth"], ca_init, bool(options["layer_scale_learned"]))
    return model


def talking_heads_like(attn: nn.Module) -> TalkingHeadsAttention:
    """A freshly initialised talking-heads attention with the width, heads, qkv bias and dropout of timm's `attn`."""
    plain = isinstance(attn, Attention) and attn.attn_dim == attn.qkv.in_features
    extras = [getattr(attn, name, None) for name in ("q_norm", "k_norm", "norm", "gate")]
    if not plain or not all(extra is None or isinstance(extra, nn.Identity) for extra in extras):
        raise ConfigError("model.kwargs.talking_heads: this model's attention is not timm's plain multi-head attention "
                          "(no qk_norm, scale_norm or gate; head width = width / heads), which talking heads replace.")
    heads = TalkingHeadsAttention(attn.qkv.in_features, attn.num_heads, qkv_bias=attn.qkv.bias is not None,
                                  attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p)
    heads.apply(_init_linear)  # as timm's Cait initialises every linear layer, the head-mixing ones included
    return heads


def layer_scale_values(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LayerScale diagonals among a ViT's weights (timm's `blocks.N.ls1.gamma`, `blocks.N.ls2.gamma`)."""
    return {key: value for key, value in weights.items() if LAYER_SCALE_KEY.fullmatch(key)}


def layer_scale_digest(values: dict[str, torch.Tensor]) -> str:
    """A short hash of LayerScale diagonals, by name and value: which values a run fixed."""
    digest = hashlib.sha1()
    for key in sorted(values):
        digest.update(key.encode())
        digest.update(values[key].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _describe_layer_scale(values: dict[str, torch.Tensor]) -> str:
    blocks = {int(LAYER_SCALE_KEY.fullmatch(key)[1]) for key in values}
    widths = sorted({value.shape[-1] for value in values.values()})
    return f"{len(blocks)} blocks of width {', '.join(map(str, widths))}"


def set_layer_scale(model: nn.Module, values: dict[str, torch.Tensor], source: str) -> None:
    """Copy the LayerScale diagonals `values` (those of a model of the same depth and width, read from `source`)
    into `model`'s, leaving whether they are learned as it is."""
    own = layer_scale_values(dict(model.named_parameters()))
    if not values:
        raise ConfigError(f"{source} holds no LayerScale diagonals of a ViT's blocks (blocks.N.ls1.gamma): its model "
                          "had no LayerScale (model.kwargs.init_values unset) or was no ViT. Name a run that learns "
                          "LayerScale, e.g. depth18_layerscale.")
    if not own:
        raise ConfigError("model.kwargs.layer_scale_from: this model has no LayerScale diagonals to set.")
    if {k: v.shape for k, v in values.items()} != {k: v.shape for k, v in own.items()}:
        raise ConfigError(f"{source} holds LayerScale diagonals of {_describe_layer_scale(values)}, this model has "
                          f"{_describe_layer_scale(own)}: it is another architecture. Name a run of the same depth "
                          "and width (model.kwargs.depth, model.kwargs.embed_dim).")
    with torch.no_grad():
        for key, gamma in own.items():
            gamma.copy_(values[key])


def _without_layer_scale(blocks: nn.ModuleList) -> None:
    """Class-attention blocks without LayerScale: timm's diagonal fixed at 1."""
    for block in blocks:
        for gamma in (block.gamma_1, block.gamma_2):
            nn.init.ones_(gamma)
            gamma.requires_grad_(False)
