"""The one way this project replaces a file: write a temp file beside it, flush it to disk, rename it into place.

A reader, or a relaunch after a kill at any instant, sees the old file or the whole new one, never half of one;
a failed write removes its temp file and leaves the old file as it was. A full disk is a RunError that names the
file, the free space there and what to do. The temp file is `.<name>.<random>.tmp` beside the target (unique, so
two processes writing one shared file never mix their bytes) unless the caller names one (`temp`): a run folder's
own files have one writer, its lock holder, and RunDir names their temp files (rundir.TEMP_PATTERNS finds them).
A folder is made the same way (atomic_folder): filled under a hidden staging name beside it, then renamed.
Temp files and staging folders are created with the modes the umask (or the folder's default ACL) gives, 0644 and
0755 under umask 022, 0664 and 0775 under 002, as open() and mkdir() would: not mkstemp's 0600 and mkdtemp's 0700,
which kept checkpoints, metrics.csv and the built-in data from a teammate in the same group.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from deit_ablate.core.errors import RunError

Writer = Callable[[IO[bytes]], None]


def _human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def no_space_error(path: Path, written: int | None = None) -> RunError:
    """The message for a full disk: the file, the free space there, what is intact and what to do."""
    usage = shutil.disk_usage(path.parent)
    needed = f" (the write stopped at {_human_bytes(written)})" if written else ""
    intact = (f"The previous {path.name} is intact, so nothing before it is lost. " if path.exists() else "")
    return RunError(f"no space left on the device while writing {path}{needed}: {_human_bytes(usage.free)} free of "
                    f"{_human_bytes(usage.total)} there now. {intact}Free some space (or point runtime.output_root "
                    "elsewhere) and launch the same command again: the run resumes from its last checkpoint.")


def is_no_space(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is ENOSPC (torch.save wraps the OSError of its write)."""
    for _ in range(4):
        if error is None:
            return False
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        error = error.__cause__ or error.__context__
    return False


def create_unique(parent: Path, prefix: str, suffix: str, create: Callable[[Path], Any]) -> tuple[Path, Any]:
    """`create(path)` at a new name `<prefix><random><suffix>` in `parent` (it must raise FileExistsError for a name
    taken, as O_EXCL and mkdir do); the path and what `create` returned."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            return path, create(path)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name {prefix}*{suffix} in {parent}")


def _open_temp(path: Path, temp: Path | None) -> tuple[IO[bytes], Path]:
    """The temp file to write, open for writing: `temp` when given, else a new unique one beside `path` (mode 0666
    less the umask, as open() makes a file)."""
    if temp is not None:
        return open(temp, "wb"), temp  # noqa: SIM115 (closed by atomic_write)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    name, fd = create_unique(path.parent, f".{path.name}.", ".tmp", lambda new: os.open(new, flags, 0o666))
    return os.fdopen(fd, "wb"), name


def _is_stream(path: Path) -> bool:
    """Whether `path` is an existing device, pipe or socket: there is no file to replace (as root, a rename onto
    /dev/null would replace the device with a regular file)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _size(path: Path | None) -> int | None:
    try:
        return path.stat().st_size if path is not None else None
    except OSError:
        return None


def atomic_write(path: str | os.PathLike, write: Writer, *, keep_previous: str | os.PathLike | None = None,
                 temp: str | os.PathLike | None = None, exclusive: bool = False) -> None:
    """Replace `path` with what `write` writes into the open (binary) temp file, all or nothing.

    `keep_previous`: rename the old file there first (one older good copy). `exclusive`: create `path` only if it
    does not exist (a hard link, atomic on local disks, NFS and Lustre), else FileExistsError; an OSError where the
    file system has no hard links."""
    path = Path(path)
    if _is_stream(path):  # /dev/null, a pipe, a terminal: written through, never replaced by a file
        with open(path, "wb") as handle:
            write(handle)
        return
    tmp: Path | None = None
    try:
        handle, tmp = _open_temp(path, Path(temp) if temp is not None else None)
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if exclusive:
            os.link(tmp, path)
            tmp.unlink()
            return
        if keep_previous is not None and path.exists():
            os.replace(path, keep_previous)
        os.replace(tmp, path)
    except BaseException as error:
        written = _size(tmp)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if is_no_space(error):
            raise no_space_error(path, written) from None
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes, **options: Any) -> None:
    """atomic_write of `data` (options as atomic_write's)."""
    atomic_write(path, lambda handle: handle.write(data), **options)


def write_text_atomic(path: str | os.PathLike, text: str, **options: Any) -> None:
    """atomic_write of `text` as UTF-8 (options as atomic_write's)."""
    write_bytes_atomic(path, text.encode("utf-8"), **options)


def write_json_atomic(path: str | os.PathLike, payload: Any, indent: int | None = 2, **options: Any) -> None:
    """atomic_write of `payload` as JSON (options as atomic_write's)."""
    write_text_atomic(path, json.dumps(payload, indent=indent), **options)


def write_figure_atomic(path: str | os.PathLike, figure: Any, format: str = "png", **options: Any) -> None:
    """atomic_write of a matplotlib Figure: savefig into the temp file beside `path`, then the rename (options as
    atomic_write's)."""
    atomic_write(path, lambda handle: figure.savefig(handle, format=format), **options)


def no_space_folder_error(target: Path, doing: str, room: str) -> RunError:
    """The message for a full disk while a folder is filled: the folder, the free space there, what to do."""
    existing = next(p for p in (target, *target.parents) if p.exists())
    usage = shutil.disk_usage(existing)
    return RunError(f"no space left on the device while {doing} {target}: {_human_bytes(usage.free)} free of "
                    f"{_human_bytes(usage.total)} there now, and nothing of the folder was kept. Free some space"
                    f"{room} and launch the same command again.")


def atomic_folder(target: str | os.PathLike, fill: Callable[[Path], None], complete: Callable[[], bool],
                  doing: str = "writing the folder", room: str = "") -> Path:
    """Make the folder `target` whole or not at all: `fill` a hidden staging folder beside it, then rename that into
    place. An incomplete `target` from an earlier attempt is replaced; one that another process completed meanwhile
    (`complete()` true once the rename fails) is kept. The staging folder never outlives the call. A full disk is a
    RunError naming the folder (`doing` it: what was under way; `room`: where else the folder could go)."""
    target = Path(target)
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging, _ = create_unique(target.parent, f".{target.name}-", "", lambda new: new.mkdir(0o777))  # less umask
        fill(staging)
        if target.exists() and not complete():
            shutil.rmtree(target)  # an incomplete or outdated earlier attempt
        try:
            os.rename(staging, target)
        except OSError:
            if not complete():  # lost a race only if the other process finished the same folder
                raise
    except OSError as error:
        if is_no_space(error):
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)  # first, so that the message tells the space there is
            raise no_space_folder_error(target, doing, room) from None
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return target
