"""Test-only write audit: with this folder on PYTHONPATH and DEIT_WRITE_AUDIT set to a folder, every Python
process records which files it creates, writes, renames or removes under DEIT_WRITE_AUDIT_UNDER, one line
per write: `<rank> <host> <event> <path>` (rank from SLURM_PROCID / RANK, `-` for the submitting process).
Python imports `sitecustomize` at start-up, so each rank of a SLURM or torchrun job audits itself."""

import os
import socket
import sys

_AUDIT_DIR = os.environ.get("DEIT_WRITE_AUDIT")
_UNDER = os.path.abspath(os.environ.get("DEIT_WRITE_AUDIT_UNDER", "/"))
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _install() -> None:
    record = open(os.path.join(_AUDIT_DIR, f"{socket.gethostname()}-{os.getpid()}.txt"), "a", buffering=1)
    busy = [False]

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        if event == "open":
            path, mode, flags = args
            writing = bool(mode and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        elif event in ("os.rename", "os.replace"):
            path, writing = args[1], True
        elif event in ("os.remove", "os.mkdir", "os.rmdir"):
            path, writing = args[0], True
        else:
            return
        if not writing or not isinstance(path, (str, os.PathLike)):
            return
        path = os.path.abspath(os.fspath(path))
        if not path.startswith(_UNDER):
            return
        busy[0] = True
        try:
            rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "-"
            record.write(f"{rank} {socket.gethostname()} {event} {path}\n")
        finally:
            busy[0] = False

    sys.addaudithook(hook)


if _AUDIT_DIR:
    _install()
