"""Datasets by name: the built-in shapes, ImageNet or any ImageFolder tree, CIFAR-10 and CIFAR-100 from disk."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from PIL import ImageFile
from torch.utils.data import Dataset, Subset

from deit_ablate.config.schema import BuiltinDataConfig, DataConfig, DataName
from deit_ablate.core.errors import ConfigError
from deit_ablate.core.logs import log
from deit_ablate.data.bad_images import GONE_HINT, SkippingImageFolder
from deit_ablate.data.builtin import DEFAULT_CLASS_SET, ensure_builtin_dataset
from deit_ablate.data.cifar10 import (
    CIFAR10Pickles,
    CIFAR100Pickles,
    cifar10_fingerprint,
    cifar10_folder,
    cifar100_fingerprint,
    cifar100_folder,
)
from deit_ablate.data.fast_jpeg import lazy_loader
from deit_ablate.data.fingerprint import dataset_fingerprint, describe_fingerprint
from deit_ablate.data.images import IMAGE_EXTENSIONS, class_names, has_image, load_rgb

# A truncated JPEG is decoded as far as it goes instead of killing an epoch (PIL does not say so: not counted).
# A file that cannot be decoded at all is replaced and counted (data/bad_images.py).
ImageFile.LOAD_TRUNCATED_IMAGES = True
NAMED = 5  # class names and files named in a message
BUILTIN_GONE = ("the built-in cache was removed while the run used it. Relaunch the same command: it draws the set "
                "again and resumes the run from its last checkpoint.")


def dataset_root(data: DataConfig) -> Path:
    """The folder holding train/ and val/, drawing the built-in set first if needed."""
    if data.name == DataName.builtin:
        b = data.builtin
        root = data.root or Path(os.environ.get("DEIT_ABLATE_CACHE", ".cache")) / "builtin"
        return ensure_builtin_dataset(root, b.image_size, b.train_per_class, b.val_per_class, b.seed, b.classes)
    return check_data_root(data)


def check_data_root(data: DataConfig) -> Path:
    """The configured data.root, or a ConfigError saying what is missing there and how to fix it."""
    if not data.root:
        raise ConfigError(
            f"data={data.name} needs data.root, the folder that holds the dataset; none was given. "
            f"Add data.root=/path/to/{data.name} to the command line."
        )
    root = Path(data.root).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.root={data.root} does not exist or is not a folder. Point data.root at the "
                          f"{data.name} folder (for ImageNet, the one holding train/ and val/).")
    if data.name == DataName.cifar10:
        cifar10_folder(root)
    if data.name == DataName.cifar100:
        cifar100_folder(root)
    if data.name in (DataName.imagenet, DataName.imagefolder):
        missing = [split for split in ("train", "val") if not (root / split).is_dir()]
        if missing:
            raise ConfigError(f"data.root={root} has no {' and no '.join(missing)} folder. An ImageFolder "
                              "dataset needs <root>/train/<class>/* and <root>/val/<class>/* (for ImageNet, "
                              "run the usual valprep script to sort val/ into class folders).")
        for split in ("train", "val"):
            check_class_folders(root / split)
        check_same_classes(root, data.num_classes)
    return root


def _first(names: list[str]) -> str:
    """The first few names, and how many more."""
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    return ", ".join(names[:NAMED]) + more if names else "none"


@functools.lru_cache(maxsize=64)
def _split_problem(split_dir: Path) -> str | None:
    """What makes `split_dir` no ImageFolder split, or None; remembered, as a sweep checks one root per run."""
    classes = class_names(split_dir)
    empty = [name for name in classes if not has_image(split_dir / name)]
    if not classes:
        return "it holds no class folder"
    if empty:
        return f"its class folder(s) {_first(empty)} hold no image"
    return None


def check_class_folders(split_dir: Path) -> None:
    """An ImageFolder split: at least one class folder, and an image in every one (what ImageFolder demands)."""
    problem = _split_problem(split_dir)
    if problem:
        raise ConfigError(f"data.root={split_dir.parent}: {split_dir} is not an ImageFolder split: {problem}. "
                          "An ImageFolder dataset needs <root>/train/<class>/* and <root>/val/<class>/* with images "
                          f"({', '.join(IMAGE_EXTENSIONS[:4])}, ...) in every class folder; remove empty class folders "
                          "or point data.root at the right folder.")


def check_same_classes(root: Path, num_classes: int) -> None:
    """train/ and val/ hold the same class folders (val is scored by class index), as many as data.num_classes."""
    train, val = class_names(root / "train"), class_names(root / "val")
    if train != val:
        only = {split: sorted(set(names) - set(other)) for split, names, other in [("train", train, val),
                                                                                     ("val", val, train)]}
        differ = "; ".join(f"only in {split}/: {_first(names)}" for split, names in only.items() if names)
        raise ConfigError(f"data.root={root}: train/ and val/ hold other classes ({len(train)} and {len(val)} class "
                          f"folders): classes {differ}. "
                          "Each class is a label index by its place in the sorted names, so val/ would be scored "
                          "against other labels: give val/ the class folders of train/, under the same names (each "
                          "with at least one image), then set data.num_classes to their number.")
    if num_classes != len(train):
        raise ConfigError(f"data.num_classes={num_classes} but train/ and val/ hold {len(train)} classes "
                          f"({_first(train)}) under data.root={root}. Set data.num_classes={len(train)}.")


def build_dataset(data: DataConfig, split: str, transform: Callable, root: Path | None = None, *,
                  on_bad_image: str) -> Dataset:
    """The `split` ("train" or "val") of the configured dataset with `transform` applied; an unreadable image is
    skipped or fails as `on_bad_image` (runtime.on_bad_image) says."""
    root = root or dataset_root(data)
    if data.name == DataName.cifar10:
        dataset = CIFAR10Pickles(root, train=split == "train", transform=transform)
    elif data.name == DataName.cifar100:
        dataset = CIFAR100Pickles(root, train=split == "train", transform=transform)
    else:
        loader = lazy_loader if data.fast_jpeg and split == "train" else load_rgb  # fast_jpeg: the crop decodes
        gone_hint = BUILTIN_GONE if data.name == DataName.builtin else GONE_HINT
        dataset = SkippingImageFolder(str(root / split), on_bad_image, gone_hint, transform=transform,
                                      loader=loader)
    num_classes = len(dataset.classes)
    if num_classes != data.num_classes:
        raise ConfigError(f"data.num_classes={data.num_classes} but {root / split} holds {num_classes} "
                          f"classes ({_first(list(dataset.classes))}). Set data.num_classes={num_classes}.")
    return dataset


def fraction_indices(targets: Sequence[int], fraction: float) -> list[int]:
    """The images `data.fraction` keeps, in the split's order: of class c's n_c images (in the split's order), the
    first ceil(fraction * n_c) of a permutation drawn from seed c. The seed is fixed, not the run's: every seed of a
    row trains on the same subset (its spread is the training's, not the draw's), and a class's choice does not
    depend on the other classes."""
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(targets):
        by_class.setdefault(int(label), []).append(index)
    kept = []
    for label, indices in by_class.items():
        order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(label)).tolist()
        kept += [indices[i] for i in order[:math.ceil(round(fraction * len(indices), 9))]]  # 0.3 * 10 is 3, not 4
    return sorted(kept)


class FractionSubset(Subset):
    """The images of `dataset` that `fraction_indices` keeps, with its `classes`, `targets` and (an ImageFolder's,
    which the DALI loader reads) `samples`."""

    def __init__(self, dataset: Dataset, fraction: float) -> None:
        super().__init__(dataset, fraction_indices(dataset.targets, fraction))
        self.classes = dataset.classes
        self.targets = [dataset.targets[i] for i in self.indices]
        if hasattr(dataset, "samples"):
            self.samples = [dataset.samples[i] for i in self.indices]


def training_split(data: DataConfig, transform: Callable, root: Path | None = None, *,
                   on_bad_image: str) -> Dataset:
    """The training images a run trains on: the configured dataset's train split, or the share data.fraction keeps."""
    dataset = build_dataset(data, "train", transform, root, on_bad_image=on_bad_image)
    return dataset if data.fraction == 1 else FractionSubset(dataset, data.fraction)


def builtin_params(builtin: BuiltinDataConfig) -> dict:
    """The built-in set's drawing parameters as its fingerprint hashes them: the default class set left out, so
    the digests (and wandb ids) of runs from before data.builtin.classes stay what they were."""
    params = dict(builtin)
    if params.get("classes") == DEFAULT_CLASS_SET:
        params.pop("classes")
    return params


def data_fingerprint(data: DataConfig) -> dict:
    """Which data a run trains on, by content: the built-in set by its drawing parameters, a folder by its
    fingerprint (class names, image counts, relative paths and sizes; cached next to the data)."""
    if data.name == DataName.builtin and not data.root:
        params = builtin_params(data.builtin)
        digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
        return {"digest": digest, "builtin": params}
    if data.name == DataName.cifar10:
        return cifar10_fingerprint(check_data_root(data))
    if data.name == DataName.cifar100:  # its files by content: a folder scan would give every copy one digest
        return cifar100_fingerprint(check_data_root(data))
    root = dataset_root(data) if data.name != DataName.builtin else Path(data.root).expanduser()
    fingerprint = dataset_fingerprint(root)
    if "not_read" in fingerprint:
        left_out = fingerprint["not_read"]
        log.warning(f"[data] {left_out['files']} file(s) under {root} are not read: their names do not end in an "
                    f"image extension ({', '.join(IMAGE_EXTENSIONS)}, any case): {_first(left_out['first'])}"
                    f"{' ...' if left_out['files'] > len(left_out['first']) else ''}. Give the images among them "
                    "one of these extensions (converting GIFs to PNG) if they should train.")
    return fingerprint


def check_cifar_data(data: DataConfig) -> None:
    """A CIFAR dataset read through and checked (its fingerprint checks every batch: data/cifar10.py), with as many
    classes as data.num_classes; a ConfigError naming the file or the key otherwise. Nothing else is read."""
    if data.name not in (DataName.cifar10, DataName.cifar100):
        return
    fingerprint = data_fingerprint(data)
    if fingerprint["classes"] != data.num_classes:
        raise ConfigError(f"data.num_classes={data.num_classes} but the {data.name} files under data.root={data.root} "
                          f"name {fingerprint['classes']} classes. Set data.num_classes={fingerprint['classes']}.")


def describe_data(fingerprint: dict) -> str:
    """One line that tells two datasets apart."""
    if "builtin" in fingerprint:
        return f"the built-in set {fingerprint['builtin']}"
    return describe_fingerprint(fingerprint)
