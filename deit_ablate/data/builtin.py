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

from deit_ablate.core.atomic import atomic_folder

CLASSES = (
    "disc", "ring", "square", "triangle", "plus", "cross", "stripes", "checker", "diamond", "crescent",
)
# A second set of 10 shapes, none of them in the first: the data the demo's transfer stage (DeiT Table 7) moves to.
CLASSES_B = (
    "star", "hexagon", "arrow", "heart", "ellipse", "frame", "chevron", "hourglass", "half_disc", "dots",
)
CLASS_SETS = {"shapes": CLASSES, "shapes_b": CLASSES_B}
DEFAULT_CLASS_SET = "shapes"
_SUPERSAMPLE = 4
_MARKER = "COMPLETE.json"


def _polygon(cx: float, cy: float, radius: float, sides: int, angle: float) -> list[tuple[float, float]]:
    angles = [angle + 2 * math.pi * k / sides for k in range(sides)]
    return [(cx + radius * math.cos(a), cy + radius * math.sin(a)) for a in angles]


def class_names_of(class_set: str) -> tuple[str, ...]:
    """The shapes of a class set (`shapes` or `shapes_b`); a ValueError naming the sets for any other name."""
    if class_set not in CLASS_SETS:
        raise ValueError(f"data.builtin.classes={class_set} is not a built-in class set; use one of "
                         f"{', '.join(CLASS_SETS)}.")
    return CLASS_SETS[class_set]


def _draw_shape(draw: ImageDraw.ImageDraw, name: str, cx: float, cy: float, r: float, angle: float,
                color: tuple[int, int, int], background: tuple[int, int, int]) -> None:
    """Draw the shape `name` centred at (cx, cy) with radius r, in supersampled pixel units."""
    if name in CLASSES_B:
        _draw_shape_b(draw, name, cx, cy, r, angle, color, background)
        return
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


def _rotated(points: list[tuple[float, float]], cx: float, cy: float, angle: float) -> list[tuple[float, float]]:
    """`points` given relative to (cx, cy) in units of 1, turned by `angle` and moved there."""
    cos, sin = math.cos(angle), math.sin(angle)
    return [(cx + x * cos - y * sin, cy + x * sin + y * cos) for x, y in points]


def _draw_shape_b(draw: ImageDraw.ImageDraw, name: str, cx: float, cy: float, r: float, angle: float,
                  color: tuple[int, int, int], background: tuple[int, int, int]) -> None:
    """Draw one shape of the second class set (CLASSES_B)."""
    box = (cx - r, cy - r, cx + r, cy + r)
    if name == "star":
        points = [(cx + (r if k % 2 == 0 else 0.4 * r) * math.cos(angle - math.pi / 2 + k * math.pi / 5),
                   cy + (r if k % 2 == 0 else 0.4 * r) * math.sin(angle - math.pi / 2 + k * math.pi / 5))
                  for k in range(10)]
        draw.polygon(points, fill=color)
    elif name == "hexagon":
        draw.polygon(_polygon(cx, cy, r, 6, angle), fill=color)
    elif name == "arrow":
        shape = [(-1, -0.2), (0.2, -0.2), (0.2, -0.6), (1, 0), (0.2, 0.6), (0.2, 0.2), (-1, 0.2)]
        draw.polygon(_rotated([(x * r, y * r) for x, y in shape], cx, cy, angle), fill=color)
    elif name == "heart":
        lobe = 0.5 * r
        for side in (-1, 1):
            draw.ellipse((cx + side * lobe - lobe, cy - 0.5 * r - lobe * 0.6, cx + side * lobe + lobe,
                          cy - 0.5 * r + lobe * 1.4), fill=color)
        draw.polygon([(cx - r, cy - 0.25 * r), (cx + r, cy - 0.25 * r), (cx, cy + r)], fill=color)
    elif name == "ellipse":
        draw.ellipse((cx - r, cy - 0.45 * r, cx + r, cy + 0.45 * r), fill=color)
    elif name == "frame":
        draw.polygon(_polygon(cx, cy, r, 4, angle + math.pi / 4), fill=color)
        draw.polygon(_polygon(cx, cy, 0.6 * r, 4, angle + math.pi / 4), fill=background)
    elif name == "chevron":
        shape = [(-0.8, -0.9), (-0.2, -0.9), (0.8, 0), (-0.2, 0.9), (-0.8, 0.9), (0.2, 0)]
        draw.polygon(_rotated([(x * r, y * r) for x, y in shape], cx, cy, angle), fill=color)
    elif name == "hourglass":
        shape = [(-0.8, -1), (0.8, -1), (0, 0), (0.8, 1), (-0.8, 1), (0, 0)]
        draw.polygon(_rotated([(x * r, y * r) for x, y in shape], cx, cy, angle), fill=color)
    elif name == "half_disc":
        degrees = math.degrees(angle)
        draw.pieslice(box, 180 + degrees, 360 + degrees, fill=color)
    elif name == "dots":
        for dx in (-0.55, 0.55):
            for dy in (-0.55, 0.55):
                x, y = cx + dx * r, cy + dy * r
                draw.ellipse((x - 0.3 * r, y - 0.3 * r, x + 0.3 * r, y + 0.3 * r), fill=color)


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[int, int, int]:
    return tuple(int(255 * c) for c in colorsys.hsv_to_rgb(h, s, v))


