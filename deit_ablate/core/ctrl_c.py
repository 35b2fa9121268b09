"""Ctrl-C at any moment of a command: one line and exit status 130 (`commands.INTERRUPTED`), never a traceback.

An entry point calls `take_ctrl_c` before its heavy imports (this module imports only what the interpreter has
loaded already). While the command starts (imports, configs registered) nothing is written yet, so a Ctrl-C ends the
process there and then: an interrupt raised inside a library's import or inside omegaconf (whose flag_override then
fails with an AttributeError) never surfaces. Once `working()` says the command's own work began, a Ctrl-C raises
KeyboardInterrupt, so that what is being written is left as before (core/atomic.py); `was_interrupted()` lets the
command report any error that interrupt turned into as the interrupt. A second Ctrl-C while ending is ignored.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
_state = {"name": "", "working": False, "seen": False}


def stopped_line(name: str) -> str:
    """What a command says when Ctrl-C ends it."""
    return f"{name}: stopped by Ctrl-C; files it had not finished writing keep their previous version"


def _on_ctrl_c(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # one Ctrl-C ends the command; another while it ends is ignored
    _state["seen"] = True
    if _state["working"]:
        raise KeyboardInterrupt
    try:
        sys.stderr.write(f"\n{stopped_line(_state['name'])}\n")
        sys.stderr.flush()
    finally:
        os._exit(INTERRUPTED)


def take_ctrl_c(name: str) -> None:
    """From now on, Ctrl-C ends the command `name` with one line and status 130 (at once: it is starting)."""
    _state["name"] = name
    if signal.getsignal(signal.SIGINT) is not _on_ctrl_c and not _state["seen"]:
        signal.signal(signal.SIGINT, _on_ctrl_c)


def working() -> None:
    """The command's own work begins: a Ctrl-C now raises KeyboardInterrupt where the command is."""
    _state["working"] = True


def was_interrupted() -> bool:
    """Whether a Ctrl-C came: any error after it is the interrupt's doing."""
    return bool(_state["seen"])


def taken() -> bool:
    """Whether an entry point took Ctrl-C over (take_ctrl_c)."""
    return signal.getsignal(signal.SIGINT) is _on_ctrl_c or bool(_state["seen"])
