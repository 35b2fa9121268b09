"""Unreadable images in an ImageFolder tree: replaced by the next readable sample (runtime.on_bad_image=skip, the
default), or a clear stop naming the file (fail). The loader workers mark each bad file in a shared table; the
training process names each once in the run's log and counts them (`data/bad_images` in the summary). A split
folder that vanishes mid-run (a deleted cache, an unmounted disk) stops the run saying so."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torchvision.datasets import ImageFolder

from deit_ablate.config.schema import BadImagePolicy
from deit_ablate.core.errors import DataError, RunError
from deit_ablate.data.images import IMAGE_EXTENSIONS, class_names, load_rgb, scan_class

MAX_TRIES = 64  # consecutive unreadable samples before a dataset counts as broken
GONE_HINT = ("it was moved or deleted while the run read it. Put it back and relaunch the same command to resume the "
             "run from its last checkpoint.")


class BadImageError(RuntimeError):
    """An unreadable image under runtime.on_bad_image=fail (raised in a loader worker; the run names the file)."""


class DataGoneError(BadImageError):
    """The dataset's split folder is gone while the run reads it (raised in a loader worker; the run says so)."""


def decode_problem(path: str | Path) -> str | None:
    """Why the file at `path` cannot be read as RGB pixels in full (data/images.py), or None when it can."""
    try:
        load_rgb(path)
    except Exception as error:  # PIL raises many types for damaged files (OSError, SyntaxError, ValueError, ...)
        return f"{type(error).__name__}: {error}"
    return None


class SkippingImageFolder(ImageFolder):
    """An ImageFolder read by the file rule of data/images.py, whose unreadable samples are replaced by the next
    readable one, or stop the run. `gone_hint` says what to do when the split folder vanishes mid-run."""

    def __init__(self, root: str, on_bad_image: str = "skip", gone_hint: str = GONE_HINT, **kwargs) -> None:
        kwargs.setdefault("loader", load_rgb)
        super().__init__(root, **kwargs)
        self.on_bad_image, self.gone_hint = on_bad_image, gone_hint
        self.bad = torch.zeros(len(self.samples), dtype=torch.uint8).share_memory_()  # seen by every worker
        self.reported: set[int] = set()  # in the training process: files already named in the log

    def __getitem__(self, index: int):
        for offset in range(MAX_TRIES):
            candidate = (index + offset) % len(self.samples)
            if self.bad[candidate]:
                continue
            try:
                return super().__getitem__(candidate)
            except Exception:
                if not os.path.isdir(self.root):  # not this file: every file is gone
                    raise DataGoneError(f"{self.root} is gone") from None
                path = self.samples[candidate][0]
                if decode_problem(path) is None:  # the file decodes: the error is not the file's
                    raise
                self.bad[candidate] = 1
                if self.on_bad_image == BadImagePolicy.fail:
                    raise BadImageError(f"unreadable image {path}") from None
        raise BadImageError(f"{MAX_TRIES} unreadable images in a row from {self.samples[index][0]}")

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        """The class folders by the file rule: hidden ones are not classes."""
        classes = class_names(directory)
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: i for i, name in enumerate(classes)}

    @staticmethod
    def make_dataset(directory: str, class_to_idx: dict[str, int], *args, **kwargs) -> list[tuple[str, int]]:
        """(path, class index) of every image by the file rule, in torchvision's order (extensions are the rule's)."""
        samples = []
        for name in sorted(class_to_idx):
            scan = scan_class(os.path.join(directory, name), name)
            if not scan.images:
                raise FileNotFoundError(f"Found no valid file for the classes {name}. Supported extensions are: "
                                        f"{', '.join(IMAGE_EXTENSIONS)}")
            samples += [(os.path.join(directory, path), class_to_idx[name]) for path, _ in scan.images]
        return samples

    def bad_paths(self) -> list[str]:
        """Every file found unreadable so far (by any worker)."""
        return [self.samples[int(i)][0] for i in self.bad.nonzero().flatten()]

    def newly_bad(self) -> list[str]:
        """Files found unreadable since the last call, each returned once."""
        fresh = [int(i) for i in self.bad.nonzero().flatten() if int(i) not in self.reported]
        self.reported.update(fresh)
        return [self.samples[i][0] for i in fresh]

    def mark_bad(self, paths: Iterable[str]) -> None:
        """Mark files an earlier launch of the run found unreadable (from its checkpoint); not named again."""
        index = {path: i for i, (path, _) in enumerate(self.samples)}
        for path in paths:
            if path in index:
                self.bad[index[path]] = 1
                self.reported.add(index[path])


def stop_error(datasets: Sequence[SkippingImageFolder]) -> DataError | RunError:
    """Why reading the data stopped the run: its folder vanished, too many unreadable images in a row (skip), or
    the first unreadable image (runtime.on_bad_image=fail); names the path and the fix."""
    gone = [d for d in datasets if not os.path.isdir(d.root)]
    if gone:
        return RunError(f"the files under {Path(gone[0].root).parent} are gone: {gone[0].gone_hint}")
    damaged = [(d, d.bad_paths()) for d in datasets if d.bad_paths()]
    if not damaged:
        return DataError("a loader worker found an unreadable image (runtime.on_bad_image=fail). Set "
                           "runtime.on_bad_image=skip to train on with the next readable image in its place.")
    dataset, paths = damaged[0]
    if dataset.on_bad_image == BadImagePolicy.skip:
        return DataError(f"{MAX_TRIES} images in a row under {dataset.root} cannot be read, the first {paths[0]} "
                           f"({decode_problem(paths[0])}): too many for runtime.on_bad_image=skip to replace. Check "
                           "those files (their format, an interrupted copy), or point data.root at an intact copy.")
    return DataError(f"{paths[0]} cannot be read as an image ({decode_problem(paths[0])}); runtime.on_bad_image=fail "
                       "stops the run. Replace or delete the file, or set runtime.on_bad_image=skip to train on with "
                       "the next readable image in its place.")