def draw_image(label: int, size: int, rng: np.random.Generator, classes: tuple[str, ...] = CLASSES) -> Image.Image:
    """One image of class `label` of `classes`: a shape with random position, size, angle and colours on a noisy
    ground."""
    big = size * _SUPERSAMPLE
    # The shape carries a hue near its class's own (a weak cue: neighbouring classes overlap), on a greyish
    # ground; shape is what separates the classes, colour is what lets a tiny model start learning early.
    hue = (label / len(classes) + rng.normal(0, 0.06)) % 1.0
    color = _hsv_to_rgb(hue, rng.uniform(0.55, 1.0), rng.uniform(0.6, 1.0))
    grey = rng.uniform(0.05, 0.45) if rng.random() < 0.5 else rng.uniform(0.75, 0.95)
    background = _hsv_to_rgb(rng.random(), rng.uniform(0.0, 0.25), grey)
    image = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(image)
    r = big * rng.uniform(0.22, 0.4)
    cx, cy = rng.uniform(r, big - r, 2)
    # Small tilts only: a plus turned by 45 degrees is a cross. The crescent may open any way.
    angle = rng.uniform(0, 2 * math.pi) if classes[label] == "crescent" else rng.uniform(-0.3, 0.3)
    _draw_shape(draw, classes[label], cx, cy, r, angle, color, background)
    image = image.resize((size, size), Image.BILINEAR).filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.6)))
    noise = rng.normal(0, rng.uniform(4, 20), (size, size, 3))
    pixels = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _spec(image_size: int, train_per_class: int, val_per_class: int, seed: int, classes: tuple[str, ...]) -> dict:
    return {"version": 2, "classes": list(classes), "image_size": image_size,
            "train_per_class": train_per_class, "val_per_class": val_per_class, "seed": seed}


def _write_split(root: Path, split: str, per_class: int, image_size: int, seed: int,
                 classes: tuple[str, ...]) -> None:
    for label, name in enumerate(classes):
        folder = root / split / name
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, label, 0 if split == "train" else 1])
        for index in range(per_class):
            draw_image(label, image_size, rng, classes).save(folder / f"{index:05d}.png", optimize=False)


def ensure_builtin_dataset(root: str | os.PathLike, image_size: int = 40, train_per_class: int = 500,
                           val_per_class: int = 100, seed: int = 0, class_set: str = DEFAULT_CLASS_SET) -> Path:
    """Return the dataset folder, drawing it first if it is absent, incomplete or drawn with other settings."""
    classes = class_names_of(class_set)
    spec = _spec(image_size, train_per_class, val_per_class, seed, classes)
    tag = f"s{image_size}-n{train_per_class}-{val_per_class}-seed{seed}"
    tag += "" if class_set == DEFAULT_CLASS_SET else f"-{class_set}"  # the default set keeps its cache folder
    target = Path(root).expanduser().resolve() / tag
    marker = target / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return target
    start = time.perf_counter()
    print(f"[data] drawing the built-in dataset into {target} ({len(classes)} classes, "
          f"{train_per_class}+{val_per_class} images per class) ...", flush=True)

    def fill(staging: Path) -> None:
        _write_split(staging, "train", train_per_class, image_size, seed, classes)
        _write_split(staging, "val", val_per_class, image_size, seed, classes)
        (staging / _MARKER).write_text(json.dumps(spec))

    images = len(classes) * (train_per_class + val_per_class)
    room = (f" (or set DEIT_ABLATE_CACHE, or data.root, to a folder on a disk with room: the set takes up to "
            f"{images * image_size ** 2 * 3 / 2 ** 20:.0f} MiB, {images} PNGs of {image_size}x{image_size})")
    atomic_folder(target, fill, complete=lambda: marker.exists() and json.loads(marker.read_text()) == spec,
                  doing="drawing the built-in dataset into", room=room)
    print(f"[data] built-in dataset ready in {time.perf_counter() - start:.1f}s", flush=True)
    return target
