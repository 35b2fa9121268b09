"""The built-in dataset: deterministic from its seed, an ImageFolder tree, drawn again when incomplete."""

from __future__ import annotations

import hashlib

from torchvision.datasets import ImageFolder

from deit_ablate.data.builtin import CLASSES, ensure_builtin_dataset


def _digest(root) -> str:
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.png")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_same_seed_same_images_other_seed_other_images(tmp_path):
    a = ensure_builtin_dataset(tmp_path / "a", image_size=16, train_per_class=3, val_per_class=2, seed=0)
    b = ensure_builtin_dataset(tmp_path / "b", image_size=16, train_per_class=3, val_per_class=2, seed=0)
    c = ensure_builtin_dataset(tmp_path / "c", image_size=16, train_per_class=3, val_per_class=2, seed=1)
    assert _digest(a) == _digest(b) != _digest(c)


def test_it_is_an_imagefolder_tree_with_every_class(tmp_path):
    root = ensure_builtin_dataset(tmp_path, image_size=16, train_per_class=3, val_per_class=2)
    train, val = ImageFolder(str(root / "train")), ImageFolder(str(root / "val"))
    assert train.classes == sorted(CLASSES) and len(train) == 30 and len(val) == 20
    image, _ = train[0]
    assert image.size == (16, 16) and image.mode == "RGB"


def test_an_incomplete_tree_is_drawn_again_and_a_complete_one_is_reused(tmp_path):
    root = ensure_builtin_dataset(tmp_path, image_size=16, train_per_class=3, val_per_class=2)
    reference = _digest(root)
    marker = root / "COMPLETE.json"
    stamp = marker.stat().st_mtime_ns
    assert ensure_builtin_dataset(tmp_path, image_size=16, train_per_class=3, val_per_class=2) == root
    assert marker.stat().st_mtime_ns == stamp  # reused, not redrawn
    next(root.rglob("*.png")).unlink()
    marker.unlink()  # a run killed while drawing leaves no marker
    ensure_builtin_dataset(tmp_path, image_size=16, train_per_class=3, val_per_class=2)
    assert _digest(root) == reference and marker.exists()
    assert not list(tmp_path.glob(".s16-*"))  # no staging folder left behind
