"""Where a run folder stands for a relaunch: its result, the checkpoint it resumes from and that checkpoint's step,
and what a launch would do with the folder alone (skip, resume, train). No torch here: `deit-status` on an output
root and the dry run read this for every run of a sweep, on every refresh.

A checkpoint's step is read from its pickle without torch (peek_training_state): torch.save writes a zip archive
whose `data.pkl` names every tensor by a storage record in the same archive, so the scalars can be read and each
record checked without reading the tensors (a ViT-B training state is about 1 GB). Only plain values, OrderedDicts
and torch's own names (tensor rebuilders, storage types, dtypes: each an opaque stand-in) are accepted in the pickle;
any other name is refused, and nothing the file names is ever called. The pickle is read by its own interpreter of
the opcodes torch.save writes, in bounded time and memory: the bytes inflated from the archive, the values made, the
memo, the nesting depth and every declared length are bounded (MAX_*), and a step, an epoch or a batch count must be
a plain int from 0 to MAX_COUNT; a crafted file is unreadable, never a traceback or a hang.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deit_ablate.core.errors import ConfigError
from deit_ablate.core.logs import log
from deit_ablate.record.pickle_peek import Opaque, Peeker, PeekRefused, read_pickle
from deit_ablate.record.rundir import RunDir
from deit_ablate.record.runfiles import DamagedRecord, not_a_file

RESUME_KEYS = ("model", "optimizer", "scheduler", "epoch", "step")  # what every training state holds


class CheckpointUnreadable(ConfigError):
    """A checkpoint file that cannot be read (truncated, damaged, not a checkpoint, or unsafe to unpickle)."""

    def __init__(self, path: Path, reason: str, source: str = "checkpoint") -> None:
        self.path, self.reason, self.source = path, reason, source
        named = source if str(path) in source else f"{source} {path}"
        super().__init__(f"{named} cannot be read: {reason}. It is truncated or damaged, not a PyTorch or "
                         "safetensors checkpoint, or holds objects other than tensors and plain values (which are "
                         "never unpickled here). Re-save or copy it again from a good source.")

    def __reduce__(self):  # pickled (distributed.agree sends it to the other ranks) by what builds it again
        return type(self), (self.path, self.reason, self.source)


def unreadable_reason(error: BaseException) -> str:
    """A short reason from torch's error, without its advice to turn safe loading off."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not line or "weights_only" in line:
        line = "no readable data"
    return f"{type(error).__name__}: {line[:200]}"


def load(path: str | os.PathLike, source: str = "checkpoint") -> dict[str, Any]:
    """Read a checkpoint on the CPU without unpickling arbitrary objects; CheckpointUnreadable if it cannot be."""
    import torch  # here, not at the top: the status and the dry run read steps without it (peek_training_state)

    kind = not_a_file(Path(path))
    if kind is not None:  # a FIFO would block the reader
        raise CheckpointUnreadable(Path(path), kind, source)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError,
            AttributeError, ImportError, OSError, OverflowError, MemoryError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise CheckpointUnreadable(Path(path), unreadable_reason(error), source) from None


@dataclass
class ResumePoint:
    """The checkpoint a relaunch continues from, and the newer ones it could not read."""

    path: Path
    state: dict[str, Any]
    unreadable: list[CheckpointUnreadable] = field(default_factory=list)


MAX_COUNT = 10 ** 12  # a step, an epoch or a batch count: a plain int from 0 to this
COUNTS = ("epoch", "step", "batches_done")  # what a training state counts: each a plain int from 0 to MAX_COUNT


def state_problem(state: Any) -> str | None:
    """What makes `state` no training state written by checkpoint.training_state() (a key missing, a step that is
    "2x", NaN, a tensor or 10^5000, a best top-1 that is no finite number), or None."""
    if not isinstance(state, dict) or any(key not in state for key in RESUME_KEYS):
        keys = sorted(k for k in state if isinstance(k, str))[:8] if isinstance(state, dict) else type(state).__name__
        return f"not a training state (holds {keys})"
    for key in COUNTS:
        value = state.get(key, 0)
        if type(value) is not int:
            kind = "tensor" if isinstance(value, Opaque) else type(value).__name__
            return f"its {key} is a {kind}, not a whole number"
        if not 0 <= value <= MAX_COUNT:
            return f"its {key} is out of range (0 to {MAX_COUNT})"
    best = state.get("best_top1", 0.0)
    if type(best) not in (int, float) or not math.isfinite(best):
        return f"its best_top1 is {'not finite' if isinstance(best, float) else f'a {type(best).__name__}'}"
    return None


def checked_training_state(path: Path, state: Any) -> dict[str, Any]:
    """`state` when it is a training state written by checkpoint.training_state(), else CheckpointUnreadable."""
    problem = state_problem(state)
    if problem is not None:
        raise CheckpointUnreadable(path, problem)
    return state


class NoReadableCheckpoint(ConfigError):
    """A run folder with checkpoints, none of which can be read: the message names them and what to delete."""

    def __init__(self, message: str, detail: str) -> None:
        self.detail = detail  # `checkpoint-last.pt: a FIFO (named pipe), not a file`, for the status's row
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.detail)


