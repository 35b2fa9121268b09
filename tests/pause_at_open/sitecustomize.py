"""Test-only pause: with this folder on PYTHONPATH, DEIT_PAUSE_UNDER set to a folder and DEIT_PAUSE_DIR to another,
the first time the process opens a file under DEIT_PAUSE_UNDER for reading it creates DEIT_PAUSE_DIR/ready and waits
(at most 120 s) for DEIT_PAUSE_DIR/go before the open goes ahead. A test does what it needs in between, e.g. deletes
the folder the run is about to read. Python imports `sitecustomize` at start-up; nothing in the trainer knows."""

import os
import sys
import time

_UNDER = os.environ.get("DEIT_PAUSE_UNDER")
_DIR = os.environ.get("DEIT_PAUSE_DIR")


def _install() -> None:
    under = os.path.abspath(_UNDER) + os.sep
    done = [False]

    def hook(event: str, args: tuple) -> None:
        if done[0] or event != "open" or not isinstance(args[0], (str, os.PathLike)):
            return
        mode, flags = args[1], args[2] or 0
        reading = (mode is None or not any(c in mode for c in "wax+")) and not flags & (os.O_WRONLY | os.O_RDWR)
        if reading and os.path.abspath(os.fspath(args[0])).startswith(under):
            done[0] = True
            open(os.path.join(_DIR, "ready"), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(_DIR, "go")) and time.monotonic() < deadline:
                time.sleep(0.01)

    sys.addaudithook(hook)


if _UNDER and _DIR:
    _install()
