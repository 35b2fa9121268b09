"""CIFAR-10 and CIFAR-100 from their standard python-pickle files on disk (never downloaded), as PIL images with
integer labels; and which of their files a run reads (their fingerprints).

The layouts are the ones the CIFAR authors ship (cifar-10-python.tar.gz, cifar-100-python.tar.gz, unpacked):
<root>/cifar-10-batches-py/ with data_batch_1 .. data_batch_5 (training), test_batch (evaluation) and batches.meta
(the class names); <root>/cifar-100-python/ with train, test and meta (fine labels and names). Each data file is a
pickled dict with b"data" (N x 3072 uint8, the red, green then blue plane of a 32 x 32 image per row) and the labels.
torchvision's readers check each file's md5, which refuses files written any other way; these read any file of the
layout, and check each batch (`check_batch`) before a run is planned: N x 3072 uint8 pixels, one label per image,
each a class of the meta file.

A pickle can run any code it names, so they are read by a restricted unpickler (`read_pickle`) that builds only what
the format holds (dicts, lists, bytes, str, numbers, numpy arrays) and refuses any other global by name. The globals
numpy's arrays are pickled with are not numpy's own objects there: `numpy.ndarray` cannot be called (called with a
buffer and an offset it makes an array over any memory of the process), and an array is built from its pickled
state only, a numeric dtype and a bytes object exactly shape x itemsize long (`_array_from`). Python 3 pickles of
protocol 2 spell bytes as `_codecs.encode(text, "latin1")`, which is admitted as that encoding alone.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from deit_ablate.core.errors import ConfigError
from deit_ablate.data.fingerprint import files_fingerprint

FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{k}" for k in range(1, 6))
TEST_FILES = ("test_batch",)
META_FILE = "batches.meta"
SIDE = 32
ROW = 3 * SIDE * SIDE  # an image's values: the red, green then blue plane
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_FILES = {"train": "train", "val": "test", "meta": "meta"}  # torchvision's CIFAR100 layout
LAYOUT = (f"<data.root>/{FOLDER}/ holding {', '.join(TRAIN_FILES)}, {TEST_FILES[0]} and {META_FILE} (the python "
          "version of CIFAR-10, cifar-10-python.tar.gz, unpacked)")
HOLDS = "dicts, lists, bytes, strings, numbers and numpy arrays"
REPLACE = "Replace it with the file of the same name from cifar-10-python.tar.gz or cifar-100-python.tar.gz."
ARRAY_KINDS = "biuf"  # the dtype kinds an array of a CIFAR file may have: bool, integers, floats (no objects)
MAX_DIMS = 32


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


class _Unsafe(pickle.UnpicklingError):
    """A numpy global used otherwise than numpy pickles an array: what it would build is said in the message."""


class _NdarrayName:
    """What `numpy.ndarray` stands for in a CIFAR file: the class _reconstruct is handed, never called (numpy's
    ndarray(shape, dtype, buffer, offset) makes an array over any memory of the process)."""

    def __new__(cls, *args, **kwargs):
        raise _Unsafe("it calls numpy.ndarray(...), which builds an array over a buffer at an offset and so could read "
                      "any memory of this process (numpy's own pickles never call it)")


class _DType:
    """A numeric numpy dtype named in a CIFAR file: its type code, then its byte order from the pickled state."""

    def __init__(self, code: object = None, align: object = False, copy: object = True) -> None:
        if not isinstance(code, str) or len(code) > 8:
            raise _Unsafe(f"it names a numpy dtype by {code!r}, not by a type code")
        try:
            dtype = np.dtype(code)
        except TypeError:
            raise _Unsafe(f"it names a numpy dtype {code!r} that numpy does not know") from None
        if dtype.kind not in ARRAY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
            raise _Unsafe(f"it holds numpy arrays of dtype {code!r}; a CIFAR file holds numbers only")
        self.dtype = dtype

    def __setstate__(self, state: object) -> None:
        order = state[1] if isinstance(state, tuple) and len(state) > 1 else None
        if order not in ("<", ">", "|", "="):
            raise _Unsafe(f"its numpy dtype has the state {state!r}, which no numeric dtype has")
        self.dtype = self.dtype.newbyteorder(order) if order in "<>" else self.dtype


def _array_from(shape: object, dtype: object, raw: object, fortran: object = False) -> np.ndarray:
    """The array of `shape` and `dtype` (a _DType) whose values are the bytes `raw`, checked: whole dimensions and
    exactly shape x itemsize bytes (numpy would build a larger array over memory beyond them)."""
    if not (isinstance(shape, tuple) and len(shape) <= MAX_DIMS
            and all(type(n) is int and n >= 0 for n in shape)):
        raise _Unsafe(f"it holds a numpy array of shape {shape!r}, not a tuple of sizes")
    if not isinstance(dtype, _DType):
        raise _Unsafe("it holds a numpy array whose dtype is not a numpy dtype")
    if not isinstance(raw, bytes | bytearray):
        raise _Unsafe(f"it holds a numpy array whose values are a {type(raw).__name__}, not bytes")
    size = math.prod(shape) * dtype.dtype.itemsize
    if len(raw) != size:
        raise _Unsafe(f"it holds a numpy array of shape {shape} and dtype {dtype.dtype} ({size} bytes) over "
                      f"{len(raw)} bytes")
    order = "F" if fortran else "C"
    return np.frombuffer(bytes(raw), dtype=dtype.dtype, count=math.prod(shape)).reshape(shape, order=order)


class _Array:
    """An array numpy's `_reconstruct` starts in a CIFAR file; its pickled state (shape, dtype, bytes) builds it."""

    array: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise _Unsafe("it holds a numpy array whose state is not numpy's (version, shape, dtype, order, bytes)")
        shape, dtype, fortran, raw = state[-4:]
        self.array = _array_from(shape, dtype, raw, fortran)