def find_resume_point(run_dir: Path, read: Callable[[Path], dict[str, Any]]) -> ResumePoint | None:
    """The newest checkpoint of a run folder `read` can read (last, then the copy before it); None for a fresh
    run. A ConfigError naming the files and what to delete when there are checkpoints but none can be read."""
    unreadable = []
    for path in (RunDir(run_dir).last_checkpoint, RunDir(run_dir).previous_checkpoint):
        if not path.exists():
            continue
        kind = not_a_file(path)
        if kind is not None:  # never opened: a FIFO would block the reader
            unreadable.append(CheckpointUnreadable(path, kind))
            continue
        try:
            return ResumePoint(path, read(path), unreadable)
        except CheckpointUnreadable as error:
            unreadable.append(error)
    if not unreadable:
        return None
    reasons = "; ".join(f"{error.path.name}: {error.reason}" for error in unreadable)
    paths = " ".join(f"'{error.path}'" for error in unreadable)
    folders = "-r " if any(error.path.is_dir() for error in unreadable) else ""
    raise NoReadableCheckpoint(f"the run in {run_dir} cannot resume: no checkpoint there can be read ({reasons}). To "
                               f"train the run again from the start, delete them (rm {folders}{paths}) and launch the "
                               "same command again.", reasons)


def peek_training_state(path: Path) -> dict[str, Any] | None:
    """A training state's plain values (its step, epoch, ...; tensors stand in opaque), read without torch and
    without its tensors, in bounded time and memory; None for a file that is not a zip archive (an old torch format:
    checkpoint.load reads it). CheckpointUnreadable for a truncated, damaged or crafted archive, or one that is not a
    training state."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        with open(path, "rb") as handle:
            if handle.read(1) == b"\x80":  # a pickle: torch.save's format before torch 1.6
                return None
        raise CheckpointUnreadable(path, "not a whole zip archive (truncated or damaged)") from None
    except (ValueError, OverflowError, OSError) as error:  # a central directory whose numbers are forged
        if isinstance(error, FileNotFoundError):
            raise
        raise CheckpointUnreadable(path, f"not a whole zip archive ({type(error).__name__})") from None
    try:
        with archive:
            names = archive.namelist()
            pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise CheckpointUnreadable(path, "no data.pkl in the archive: not a torch.save file")
            prefix = pickles[0].rsplit("/", 1)[0] + "/data/"
            collecting = gc.isenabled()
            gc.disable()  # the peek makes thousands of containers and frees them all at once: no collection between
            try:
                state = Peeker(read_pickle(archive, pickles[0]), set(names), prefix).load()
            finally:
                if collecting:
                    gc.enable()
            return checked_training_state(path, state)
    except (PeekRefused, zipfile.BadZipFile, EOFError, ValueError, KeyError, IndexError, TypeError,
            AttributeError, OverflowError, NotImplementedError, zlib.error, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise CheckpointUnreadable(path, f"{type(error).__name__}: {str(error)[:200]}") from None


def _step_reader(path: Path) -> dict[str, Any]:
    """A checkpoint's training state for its step: peeked, or read whole for an old-format file."""
    state = peek_training_state(path)
    return state if state is not None else checked_training_state(path, load(path))


@dataclass(frozen=True)
class LaunchAction:
    """What launching a run would do now: `kind` (one of ACTIONS) and the dry run's words for it; a skip carries the
    result it skips (read once: the status shows it), a resume the step it resumes from."""

    kind: str
    text: str
    result: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    resume_step: int | None = None  # a resume's: the step of the checkpoint it continues from


ACTIONS = ("skip", "wait", "record", "refuse", "resume", "train")


def previous_result(run_dir: RunDir, is_main: bool) -> dict[str, Any] | None:
    """The run's result.json when it holds one; a damaged one is reported and the run counts as unfinished. One that
    is no regular file (a folder, a FIFO) is a DamagedRecord: nothing a run writes can replace it."""
    try:
        return run_dir.read_result()
    except DamagedRecord as error:
        if not_a_file(run_dir.result) is not None:
            raise
        if is_main:
            log.warning(f"[run] {error.path} is {error.problem}. Treated as unfinished: the run resumes and writes it "
                        "again.")
        return None


def skip_action(result: dict[str, Any]) -> LaunchAction:
    """The launch action of a run that holds its result."""
    return LaunchAction("skip", f"skip (already {result['status']})", result)


def folder_action(run_dir: RunDir, train_text: str = "train from step 0",
                  result: dict[str, Any] | None = None) -> LaunchAction:
    """What a launch does with the run folder alone (no run it starts from to wait for): skip its result (`result`
    when read already), resume its checkpoint, or train."""
    result = result if result is not None else previous_result(run_dir, is_main=False)
    if result is not None:
        return skip_action(result)
    point = find_resume_point(run_dir.path, _step_reader)
    if point is not None:
        step = point.state["step"]
        return LaunchAction("resume", f"resume from step {step} ({point.path.name})", resume_step=int(step))
    return LaunchAction("train", train_text)
