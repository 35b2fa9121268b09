"""A user's own ImageFolder data (issue 26): val/ checked against train/ before anything starts, one file rule for
the dataset and the fingerprint, and every image mode read as the right RGB pixels or refused by name."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deit_ablate.core.errors import ConfigError
from deit_ablate.data.bad_images import BadImageError, SkippingImageFolder, decode_problem
from deit_ablate.data.datasets import build_dataset, data_fingerprint
from deit_ablate.data.fingerprint import CACHE_NAME
from deit_ablate.run.validate import validate_config
from tests.conftest import REPO, TINY, compose_config, run_train
from tests.test_fingerprint import read_only, read_only_mount_works

# A run over a few 8x8 images: 4 per batch (an even share for Mixup/CutMix), one or two steps.
SMALL = TINY + ["train.global_batch=4", "train.micro_batch=4", "runtime.eval_batch=8", "train.max_steps=1"]


def write_tree(root: Path, classes: dict[str, list[str]], per_class: int = 4) -> Path:
    """An ImageFolder tree of 8x8 grayscale PNGs, like the user's digits; each class a grey level of its own."""
    for split, names in classes.items():
        for k, name in enumerate(names):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                Image.new("L", (8, 8), 40 * k + i).save(root / split / name / f"{i:04d}.png")
    return root


def folder_args(root: Path, num_classes: int) -> list[str]:
    return ["data=imagefolder", f"data.root={root}", f"data.num_classes={num_classes}"]


def _no_run_left(cwd: Path) -> bool:
    return not list((cwd / "outputs").glob("runs/*")) and not list((cwd / "outputs").glob("wandb/*run-*"))


def _one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


# --- val/ against train/ -------------------------------------------------------------------------------------------

def test_val_classes_under_other_names_are_refused_before_anything_is_written(tmp_path, data_cache):
    """The same number of classes under other names used to train and score val by index (33% on 3 classes)."""
    root = write_tree(tmp_path / "data", {"train": ["cat", "dog", "eel"], "val": ["0", "1", "2"]})
    proc = run_train(folder_args(root, 3) + SMALL, tmp_path, data_cache, check=False)
    line = _one_error_line(proc)
    assert "classes only in train/: cat, dog, eel" in line and "only in val/: 0, 1, 2" in line
    assert _no_run_left(tmp_path)


@pytest.mark.parametrize(("val", "expected"), [
    (["cat", "dog", "eel", "fox"], "only in val/: fox"),
    (["cat", "dog"], "classes only in train/: eel"),
])
def test_an_extra_or_missing_val_class_is_one_error_naming_it(tmp_path, val, expected):
    root = write_tree(tmp_path / "data", {"train": ["cat", "dog", "eel"], "val": val})
    for num_classes in (3, len(val)):  # whatever data.num_classes says, the same message, not "set it to N"
        with pytest.raises(ConfigError) as error:
            validate_config(compose_config(folder_args(root, num_classes)))
        assert expected in str(error.value) and "Set data.num_classes" not in str(error.value)


def test_num_classes_advice_when_train_and_val_agree_comes_before_anything_is_written(tmp_path, data_cache):
    root = write_tree(tmp_path / "data", {"train": ["cat", "dog", "eel"], "val": ["cat", "dog", "eel"]})
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(folder_args(root, 10)))
    assert "data.num_classes=10 but train/ and val/ hold 3 classes (cat, dog, eel)" in str(error.value)
    assert "Set data.num_classes=3" in str(error.value)
    proc = run_train(folder_args(root, 10) + SMALL, tmp_path, data_cache, check=False)
    assert "Set data.num_classes=3" in _one_error_line(proc)
    assert _no_run_left(tmp_path)


# --- one file rule for the dataset and the fingerprint -------------------------------------------------------------

