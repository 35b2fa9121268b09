"""CIFAR files that lie: arrays built only from checked bytes (never numpy.ndarray over a buffer and an offset, which
reads the process's memory), every batch checked before anything is written, the files digested by their content,
and the files Python 3 pickles again (protocols 2 and 5) read as the originals."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, compose_config, run_train, write_cifar10

from deit_ablate.core.errors import ConfigError
from deit_ablate.data.cifar10 import FOLDER, META_FILE, TEST_FILES, TRAIN_FILES, CIFAR10Pickles
from deit_ablate.data.datasets import build_dataset, data_fingerprint
from deit_ablate.data.fingerprint import CACHE_NAME
from deit_ablate.run.validate import validate_config

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover (numpy 1)
    from numpy.core.multiarray import _reconstruct


def _overrides(root: Path, classes: int = 10) -> list[str]:
    return ["data=cifar10", f"data.root={root}", f"data.num_classes={classes}"]


def _rewrite(path: Path, **entries) -> None:
    """Pickle the CIFAR file at `path` (the test's own) again with `entries` (bytes keys spelled as str) changed."""
    with open(path, "rb") as handle:
        data = pickle.load(handle, encoding="bytes")
    data.update({key.encode(): value for key, value in entries.items()})
    with open(path, "wb") as handle:
        pickle.dump(data, handle)


def _refused_everywhere(root: Path, match: str) -> None:
    """The launch's checks, the fingerprint and the training reader all refuse the data with `match`."""
    cfg = compose_config(_overrides(root))
    with pytest.raises(ConfigError, match=match):
        data_fingerprint(cfg.data)
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg)
    with pytest.raises(ConfigError, match=match):
        build_dataset(cfg.data, "train", lambda x: x, on_bad_image=cfg.runtime.on_bad_image)


class _ArrayOverMemory:
    """What a crafted file holds as its pixels: numpy.ndarray((rows, 3072), uint8, buffer, offset), an array over
    the memory `offset` bytes away from a 16-byte buffer (numpy checks only that rows x 3072 <= 16 - offset)."""

    def __init__(self, rows: int, offset: int) -> None:
        self.rows, self.offset = rows, offset

    def __reduce__(self):
        return np.ndarray, ((self.rows, 3072), np.dtype(np.uint8), b"\0" * 16, self.offset)


class _LyingState:
    """An array pickled numpy's way whose state lies: `shape` and `dtype` over `raw`."""

    def __init__(self, shape: tuple, dtype: str, raw: object) -> None:
        self.state = (1, shape, np.dtype(dtype), False, raw)

    def __reduce__(self):
        return _reconstruct, (np.ndarray, (0,), b"b"), self.state


@pytest.mark.parametrize("offset", [-12288, -(1 << 40)])
def test_an_array_over_the_process_memory_is_refused_before_it_is_built(tmp_path: Path, offset: int) -> None:
    write_cifar10(tmp_path)
    _rewrite(tmp_path / FOLDER / TRAIN_FILES[0], data=_ArrayOverMemory(4, offset),
             labels=[0, 1, 2, 3])
    _refused_everywhere(tmp_path, rf"{re.escape(str(tmp_path / FOLDER / TRAIN_FILES[0]))} is not a CIFAR file: it "
                                  r"calls numpy\.ndarray\(\.\.\.\), which builds an array over a buffer at an offset")


@pytest.mark.parametrize(("lie", "problem"), [
    (_LyingState((20, 3072), "u1", b"\0" * 100), r"shape \(20, 3072\) and dtype uint8 \(61440 bytes\) over 100 bytes"),
    (_LyingState((2,), "O", [1, 2]), "of dtype 'O8'; a CIFAR file holds numbers only"),
    (_LyingState((-20, 3072), "u1", b""), r"shape \(-20, 3072\), not a tuple of sizes"),
])
def test_an_array_whose_state_lies_is_refused(tmp_path: Path, lie: _LyingState, problem: str) -> None:
    write_cifar10(tmp_path)
    _rewrite(tmp_path / FOLDER / TRAIN_FILES[0], data=lie)
    _refused_everywhere(tmp_path, problem)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_files_pickled_again_by_python_3_are_read(tmp_path: Path, protocol: int) -> None:
    """Protocol 2 spells bytes as _codecs.encode(text, "latin1"), protocol 5 an array as numpy's _frombuffer."""
    written = write_cifar10(tmp_path, protocol=protocol)
    train = CIFAR10Pickles(tmp_path, train=True)
    first = written[TRAIN_FILES[0]][0].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    assert np.array_equal(train.data[:20], first) and train.targets[:20] == written[TRAIN_FILES[0]][1]
    assert data_fingerprint(compose_config(_overrides(tmp_path)).data)["images"] == {"train": 100, "val": 20}


