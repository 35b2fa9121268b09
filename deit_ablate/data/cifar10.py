"""CIFAR-10 from its standard python-pickle files on disk (never downloaded), as PIL images with integer labels;
and which CIFAR-10 or CIFAR-100 files a run reads (their fingerprints; CIFAR-100 itself is torchvision's reader).

The layout is the one the CIFAR-10 authors ship (cifar-10-python.tar.gz, unpacked): <root>/cifar-10-batches-py/
with data_batch_1 .. data_batch_5 (training), test_batch (evaluation) and batches.meta (the class names). Each batch
is a pickled dict with b"data" (N x 3072 uint8, the red, green then blue plane of a 32 x 32 image per row) and
b"labels". torchvision's reader checks each file's md5, which refuses files written any other way; this one reads
any file of that layout.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from deit_ablate.errors import ConfigError

FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{k}" for k in range(1, 6))
TEST_FILES = ("test_batch",)
META_FILE = "batches.meta"
SIDE = 32
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_FILES = {"train": "train", "val": "test", "meta": "meta"}  # torchvision's CIFAR100 layout
LAYOUT = (f"<data.root>/{FOLDER}/ holding {', '.join(TRAIN_FILES)}, {TEST_FILES[0]} and {META_FILE} (the python "
          "version of CIFAR-10, cifar-10-python.tar.gz, unpacked)")


def cifar10_folder(root: str | Path) -> Path:
    """The folder of the pickle files under `root`; a ConfigError naming the expected layout when one is missing."""
    folder = Path(root).expanduser() / FOLDER
    missing = [name for name in (*TRAIN_FILES, *TEST_FILES, META_FILE) if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"data=cifar10 found no {', '.join(missing)} under {folder}. It reads {LAYOUT}: point "
                          "data.root at the folder that holds cifar-10-batches-py/.")
    return folder


def cifar100_folder(root: str | Path) -> Path:
    """The folder of CIFAR-100's pickle files under `root`; a ConfigError naming the expected layout when one is
    missing."""
    folder = Path(root).expanduser() / CIFAR100_FOLDER
    missing = [name for name in CIFAR100_FILES.values() if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"data=cifar100 found no {', '.join(missing)} under {folder}. It reads torchvision's "
                          f"layout, <data.root>/{CIFAR100_FOLDER}/ holding train, test and meta (the python version "
                          "of CIFAR-100, cifar-100-python.tar.gz, unpacked): point data.root at the folder that holds "
                          f"{CIFAR100_FOLDER}/ (torchvision.datasets.CIFAR100(root, download=True) on a machine with "
                          "internet writes it).")
    return folder


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as handle:
        try:
            return pickle.load(handle, encoding="bytes")
        except (pickle.UnpicklingError, EOFError, ValueError) as error:
            raise ConfigError(f"{path} is not a CIFAR python-pickle file ({error}); data=cifar10 reads {LAYOUT}, "
                              f"data=cifar100 <data.root>/{CIFAR100_FOLDER}/.") from error


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_cifar10(root: str | Path, train: bool) -> tuple[np.ndarray, list[int], list[str]]:
    """The images (N x 32 x 32 x 3 uint8), labels and class names of the training or the test split."""
    folder = cifar10_folder(root)
    images, labels = [], []
    for name in TRAIN_FILES if train else TEST_FILES:
        batch = _unpickle(folder / name)
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, SIDE, SIDE)
        images.append(data.transpose(0, 2, 3, 1))
        labels += [int(label) for label in batch[b"labels"]]
    classes = [_text(name) for name in _unpickle(folder / META_FILE)[b"label_names"]]
    return np.concatenate(images), labels, classes


class CIFAR10Pickles(Dataset):
    """CIFAR-10's training (data_batch_1..5) or test split (test_batch) read from `root`, each image a PIL image
    through `transform`, with `.classes` (batches.meta's names) and `.targets`."""

    def __init__(self, root: str | Path, train: bool, transform: Callable | None = None) -> None:
        self.data, self.targets, self.classes = read_cifar10(root, train)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.data[index])
        return (self.transform(image) if self.transform is not None else image), self.targets[index]


def _files_digest(tag: bytes, folder: Path, names: tuple[str, ...]) -> str:
    """A digest of the files' names and sizes (not their bytes), as data/fingerprint.py takes a folder's."""
    digest = hashlib.sha256(tag)
    for name in names:
        digest.update(b"F\0%s\0%d\0" % (name.encode(), (folder / name).stat().st_size))
    return digest.hexdigest()[:16]


def cifar10_fingerprint(root: str | Path) -> dict:
    """Which CIFAR-10 files a run reads, by content as data/fingerprint.py takes folders: a digest of the files'
    names and sizes, the class count and the images per split."""
    folder = cifar10_folder(root)
    counts = {split: sum(len(_unpickle(folder / name)[b"labels"]) for name in files)
              for split, files in (("train", TRAIN_FILES), ("val", TEST_FILES))}
    classes = [_text(name) for name in _unpickle(folder / META_FILE)[b"label_names"]]
    return {"digest": _files_digest(b"deit-cifar10-v1\0", folder, (*TRAIN_FILES, *TEST_FILES, META_FILE)),
            "classes": len(classes), "images": counts}


def cifar100_fingerprint(root: str | Path) -> dict:
    """Which CIFAR-100 files a run reads, as `cifar10_fingerprint` takes CIFAR-10's (fine labels: 100 classes)."""
    folder = cifar100_folder(root)
    counts = {split: len(_unpickle(folder / CIFAR100_FILES[split])[b"fine_labels"]) for split in ("train", "val")}
    classes = _unpickle(folder / CIFAR100_FILES["meta"])[b"fine_label_names"]
    return {"digest": _files_digest(b"deit-cifar100-v1\0", folder, tuple(CIFAR100_FILES.values())),
            "classes": len(classes), "images": counts}