def test_the_dataset_and_the_fingerprint_read_the_same_files(tmp_path):
    root = write_tree(tmp_path / "data", {"train": ["cat", "dog"], "val": ["cat", "dog"]}, per_class=2)
    cat = root / "train" / "cat"
    (cat / ".ipynb_checkpoints").mkdir()
    Image.new("L", (8, 8)).save(cat / ".ipynb_checkpoints" / "0000-checkpoint.png")  # hidden folder: not read
    (cat / "sub").mkdir()
    Image.new("L", (8, 8)).save(cat / "sub" / "deep.png")  # nested: read
    Image.new("L", (8, 8)).save(cat / "LOUD.PNG", format="PNG")  # any case: read
    (cat / "notes.txt").write_text("not an image")  # not read
    Image.new("L", (8, 8)).save(cat / "no_extension", format="PNG")  # not read (no image extension)
    (cat / "gone.png").symlink_to(tmp_path / "nowhere.png")  # a dangling link: not read
    (root / "train" / ".hidden_class").mkdir()  # a hidden class folder: not a class
    Image.new("L", (8, 8)).save(root / "train" / ".hidden_class" / "x.png")
    cfg = compose_config(folder_args(root, 2))
    dataset = build_dataset(cfg.data, "train", None, on_bad_image=cfg.runtime.on_bad_image)
    read = sorted(str(Path(path).relative_to(root / "train")) for path, _ in dataset.samples)
    assert read == ["cat/0000.png", "cat/0001.png", "cat/LOUD.PNG", "cat/sub/deep.png", "dog/0000.png", "dog/0001.png"]
    assert dataset.classes == ["cat", "dog"]
    fp = data_fingerprint(cfg.data)
    assert fp["images"] == {"train": len(read), "val": 4} and fp["classes"] == 2


def test_files_that_are_not_read_are_named_once_at_start(tmp_path, caplog):
    root = write_tree(tmp_path / "data", {"train": ["cat"], "val": ["cat"]}, per_class=1)
    frames = [Image.new("L", (8, 8), v) for v in (10, 200)]
    frames[0].save(root / "train" / "cat" / "anim.gif", save_all=True, append_images=frames[1:])
    Image.new("L", (8, 8)).save(root / "train" / "cat" / "no_extension", format="PNG")
    (root / "val" / "cat" / "notes.txt").write_text("x")
    with caplog.at_level(logging.WARNING):
        data_fingerprint(compose_config(folder_args(root, 1)).data)
    [line] = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert "3 file(s) under" in line and str(root) in line
    for name in ("train/cat/anim.gif", "train/cat/no_extension", "val/cat/notes.txt"):
        assert name in line


