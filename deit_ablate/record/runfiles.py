"""Reading a run folder's files as records: regular files only (a FIFO is never waited on), text, JSON; what is
wrong with one is a DamagedRecord naming the file, its problem and the fix; whether a folder can be written.
record/rundir.py names the files."""

from __future__ import annotations

import io
import json
import math
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

from deit_ablate.core.errors import ConfigError

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


class DamagedRecord(ConfigError):
    """A file of a run folder that is not what this code writes there: not a regular file, not text, not its
    record. `problem` says what is wrong with it; the message adds the fix."""

    def __init__(self, path: Path, problem: str, fix: str | None = None) -> None:
        self.path, self.problem, self.fix = Path(path), problem, fix
        fix = fix or (f"A run folder holds only the files this code writes: delete it ({removal(self.path)}), or "
                      f"move the run folder {self.path.parent} away to train the run again")
        super().__init__(f"{path}: {problem}. {fix}.")

    def __reduce__(self):  # pickled (distributed.agree sends it to the other ranks) by what builds it again
        return type(self), (self.path, self.problem, self.fix)

    def detail(self, run_folder: Path) -> str:
        """`result.json: a folder, not a file`: the file (by its path in `run_folder` when it is there) and its
        problem, for the status's row."""
        name = self.path.relative_to(run_folder) if self.path.is_relative_to(run_folder) else self.path
        return f"{name}: {self.problem}"


def kind_of(mode: int) -> str:
    """What a file of `mode` (os.stat's st_mode) is, in words: `a folder`, `a FIFO (named pipe)`, ..."""
    return next((kind for test, kind in KINDS if test(mode)), "not a regular file")


def removal(path: Path) -> str:
    """The command that removes `path`: rm, or rm -r for a folder."""
    return f"rm {'-r ' if path.is_dir() else ''}'{path}'"


def not_a_file(path: Path) -> str | None:
    """What `path` is when it exists but is no regular file (`a folder, not a file`), else None (a file, or none)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(mode) else f"{kind_of(mode)}, not a file"


MAX_RECORD_BYTES = 16 << 20  # a record of a run folder (JSON, YAML, a lock): each this code writes is a few kB


def read_bytes(path: Path, limit: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of a run folder's file, at most `limit` of them; a DamagedRecord when it is no regular file (a FIFO
    is never waited on) or larger, FileNotFoundError when there is none."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, and is refused below
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DamagedRecord(path, f"{kind_of(mode)}, not a file")
        data = handle.read(limit + 1)  # the size stat gives may change while it is read
        if len(data) > limit:
            raise DamagedRecord(path, f"larger than {limit >> 20} MB, which no record this code writes is")
        return data


def read_tail(path: Path, limit: int = 1 << 20) -> str:
    """The last `limit` bytes of a run folder's text file (a log), decoded with errors replaced."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedRecord(path, f"{kind_of(os.fstat(fd).st_mode)}, not a file")
        size = os.fstat(fd).st_size
        handle.seek(max(size - limit, 0))
        return handle.read(limit).decode(errors="replace")


def read_text(path: Path) -> str:
    """A run folder's text file (UTF-8); a DamagedRecord when it is no regular file or holds binary data."""
    try:
        return read_bytes(path).decode()
    except UnicodeDecodeError:
        raise DamagedRecord(path, "binary data, not text") from None


def read_json(path: Path) -> Any:
    """A run folder's JSON file; a DamagedRecord when it is no regular file or not JSON."""
    text = read_text(path)
    try:
        return json.loads(text)
    except RecursionError:  # json's parser recurses (and stops at Python's limit)
        raise DamagedRecord(path, "not JSON (brackets nested too deep)") from None
    except ValueError as error:
        if isinstance(error, DamagedRecord):
            raise
        raise DamagedRecord(path, f"not JSON ({type(error).__name__}: {str(error)[:80]})") from None


def read_json_mapping(path: Path, record: str) -> dict[str, Any] | None:
    """A run folder's JSON mapping (the `record` it holds, e.g. "progress record"), or None where there is none; a
    DamagedRecord when it is no regular file, not JSON or not a mapping."""
    try:
        value = read_json(path)
    except FileNotFoundError:
        return None
    if not isinstance(value, dict):
        raise DamagedRecord(path, f"a {type(value).__name__}, not {record}")
    return value


def folder_problem(path: Path) -> str | None:
    """Why a run could not create `path` or write into it (a file in the way, a read-only folder), or None."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if os.access(existing, os.W_OK | os.X_OK):  # root too: access() reports a read-only mount
        return None
    read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
    why = "read-only file system" if read_only else f"no write permission for this user (uid {os.geteuid()})"
    return f"{existing} is not writable ({why})"


MAX_NPZ_BYTES = 256 << 20  # inflated from predictions.npz: ImageNet's 50,000 images' predictions are about 0.5 MB


def read_npz(path: Path, limit: int = MAX_NPZ_BYTES, fix: str | None = None) -> dict[str, Any]:
    """The arrays of a numpy .npz file, no more than `limit` bytes inflated (a zip bomb is read no further), each
    array's header checked against its bytes before numpy allocates it, no Python object unpickled."""
    from numpy.lib import format as npy

    kind = not_a_file(path)
    if kind is not None:
        raise DamagedRecord(path, kind)
    arrays, left = {}, limit
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise ValueError(f"{info.filename[:40]} is no array")
            with archive.open(info) as handle:
                data = handle.read(left + 1)
            left -= len(data)
            if left < 0:
                raise DamagedRecord(path, f"inflates to more than {limit >> 20} MB, which no predictions file does",
                                    fix)
            buffer = io.BytesIO(data)
            version = npy.read_magic(buffer)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"npy format version {version}")
            read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, _, dtype = read_header(buffer)
            if dtype.hasobject or math.prod(shape) * dtype.itemsize != len(data) - buffer.tell():
                raise ValueError(f"{info.filename[:40]}'s header ({shape}, {dtype}) does not match its bytes")
            buffer.seek(0)
            arrays[info.filename[:-4]] = npy.read_array(buffer, allow_pickle=False)
    return arrays
