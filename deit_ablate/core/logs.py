"""The run's own log: one logger for the console (Hydra's job logging, conf/hydra/job_logging/deit.yaml) and
the run folder's train.log (train-rank<N>.log for the other ranks), with library warnings in both."""

from __future__ import annotations

import logging
import sys
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