def test_the_file_rule_keeps_torchvisions_order(tmp_path):
    """Sample indices (the sampler's permutation, the bad-image table of a checkpoint) mean what they meant before."""
    from torchvision.datasets import ImageFolder

    for rel in ("b/x.png", "b/a b/y.png", "b/a/z.png", "b/a.png", "b/B.png", "b/a-c/w.png", "a/k/l/m.png", "a/k.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("L", (2, 2)).save(tmp_path / rel)
    assert SkippingImageFolder(str(tmp_path)).samples == ImageFolder(str(tmp_path)).samples



@pytest.mark.skipif(not read_only_mount_works(), reason="needs root and mount namespaces (unshare -m)")
def test_train_py_on_a_read_only_data_folder_caches_the_fingerprint_elsewhere(tmp_path, data_cache):
    """#26 point 9: shared or read-only data. The data folder is bind-mounted read-only for the run (see
    tests/test_fingerprint.py); nothing is written into it, and the fingerprint is cached under $DEIT_ABLATE_CACHE."""
    root = write_tree(tmp_path / "data", {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    past = time.time() - 3600  # data not being written: old enough to cache
    for folder, _, _ in os.walk(root):
        os.utime(folder, (past, past))
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    command = read_only(root) + [sys.executable, str(REPO / "train.py")]
    proc = run_train(folder_args(root, 2) + SMALL, tmp_path, data_cache, module=command)
    assert "finished after 1 steps" in proc.stdout
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before and not (root / CACHE_NAME).exists()
    [cached] = (data_cache / "fingerprints").glob(f"{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.json")
    assert json.loads(cached.read_text())["fingerprint"]["images"] == {"train": 8, "val": 8}

# --- image formats and modes ---------------------------------------------------------------------------------------

def _rgba(path: Path) -> None:
    pixels = np.zeros((2, 3, 4), np.uint8)
    pixels[:, 0] = (10, 20, 30, 255)  # opaque
    pixels[:, 1] = (10, 20, 30, 0)  # transparent: the background shows
    pixels[:, 2] = (0, 0, 0, 128)  # half black over white
    Image.fromarray(pixels, "RGBA").save(path)


def _palette(path: Path) -> None:
    image = Image.new("P", (3, 2), 0)
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    for y in range(2):
        image.putpixel((0, y), 1)
    image.save(path, transparency=0)  # index 0 (red) transparent


def _exif_rotated(path: Path) -> None:
    pixels = np.zeros((16, 32), np.uint8)
    pixels[:, 16:] = 255  # stored: dark left half, light right half
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: dark on top
    Image.fromarray(pixels, "L").convert("RGB").save(path, quality=95, exif=exif)


def _bitonal(path: Path) -> None:
    image = Image.new("1", (3, 2), 0)
    image.putpixel((1, 0), 1)
    image.save(path)


CASES = {  # name: (file name, writer, expected size, {(x, y): expected RGB}, tolerance in grey levels)
    "L png": ("a.png", lambda p: Image.new("L", (3, 2), 37).save(p), (3, 2), {(0, 0): (37, 37, 37)}, 0),
    "I;16 png": ("a.png", lambda p: Image.fromarray(np.array([[0, 257 * 100, 40000, 65535]], np.uint16)).save(p),
                 (4, 1), {(0, 0): (0, 0, 0), (1, 0): (100, 100, 100), (2, 0): (156, 156, 156),
                          (3, 0): (255, 255, 255)}, 0),
    "16-bit pgm": ("a.pgm", lambda p: Image.fromarray(np.array([[257 * 60, 65535]], np.uint16)).save(p), (2, 1),
                   {(0, 0): (60, 60, 60), (1, 0): (255, 255, 255)}, 0),
    "P with transparency": ("a.png", _palette, (3, 2), {(0, 0): (0, 0, 255), (1, 0): (255, 255, 255)}, 0),
    "RGBA": ("a.png", _rgba, (3, 2), {(0, 0): (10, 20, 30), (1, 0): (255, 255, 255), (2, 1): (127, 127, 127)}, 1),
    "LA": ("a.png", lambda p: Image.fromarray(np.array([[[50, 255], [50, 0]]], np.uint8), "LA").save(p), (2, 1),
           {(0, 0): (50, 50, 50), (1, 0): (255, 255, 255)}, 0),
    "CMYK jpeg": ("a.jpg", lambda p: Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(p, quality=100), (16, 16),
                  {(8, 8): (255, 0, 0)}, 3),
    "1-bit": ("a.png", _bitonal, (3, 2), {(0, 0): (0, 0, 0), (1, 0): (255, 255, 255)}, 0),
    "EXIF-rotated jpeg": ("a.jpg", _exif_rotated, (16, 32), {(8, 4): (0, 0, 0), (8, 28): (255, 255, 255)}, 8),
    "PNG named .jpg": ("a.jpg", lambda p: Image.new("RGB", (2, 2), (1, 2, 3)).save(p, format="PNG"), (2, 2),
                       {(1, 1): (1, 2, 3)}, 0),
}


def _one_image_folder(tmp_path: Path, name: str, writer) -> Path:
    folder = tmp_path / "train" / "only"
    folder.mkdir(parents=True)
    writer(folder / name)
    return folder / name


@pytest.mark.parametrize("case", CASES)
def test_each_image_mode_is_read_as_the_rgb_it_shows(tmp_path, case):
    name, writer, size, expected, tolerance = CASES[case]
    _one_image_folder(tmp_path, name, writer)
    image, label = SkippingImageFolder(str(tmp_path / "train"), "fail")[0]
    assert image.mode == "RGB" and image.size == size and label == 0
    for (x, y), rgb in expected.items():
        got = image.getpixel((x, y))
        assert max(abs(a - b) for a, b in zip(got, rgb, strict=True)) <= tolerance, (case, (x, y), got, rgb)


@pytest.mark.parametrize(("writer", "reason"), [
    (lambda p: Image.fromarray(np.full((2, 2), 0.5, np.float32)).save(p), "32-bit float"),
    (lambda p: Image.fromarray(np.full((2, 2), 1000, np.int32)).save(p), "32-bit integer"),
])
def test_images_without_a_fixed_range_are_refused_by_name(tmp_path, writer, reason):
    path = _one_image_folder(tmp_path, "a.tif", writer)
    assert reason in decode_problem(path)
    with pytest.raises(BadImageError, match=re.escape(str(path))):
        SkippingImageFolder(str(tmp_path / "train"), "fail")[0]
