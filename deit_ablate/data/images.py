"""Which files of an ImageFolder tree are its images, and how an image file becomes RGB pixels.

The file rule, the one both the dataset (`SkippingImageFolder`) and the data fingerprint read by: under a split, every
folder is a class; under a class folder, searched recursively (symlinks followed, each folder once), every regular
file whose name ends in one of torchvision's image extensions, in any case, is an image of that class. Names starting
with '.' are skipped at every level, files and folders alike (.DS_Store, ._x.jpg, .ipynb_checkpoints/, .git/). Any
other file is not read, and is reported (`ClassScan.others`). The order is torchvision's: folders by path, files by
name.

The pixels (`to_rgb`): the image turned upright by its EXIF orientation; 16-bit greyscale scaled to 8 bits (PIL's own
conversion saturates it); transparency composited over white; then RGB. 32-bit integer and float images have no
fixed range and are refused, naming why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps
from torchvision.datasets.folder import IMG_EXTENSIONS

from deit_ablate.core.errors import ConfigError

IMAGE_EXTENSIONS = IMG_EXTENSIONS  # .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp
BACKGROUND = (255, 255, 255, 255)  # what transparent pixels become: white, as a viewer shows them on a page
_SIXTEEN_BIT_FORMATS = ("PNG", "PPM")  # formats whose 'I' images hold 16-bit samples


def is_hidden(name: str) -> bool:
    """Names starting with '.': skipped by the dataset and the fingerprint alike."""
    return name.startswith(".")


def is_image_name(name: str) -> bool:
    """Whether a file name ends in an image extension (any case)."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def class_names(split_dir: str | os.PathLike) -> list[str]:
    """The class folders of an ImageFolder split, sorted; [] when the split is missing."""
    try:
        with os.scandir(split_dir) as entries:
            return sorted(e.name for e in entries if not is_hidden(e.name) and _is_folder(e))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_folder(entry: os.DirEntry) -> bool:
    """Whether `entry` is a folder (a symlink to one followed); a ConfigError naming it where it cannot be followed
    (a symlink loop: ELOOP), which would stop the dataset's scan after the run's folder was made."""
    try:
        return entry.is_dir()
    except OSError as error:
        raise ConfigError(f"data.root: {entry.path} cannot be read ({error.strerror or error}): a class folder is a "
                          "folder or a symlink to one. Fix or remove that link.") from None


def _walk(folder: str, rel: str) -> Iterator[tuple[str, os.DirEntry]]:
    """(rel of its folder, entry) for every non-hidden file and folder below `folder`, lazily; each folder once
    (symlinks followed, a loop only once)."""
    seen, todo = {(s.st_dev, s.st_ino) for s in [os.stat(folder)]}, [(folder, rel)]
    while todo:
        path, prefix = todo.pop()
        with os.scandir(path) as entries:
            for e in entries:
                if is_hidden(e.name):
                    continue
                if e.is_dir():
                    st = e.stat()
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                    todo.append((e.path, f"{prefix}/{e.name}"))
                elif not e.is_file():  # a dangling link, a socket, ...
                    continue
                yield prefix, e


@dataclass
class ClassScan:
    """What the file rule finds under one class folder; paths start with the caller's `rel`."""

    images: list[tuple[str, int]] = field(default_factory=list)  # (path, size in bytes or -1), torchvision's order
    others: list[str] = field(default_factory=list)  # files that are not read: no image extension
    folders: list[tuple[str, int]] = field(default_factory=list)  # nested folders and their mtime_ns


def scan_class(folder: str | os.PathLike, rel: str, sizes: bool = False) -> ClassScan:
    """The images of one class folder by the file rule (sizes: stat each one, else -1)."""
    by_folder: dict[str, list[os.DirEntry]] = {}
    for prefix, e in _walk(os.fspath(folder), rel):
        by_folder.setdefault(prefix, []).append(e)
    scan = ClassScan()
    for prefix in sorted(by_folder):  # torchvision: sorted(os.walk(...)), then each folder's files by name
        for e in sorted(by_folder[prefix], key=lambda e: e.name):
            path = f"{prefix}/{e.name}"
            if e.is_dir():
                scan.folders.append((path, e.stat().st_mtime_ns))
            elif is_image_name(e.name):
                scan.images.append((path, e.stat().st_size if sizes else -1))
            else:
                scan.others.append(path)
    return scan


def has_image(folder: str | os.PathLike) -> bool:
    """Whether a class folder holds at least one image by the file rule (stops at the first)."""
    return any(not e.is_dir() and is_image_name(e.name) for _, e in _walk(os.fspath(folder), ""))


def _is_sixteen_bit(image: Image.Image) -> bool:
    """Whether a greyscale integer image holds 16-bit samples (PNG, PGM and 16-bit TIFF), not 32-bit ones."""
    if image.mode.startswith("I;16"):
        return True
    tiff_bits = getattr(image, "tag_v2", {}).get(258)  # BitsPerSample
    return image.mode == "I" and (image.format in _SIXTEEN_BIT_FORMATS or tiff_bits in (16, (16,)))


def to_rgb(image: Image.Image) -> Image.Image:
    """An opened image as the RGB pixels a viewer shows (module doc); ValueError for 32-bit integer or float."""
    if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if _is_sixteen_bit(image):
        grey = (np.asarray(image, dtype=np.uint32) + 128) // 257  # 0..65535 onto 0..255, rounded
        image = Image.fromarray(grey.astype(np.uint8))
    elif image.mode in ("I", "F"):
        kind = "integer" if image.mode == "I" else "float"
        raise ValueError(f"a 32-bit {kind} image (mode {image.mode}) has no fixed range of values; save it with "
                         "8 or 16 bits per channel")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        image = Image.alpha_composite(Image.new("RGBA", image.size, BACKGROUND), image.convert("RGBA"))
    return image.convert("RGB")


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """An image file as RGB pixels (`to_rgb`): the dataset's loader."""
    with Image.open(Path(path)) as image:
        return to_rgb(image)
