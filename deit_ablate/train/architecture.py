"""A model as built, in words: read by the trainer's start line and by the aggregator's reports (no torch needed)."""

from __future__ import annotations

from typing import Any


def describe_architecture(arch: dict[str, Any]) -> str:
    """`deit_tiny_patch16_224 (patch 2, width 64, depth 4, heads 2, 0.21 M params)`; a CNN: its parameters."""
    parts = []
    if "width" in arch:
        class_attn = f" + {arch['class_attn_depth']} class-attention" if "class_attn_depth" in arch else ""
        parts += [f"patch {arch['patch_size']}", f"width {arch['width']}", f"depth {arch['depth']}{class_attn}",
                  f"heads {arch['heads']}"]
    parts.append(f"{arch['params'] / 1e6:.2f} M params")
    return f"{arch['name']} ({', '.join(parts)})"