def _reconstruct(cls: object, shape: object = (0,), code: object = b"b") -> _Array:
    """numpy's `_reconstruct(ndarray, (0,), b"b")`, the start of a pickled array: an _Array awaiting its state."""
    if cls is not _NdarrayName:
        raise _Unsafe("it calls numpy's _reconstruct on something other than numpy.ndarray")
    return _Array()


def _frombuffer(raw: object, dtype: object, shape: object, order: object = "C") -> np.ndarray:
    """numpy's `_frombuffer(bytes, dtype, shape, order)` (pickle protocol 5), as `_array_from` checks it."""
    return _array_from(shape, dtype, raw, order == "F")


def _latin1(text: object, encoding: object = "latin1") -> bytes:
    """`_codecs.encode(text, "latin1")`: how Python 3 spells bytes in a protocol-2 pickle, and nothing else."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Unsafe(f"it calls _codecs.encode with {type(text).__name__} and {encoding!r}, not a str and latin1")
    return text.encode("latin-1")


def _empty_bytes() -> bytes:
    """`bytes()`: how Python 3 spells b"" in a protocol-2 pickle."""
    return b""


# The only globals a CIFAR pickle names, each mapped to what builds its part safely (numpy 1 and 2's module names).
ADMITTED: dict[tuple[str, str], Callable] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): _NdarrayName,
    ("numpy", "dtype"): _DType,
    ("_codecs", "encode"): _latin1,
    ("builtins", "bytes"): _empty_bytes,
}


class _CifarUnpickler(pickle.Unpickler):
    """Builds what a CIFAR file holds and nothing else: any global outside ADMITTED is refused before it is looked
    up, so a crafted file cannot import or call anything; numpy's are ADMITTED's safe stand-ins."""

    def find_class(self, module: str, name: str):
        if (module, name) in ADMITTED:
            return ADMITTED[module, name]
        raise _Refused(f"{module}.{name}")


def _arrays(value: object) -> object:
    """`value` with every _Array replaced by the array its state built (in dicts, lists and tuples)."""
    if isinstance(value, _Array):
        if value.array is None:
            raise _Unsafe("it holds a numpy array without its values")
        return value.array
    if isinstance(value, _DType):
        return value.dtype
    if isinstance(value, dict):
        return {key: _arrays(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_arrays(item) for item in value)
    return value


def read_pickle(path: Path) -> dict:
    """The dict a CIFAR python-pickle file holds, read without running anything it names; a ConfigError naming the
    file (and the global it names, when it names one that a CIFAR file never holds)."""
    try:
        with open(path, "rb") as handle:
            data = _arrays(_CifarUnpickler(handle, encoding="bytes").load())
    except _Refused as refused:
        raise ConfigError(f"{path} is not a CIFAR file: it names the Python global {refused}, which a CIFAR file "
                          f"never holds (only {HOLDS}), and unpickling it could run code, so it was not read. "
                          f"{REPLACE}") from None
    except _Unsafe as unsafe:
        raise ConfigError(f"{path} is not a CIFAR file: {unsafe}, so it was not read. {REPLACE}") from None
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


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class CifarLayout:
    """One CIFAR dataset's files: its folder under data.root, each split's data files, the meta file and the keys
    of the labels and class names."""

    data: str  # its data= option
    folder: str
    splits: dict[str, tuple[str, ...]]
    meta: str
    labels_key: bytes
    names_key: bytes

    @property
    def files(self) -> tuple[str, ...]:
        return (*(name for files in self.splits.values() for name in files), self.meta)


CIFAR10 = CifarLayout("cifar10", FOLDER, {"train": TRAIN_FILES, "val": TEST_FILES}, META_FILE, b"labels",
                      b"label_names")
CIFAR100 = CifarLayout("cifar100", CIFAR100_FOLDER, {"train": (CIFAR100_FILES["train"],),
                                                     "val": (CIFAR100_FILES["val"],)},
                       CIFAR100_FILES["meta"], b"fine_labels", b"fine_label_names")


def class_names(path: Path, key: bytes) -> list[str]:
    """The class names of a CIFAR meta file (a non-empty list of strings); a ConfigError naming the file otherwise."""
    names = _fields(path, key)[0]
    if not isinstance(names, list) or not names or not all(isinstance(n, bytes | str) for n in names):
        raise ConfigError(f"{path} is not a CIFAR meta file: its {key!r} entry is not a list of class names. "
                          f"{REPLACE}")
    return [_text(name) for name in names]


def check_batch(path: Path, data: object, labels: object, classes: int) -> tuple[np.ndarray, list[int]]:
    """A data file's images (N x 32 x 32 x 3 uint8) and labels, checked: its pixels N x 3072 uint8 values, one
    label per image, each a class index in [0, `classes`); a ConfigError naming the file and what is wrong."""
    problem = None
    if not isinstance(data, np.ndarray):
        problem = f"its pixels are a {type(data).__name__}, not a numpy array"
    elif data.dtype != np.uint8:
        problem = f"its pixels are {data.dtype} values, not uint8 (0..255)"
    elif data.ndim != 2 or data.shape[1] != ROW or data.shape[0] == 0:
        problem = f"its pixels have the shape {data.shape}, not N x {ROW} (one 32 x 32 RGB image a row)"
    label_array = np.asarray(labels) if isinstance(labels, list | np.ndarray) else None
    if problem is None and (label_array is None or label_array.ndim != 1
                            or (label_array.size and label_array.dtype.kind not in "iu")):
        problem = "its labels are not a list of integers"
    if problem is None and label_array.size != data.shape[0]:
        problem = f"it holds {data.shape[0]} images but {label_array.size} labels (one per image)"
    if problem is None and (label_array.min() < 0 or label_array.max() >= classes):
        bad = int(label_array[(label_array < 0) | (label_array >= classes)][0])
        problem = f"it has the label {bad}, but its meta file names {classes} classes (labels 0 to {classes - 1})"
    if problem is not None:
        raise ConfigError(f"{path} is not a CIFAR data file: {problem}. {REPLACE}")
    return data.reshape(-1, 3, SIDE, SIDE).transpose(0, 2, 3, 1), label_array.astype(int).tolist()


def _batches(folder: Path, layout: CifarLayout, files: tuple[str, ...],
             classes: int) -> Iterator[tuple[np.ndarray, list[int]]]:
    """The images and labels of each data file `files` under `folder`, each file checked (check_batch)."""
    for name in files:
        yield check_batch(folder / name, *_fields(folder / name, b"data", layout.labels_key), classes)


def _read_files(folder: Path, layout: CifarLayout, files: tuple[str, ...],
                classes: int) -> tuple[np.ndarray, list[int]]:
    """The images and labels of the data files `files` under `folder`, in order, each file checked."""
    images, labels = [], []
    for batch_images, batch_labels in _batches(folder, layout, files, classes):
        images.append(batch_images)
        labels += batch_labels
    return np.concatenate(images), labels


def _read_split(folder: Path, layout: CifarLayout, split: str) -> tuple[np.ndarray, list[int], list[str]]:
    """The images (N x 32 x 32 x 3 uint8), labels and class names of one split of `layout` under `folder`."""
    classes = class_names(folder / layout.meta, layout.names_key)
    return (*_read_files(folder, layout, layout.splits[split], len(classes)), classes)


def read_cifar10(root: str | Path, train: bool) -> tuple[np.ndarray, list[int], list[str]]:
    """The images (N x 32 x 32 x 3 uint8), labels and class names of the training or the test split."""
    return _read_split(cifar10_folder(root), CIFAR10, "train" if train else "val")


def read_cifar100(root: str | Path, train: bool) -> tuple[np.ndarray, list[int], list[str]]:
    """CIFAR-100's images, fine labels (100 classes) and fine class names, as read_cifar10 reads CIFAR-10's."""
    return _read_split(cifar100_folder(root), CIFAR100, "train" if train else "val")


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


def _content_digest(layout: CifarLayout, folder: Path) -> str:
    """sha256 over the layout's file names and bytes, streamed (0.3 s for CIFAR-10's 180 MB on 2 cores)."""
    digest = hashlib.sha256(f"deit-{layout.data}-v2\0".encode())
    for name in layout.files:
        digest.update(b"F\0%s\0" % name.encode())
        with open(folder / name, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
            digest.update(b"\0%d\0" % handle.tell())
    return digest.hexdigest()[:16]


def _fingerprint(layout: CifarLayout, folder: Path) -> dict:
    """Every file of `layout` under `folder` read and checked (check_batch), and its fingerprint: the digest of
    the files' bytes, the class count and the images per split."""
    classes = len(class_names(folder / layout.meta, layout.names_key))
    counts = {split: sum(len(labels) for _, labels in _batches(folder, layout, files, classes))
              for split, files in layout.splits.items()}
    return {"digest": _content_digest(layout, folder), "classes": classes, "images": counts}


def cifar_fingerprint(layout: CifarLayout, folder: Path) -> dict:
    """Which CIFAR files a run reads, by content: a digest of their bytes, the class count and the images per split,
    every batch checked first (a ConfigError naming a file that is not what the layout holds); cached against the
    files' sizes and mtimes (data/fingerprint.py `files_fingerprint`), so a sweep reads them once."""
    return files_fingerprint(folder, layout.files, lambda: _fingerprint(layout, folder), layout.data)


def cifar10_fingerprint(root: str | Path) -> dict:
    """Which CIFAR-10 files a run reads (cifar_fingerprint)."""
    return cifar_fingerprint(CIFAR10, cifar10_folder(root))


def cifar100_fingerprint(root: str | Path) -> dict:
    """Which CIFAR-100 files a run reads (cifar_fingerprint; fine labels: 100 classes)."""
    return cifar_fingerprint(CIFAR100, cifar100_folder(root))