def _lie_about_everything(folder: Path) -> None:
    """Every label and pixel of the CIFAR-10 files in `folder` changed, each file the same size as before."""
    for name in (*TRAIN_FILES, *TEST_FILES):
        size = (folder / name).stat().st_size
        with open(folder / name, "rb") as handle:
            data = pickle.load(handle, encoding="bytes")
        _rewrite(folder / name, data=255 - data[b"data"], labels=[9 - label for label in data[b"labels"]])
        assert (folder / name).stat().st_size == size


def _age(folder: Path, seconds: int) -> None:
    """The files of `folder` dated `seconds` ago (older than the fingerprint cache's race window)."""
    for path in folder.iterdir():
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns - seconds * 10**9))


def test_the_digest_is_the_files_content_and_cached_by_size_and_mtime(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    shutil.copytree(tmp_path / "a", tmp_path / "lies")
    _lie_about_everything(tmp_path / "lies" / FOLDER)
    digest = {name: data_fingerprint(compose_config(_overrides(tmp_path / name)).data)["digest"]
              for name in ("a", "copy", "lies")}
    assert digest["a"] == digest["copy"]  # the bytes, not where they lie
    assert digest["lies"] != digest["a"]  # the same names and sizes, other labels and pixels
    folder = tmp_path / "a" / FOLDER
    _age(folder, 10)
    data = compose_config(_overrides(tmp_path / "a")).data
    assert data_fingerprint(data)["digest"] == digest["a"] and (folder / CACHE_NAME).is_file()
    _rewrite(folder / META_FILE, label_names=[b"x"] * 10)  # read again: its size or mtime changed
    assert data_fingerprint(data)["digest"] != digest["a"]


BAD_BATCHES = {
    "fewer labels": (lambda d, labels: {"labels": labels[:-1]}, "it holds 20 images but 19 labels"),
    "rows of 1024": (lambda d, labels: {"data": d.reshape(-1, 1024)},
                     r"its pixels have the shape \(60, 1024\), not N x 3072"),
    "float pixels": (lambda d, labels: {"data": np.full(d.shape, 300.7)}, "its pixels are float64 values, not uint8"),
    "label 15": (lambda d, labels: {"labels": [15, *labels[1:]]},
                 "it has the label 15, but its meta file names 10 classes"),
    "label -1": (lambda d, labels: {"labels": [*labels[:-1], -1]}, "it has the label -1, but its meta file names 10"),
    "labels not a list": (lambda d, labels: {"labels": "0123"}, "its labels are not a list of integers"),
}


@pytest.mark.parametrize("case", BAD_BATCHES)
def test_a_batch_that_lies_is_refused_before_anything_is_written(tmp_path: Path, case: str) -> None:
    written = write_cifar10(tmp_path)
    change, problem = BAD_BATCHES[case]
    _rewrite(tmp_path / FOLDER / TRAIN_FILES[2], **change(*written[TRAIN_FILES[2]]))
    _refused_everywhere(tmp_path, rf"{re.escape(str(tmp_path / FOLDER / TRAIN_FILES[2]))} is not a CIFAR data file: "
                                  f"{problem}")


def test_data_num_classes_is_held_to_the_meta_file_before_anything_is_written(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    with pytest.raises(ConfigError, match=r"data.num_classes=7 but the cifar10 files .* name 10 classes\. Set "
                                          r"data.num_classes=10"):
        validate_config(compose_config(_overrides(tmp_path, classes=7)))


@pytest.mark.slow
def test_a_run_on_labels_out_of_range_stops_with_one_line_and_no_folder(tmp_path: Path, data_cache: Path) -> None:
    written = write_cifar10(tmp_path / "data")
    labels = written[TEST_FILES[0]][1]
    _rewrite(tmp_path / "data" / FOLDER / TEST_FILES[0], labels=[15, *labels[1:]])
    proc = run_train([*_overrides(tmp_path / "data"), *TINY], tmp_path, data_cache, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the label 15, but its meta file names 10 classes" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()  # no run folder, no sweep file, no wandb folder
