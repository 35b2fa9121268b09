"""The built-in dataset: procedurally drawn shapes, written once as an ImageFolder tree (train/ and val/)."""

from __future__ import annotations

import colorsys
import json
import math
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from deit_ablate.atomic import atomic_folder

CLASSES = (
    "disc", "ring", "square", "triangle", "plus", "cross", "stripes", "checker", "diamond", "crescent",
)
_SUPERSAMPLE = 4
_MARKER = "COMPLETE.json"


def _polygon(cx: float, cy: float, radius: float, sides: int, angle: float) -> list[tuple[float, float]]:
    angles = [angle + 2 * math.pi * k / sides for k in range(sides)]
    return [(cx + radius * math.cos(a), cy + radius * math.sin(a)) for a in angles]


def _draw_shape(draw: ImageDraw.ImageDraw, label: int, cx: float, cy: float, r: float, angle: float,
                color: tuple[int, int, int], background: tuple[int, int, int]) -> None:
    """Draw class `label` centred at (cx, cy) with radius r, in supersampled pixel units."""
    name = CLASSES[label]
    box = (cx - r, cy - r, cx + r, cy + r)
    if name == "disc":
        draw.ellipse(box, fill=color)
    elif name == "ring":
        draw.ellipse(box, fill=color)
        inner = 0.55 * r
        draw.ellipse((cx - inner, cy - inner, cx + inner, cy + inner), fill=background)
    elif name == "square":
        draw.polygon(_polygon(cx, cy, r, 4, angle + math.pi / 4), fill=color)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, r, 3, angle - math.pi / 2), fill=color)
    elif name in ("plus", "cross"):
        tilt = angle + (math.pi / 4 if name == "cross" else 0.0)
        for arm in (tilt, tilt + math.pi / 2):
            dx, dy = math.cos(arm), math.sin(arm)
            px, py = -dy * 0.22 * r, dx * 0.22 * r
            draw.polygon([(cx - dx * r + px, cy - dy * r + py), (cx + dx * r + px, cy + dy * r + py),
                          (cx + dx * r - px, cy + dy * r - py), (cx - dx * r - px, cy - dy * r - py)], fill=color)
    elif name == "stripes":
        for k in range(-2, 3):
            off = k * 0.42 * r
            dx, dy = math.cos(angle + math.pi / 2), math.sin(angle + math.pi / 2)
            ox, oy = cx + off * math.cos(angle), cy + off * math.sin(angle)
            w = 0.1 * r
            draw.polygon([(ox - dx * r - dy * w, oy - dy * r + dx * w), (ox + dx * r - dy * w, oy + dy * r + dx * w),
                          (ox + dx * r + dy * w, oy + dy * r - dx * w), (ox - dx * r + dy * w, oy - dy * r - dx * w)],
                         fill=color)
    elif name == "checker":
        cell = 2 * r / 4
        for i in range(4):
            for j in range(4):
                if (i + j) % 2 == 0:
                    x0, y0 = cx - r + i * cell, cy - r + j * cell
                    draw.rectangle((x0, y0, x0 + cell, y0 + cell), fill=color)
    elif name == "diamond":
        draw.polygon([(cx, cy - r), (cx + 0.55 * r, cy), (cx, cy + r), (cx - 0.55 * r, cy)], fill=color)
    elif name == "crescent":
        draw.ellipse(box, fill=color)
        shift = 0.45 * r
        draw.ellipse((cx - r + shift * math.cos(angle), cy - r + shift * math.sin(angle),
                      cx + r + shift * math.cos(angle), cy + r + shift * math.sin(angle)), fill=background)


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[int, int, int]:
    return tuple(int(255 * c) for c in colorsys.hsv_to_rgb(h, s, v))


def draw_image(label: int, size: int, rng: np.random.Generator) -> Image.Image:
    """One image of class `label`: a shape with random position, size, angle and colours on a noisy ground."""
    big = size * _SUPERSAMPLE
    # The shape carries a hue near its class's own (a weak cue: neighbouring classes overlap), on a greyish
    # ground; shape is what separates the classes, colour is what lets a tiny model start learning early.
    hue = (label / len(CLASSES) + rng.normal(0, 0.06)) % 1.0
    color = _hsv_to_rgb(hue, rng.uniform(0.55, 1.0), rng.uniform(0.6, 1.0))
    grey = rng.uniform(0.05, 0.45) if rng.random() < 0.5 else rng.uniform(0.75, 0.95)
    background = _hsv_to_rgb(rng.random(), rng.uniform(0.0, 0.25), grey)
    image = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(image)
    r = big * rng.uniform(0.22, 0.4)
    cx, cy = rng.uniform(r, big - r, 2)
    # Small tilts only: a plus turned by 45 degrees is a cross. The crescent may open any way.
    angle = rng.uniform(0, 2 * math.pi) if CLASSES[label] == "crescent" else rng.uniform(-0.3, 0.3)
    _draw_shape(draw, label, cx, cy, r, angle, color, background)
    image = image.resize((size, size), Image.BILINEAR).filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.6)))
    noise = rng.normal(0, rng.uniform(4, 20), (size, size, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _spec(image_size: int, train_per_class: int, val_per_class: int, seed: int) -> dict:
    return {"version": 2, "classes": list(CLASSES), "image_size": image_size,
            "train_per_class": train_per_class, "val_per_class": val_per_class, "seed": seed}


def _write_split(root: Path, split: str, per_class: int, image_size: int, seed: int) -> None:
    for label, name in enumerate(CLASSES):
        folder = root / split / name
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, label, 0 if split == "train" else 1])
        for index in range(per_class):
            draw_image(label, image_size, rng).save(folder / f"{index:05d}.png", optimize=False)


def ensure_builtin_dataset(root: str | os.PathLike, image_size: int = 40, train_per_class: int = 500,
                           val_per_class: int = 100, seed: int = 0) -> Path:
    """Return the dataset folder, drawing it first if it is absent, incomplete or drawn with other settings."""
    spec = _spec(image_size, train_per_class, val_per_class, seed)
    tag = f"s{image_size}-n{train_per_class}-{val_per_class}-seed{seed}"
    target = Path(root).expanduser().resolve() / tag
    marker = target / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return target
    start = time.perf_counter()
    print(f"[data] drawing the built-in dataset into {target} ({len(CLASSES)} classes, "
          f"{train_per_class}+{val_per_class} images per class) ...", flush=True)

    def fill(staging: Path) -> None:
        _write_split(staging, "train", train_per_class, image_size, seed)
        _write_split(staging, "val", val_per_class, image_size, seed)
        (staging / _MARKER).write_text(json.dumps(spec))

    atomic_folder(target, fill, complete=lambda: marker.exists() and json.loads(marker.read_text()) == spec)
    print(f"[data] built-in dataset ready in {time.perf_counter() - start:.1f}s", flush=True)
    return target
