"""CIFAR-10 and CIFAR-100 from their standard python-pickle files on disk (never downloaded), as PIL images with
integer labels; and which of their files a run reads (their fingerprints).

The layouts are the ones the CIFAR authors ship (cifar-10-python.tar.gz, cifar-100-python.tar.gz, unpacked):
<root>/cifar-10-batches-py/ with data_batch_1 .. data_batch_5 (training), test_batch (evaluation) and batches.meta
(the class names); <root>/cifar-100-python/ with train, test and meta (fine labels and names). Each data file is a
pickled dict with b"data" (N x 3072 uint8, the red, green then blue plane of a 32 x 32 image per row) and the labels.
torchvision's readers check each file's md5, which refuses files written any other way; these read any file of the
layout. A pickle can run any code it names, so they are read by a restricted unpickler (`read_pickle`) that builds
only what the format holds (dicts, lists, bytes, str, numbers, numpy arrays) and refuses any other global by name:
no file of a data folder is ever unpickled beyond that.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from deit_ablate.core.errors import ConfigError

try:  # numpy >= 2 (its pickles name numpy._core; the CIFAR files, written by numpy 1, name numpy.core)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover (numpy 1)
    from numpy.core.multiarray import _reconstruct

FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{k}" for k in range(1, 6))
TEST_FILES = ("test_batch",)
META_FILE = "batches.meta"
SIDE = 32
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_FILES = {"train": "train", "val": "test", "meta": "meta"}  # torchvision's CIFAR100 layout
LAYOUT = (f"<data.root>/{FOLDER}/ holding {', '.join(TRAIN_FILES)}, {TEST_FILES[0]} and {META_FILE} (the python "
          "version of CIFAR-10, cifar-10-python.tar.gz, unpacked)")
# The only globals a CIFAR pickle names: numpy's array reconstruction (numpy 1's and numpy 2's module name).
ADMITTED = {("numpy.core.multiarray", "_reconstruct"): _reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
            ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
HOLDS = "dicts, lists, bytes, strings, numbers and numpy arrays"


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


class _Refused(pickle.UnpicklingError):
    """A global that a CIFAR file never names."""


class _CifarUnpickler(pickle.Unpickler):
    """Builds what a CIFAR file holds and nothing else: any global outside ADMITTED is refused before it is looked
    up, so a crafted file cannot import or call anything."""

    def find_class(self, module: str, name: str):
        if (module, name) in ADMITTED:
            return ADMITTED[module, name]
        raise _Refused(f"{module}.{name}")


def read_pickle(path: Path) -> dict:
    """The dict a CIFAR python-pickle file holds, read without running anything it names; a ConfigError naming the
    file (and the global it names, when it names one that a CIFAR file never holds)."""
    try:
        with open(path, "rb") as handle:
            data = _CifarUnpickler(handle, encoding="bytes").load()
    except _Refused as refused:
        raise ConfigError(f"{path} is not a CIFAR file: it names the Python global {refused}, which a CIFAR file "
                          f"never holds (only {HOLDS}), and unpickling it could run code, so it was not read. Replace "
                          "it with the file of the same name from cifar-10-python.tar.gz or cifar-100-python.tar.gz."
                          ) from None
    except OSError:
        raise
    except Exception as error:  # a damaged file: UnpicklingError, EOFError, or numpy refusing what it was given
        raise ConfigError(f"{path} is not a CIFAR python-pickle file ({type(error).__name__}: {error}); data=cifar10 "
                          f"reads {LAYOUT}, data=cifar100 <data.root>/{CIFAR100_FOLDER}/.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a CIFAR python-pickle file: it holds a {type(data).__name__}, not a dict; "
                          f"data=cifar10 reads {LAYOUT}, data=cifar100 <data.root>/{CIFAR100_FOLDER}/.")
    return data


def _fields(path: Path, *keys: bytes) -> list:
    """The entries `keys` of the CIFAR file at `path`; a ConfigError naming the file and the key it lacks."""
    data = read_pickle(path)
    for key in keys:
        if key not in data:
            raise ConfigError(f"{path} is not a CIFAR file of this layout: it has no {key!r} entry (its keys: "
                              f"{', '.join(sorted(map(repr, data))[:8])}). Replace it with the file of the same "
                              "name from the dataset's python-version archive.")
    return [data[key] for key in keys]


def _field(path: Path, key: bytes):
    """The entry `key` of the CIFAR file at `path` (see _fields)."""
    return _fields(path, key)[0]


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _read_split(folder: Path, files: tuple[str, ...], labels_key: bytes, meta: str,
                names_key: bytes) -> tuple[np.ndarray, list[int], list[str]]:
    """The images (N x 32 x 32 x 3 uint8), labels and class names of the data files `files` under `folder`."""
    images, labels = [], []
    for name in files:
        data, batch_labels = _fields(folder / name, b"data", labels_key)
        images.append(np.asarray(data, dtype=np.uint8).reshape(-1, 3, SIDE, SIDE).transpose(0, 2, 3, 1))
        labels += [int(label) for label in batch_labels]
    classes = [_text(name) for name in _field(folder / meta, names_key)]
    return np.concatenate(images), labels, classes


def read_cifar10(root: str | Path, train: bool) -> tuple[np.ndarray, list[int], list[str]]:
    """The images (N x 32 x 32 x 3 uint8), labels and class names of the training or the test split."""
    return _read_split(cifar10_folder(root), TRAIN_FILES if train else TEST_FILES, b"labels", META_FILE,
                       b"label_names")


def read_cifar100(root: str | Path, train: bool) -> tuple[np.ndarray, list[int], list[str]]:
    """CIFAR-100's images, fine labels (100 classes) and fine class names, as read_cifar10 reads CIFAR-10's."""
    files = (CIFAR100_FILES["train" if train else "val"],)
    return _read_split(cifar100_folder(root), files, b"fine_labels", CIFAR100_FILES["meta"], b"fine_label_names")


class CIFAR10Pickles(Dataset):
    """CIFAR-10's training (data_batch_1..5) or test split (test_batch) read from `root`, each image a PIL image
    through `transform`, with `.classes` (batches.meta's names) and `.targets`."""

    read = staticmethod(read_cifar10)

    def __init__(self, root: str | Path, train: bool, transform: Callable | None = None) -> None:
        self.data, self.targets, self.classes = self.read(root, train)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.data[index])
        return (self.transform(image) if self.transform is not None else image), self.targets[index]


