"""Test-only pause: with this folder on PYTHONPATH, DEIT_PAUSE_WRITE set to part of a file name and DEIT_PAUSE_DIR to
a folder, the first time the process opens a file whose name holds DEIT_PAUSE_WRITE for writing, the open's own
truncation of an existing file is done first (where the interrupt of a write that replaces a file in place would
find it), then DEIT_PAUSE_DIR/ready is created and the open waits (at most 120 s) for DEIT_PAUSE_DIR/go. A test sends
SIGINT in between. Python imports `sitecustomize` at start-up; nothing in the commands knows."""

import os
import sys
import time

_NAME = os.environ.get("DEIT_PAUSE_WRITE")
_DIR = os.environ.get("DEIT_PAUSE_DIR")


def _install() -> None:
    done = [False]

    def hook(event: str, args: tuple) -> None:
        if done[0] or event != "open" or not isinstance(args[0], (str, os.PathLike)):
            return
        path, mode, flags = os.fspath(args[0]), args[1], args[2] or 0
        writing = (mode is not None and any(c in mode for c in "wax+")) or flags & (os.O_WRONLY | os.O_RDWR)
        if not writing or _NAME not in os.path.basename(path):
            return
        done[0] = True
        truncates = (mode is not None and "w" in mode) or flags & os.O_TRUNC
        if truncates and os.path.isfile(path):
            os.truncate(path, 0)
        open(os.path.join(_DIR, "ready"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(_DIR, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)

    sys.addaudithook(hook)


if _NAME and _DIR:
    _install()
