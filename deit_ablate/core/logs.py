"""The run's own log: one logger for the console (Hydra's job logging, conf/hydra/job_logging/deit.yaml) and
the run folder's train.log (train-rank<N>.log for the other ranks), with library warnings in both."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("deit_ablate")
file_only = logging.getLogger("deit_ablate.file_only")  # what the run's file records beyond the console
file_only.propagate = False
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class BelowLevel(logging.Filter):
    """Pass records below `level` (the console's stdout side; warnings go to stderr)."""

    def __init__(self, level: int | str = logging.WARNING) -> None:
        super().__init__()
        self.level = logging.getLevelName(level) if isinstance(level, str) else level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class RunFileHandler(logging.FileHandler):
    """A FileHandler that says once, in one line, that it cannot write (a full disk), instead of a traceback
    per record."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            print(f"warning: cannot write to {self.baseFilename} ({error}); the console keeps the log", file=sys.stderr)


def attach_run_log(path: Path) -> logging.Handler:
    """Append everything logged from now on (ours, libraries', Python warnings) to `path`, this rank's log file
    (RunDir.rank_log)."""
    handler = RunFileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    logging.getLogger().addHandler(handler)
    file_only.addHandler(handler)
    logging.captureWarnings(True)
    if log.getEffectiveLevel() > logging.INFO:  # outside Hydra's job logging (a test calling run() directly)
        log.setLevel(logging.INFO)
    return handler


def detach_run_log(handler: logging.Handler) -> None:
    """Stop writing to the run's file (the next run of a sweep in this process gets its own)."""
    logging.getLogger().removeHandler(handler)
    file_only.removeHandler(handler)
    handler.close()


POSTFIX_NAMES = {"img_s": "img/s"}  # a tqdm postfix key as a plain line says it
PLAIN_EVERY_S = 10.0  # where stderr is a file: at most one progress line per this many seconds (and each bar's end)


def on_terminal(stream=None) -> bool:
    """Whether `stream` (stderr by default) is a terminal, where a progress bar can redraw itself in place."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    """3725 -> '1:02:05'."""
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class PlainBar:
    """tqdm's interface (iterate, update, set_postfix, close) for a log file: plain lines on stderr, never `\\r`.

    A line says where the bar is (`epoch 3: step 120/1251`), its postfix (loss, lr, img/s) and the ETA; it is
    written at the first postfix, then at most every `every_s` seconds, and once at the end."""

    def __init__(self, iterable=None, total: int | None = None, desc: str = "", disable: bool = False,
                 every_s: float = PLAIN_EVERY_S, stream=None) -> None:
        self.iterable, self.desc, self.disable, self.every_s = iterable, desc, disable, every_s
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.stream, self.n, self.postfix = stream, 0, ""
        self.started, self.shown_at = time.monotonic(), None

    def __iter__(self):
        for item in self.iterable:
            self.n += 1  # the item under way counts: a line during step k says k
            yield item

    def update(self, n: int = 1) -> None:
        self.n += n
        self._show()

    def set_postfix(self, **fields: object) -> None:
        self.postfix = " | ".join(f"{POSTFIX_NAMES.get(k, k)} {v}" for k, v in fields.items())
        self._show()

    def line(self) -> str:
        """`epoch 0: step 12/39 | loss 2.301 | lr 1.00e-03 | img/s 250 | ETA 0:00:10`."""
        seconds = time.monotonic() - self.started
        of = f"/{self.total}" if self.total else ""
        eta = (f" | ETA {_clock(seconds / self.n * (self.total - self.n))}" if self.total and self.n
               and self.n < self.total else f" | took {_clock(seconds)}" if self.total and self.n >= self.total
               else "")
        return f"{self.desc}: step {self.n}{of}" + (f" | {self.postfix}" if self.postfix else "") + eta

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.disable or not (force or self.shown_at is None or now - self.shown_at >= self.every_s):
            return
        self.shown_at = now
        print(self.line(), file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        if self.n:
            self._show(force=True)


def progress_bar(iterable=None, **options):
    """A tqdm bar in a terminal; elsewhere (a log file, a pipe) a PlainBar of plain lines (tqdm's options that
    only draw a bar are dropped)."""
    if on_terminal():
        from tqdm import tqdm

        return tqdm(iterable, **options)
    kept = {k: options[k] for k in ("total", "desc", "disable") if k in options}
    return PlainBar(iterable, **kept)