class CIFAR100Pickles(CIFAR10Pickles):
    """CIFAR-100's training (train) or test split (test) with its fine labels, read as CIFAR10Pickles reads
    CIFAR-10 (torchvision's reader would unpickle the files unrestricted)."""

    read = staticmethod(read_cifar100)


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
    counts = {split: sum(len(_field(folder / name, b"labels")) for name in files)
              for split, files in (("train", TRAIN_FILES), ("val", TEST_FILES))}
    classes = _field(folder / META_FILE, b"label_names")
    return {"digest": _files_digest(b"deit-cifar10-v1\0", folder, (*TRAIN_FILES, *TEST_FILES, META_FILE)),
            "classes": len(classes), "images": counts}


def cifar100_fingerprint(root: str | Path) -> dict:
    """Which CIFAR-100 files a run reads, as `cifar10_fingerprint` takes CIFAR-10's (fine labels: 100 classes)."""
    folder = cifar100_folder(root)
    counts = {split: len(_field(folder / CIFAR100_FILES[split], b"fine_labels")) for split in ("train", "val")}
    classes = _field(folder / CIFAR100_FILES["meta"], b"fine_label_names")
    return {"digest": _files_digest(b"deit-cifar100-v1\0", folder, tuple(CIFAR100_FILES.values())),
            "classes": len(classes), "images": counts}
