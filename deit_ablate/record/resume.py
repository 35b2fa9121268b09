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
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deit_ablate.core.errors import ConfigError
from deit_ablate.core.logs import log
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
            kind = "tensor" if isinstance(value, _Opaque) else type(value).__name__
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


class _Opaque:
    """A tensor, storage or other torch object of a peeked pickle: stands in for it, holds nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _StateDict(dict):
    """An OrderedDict of a peeked pickle (a module's state_dict, with its `_metadata` set by BUILD)."""


# Bounds of a peeked data.pkl, far above what any training state needs (a CaiT-M48 training state's data.pkl is
# 0.3 MB, about 110,000 opcodes, nesting 7 deep): a crafted file is refused, never read without end.
MAX_PICKLE_BYTES = 4 << 20  # inflated from the archive: a zip bomb is read no further
MAX_OBJECTS = 1 << 19  # values and containers made
MAX_MEMO = 1 << 19  # memo entries, and the highest memo index
MAX_DEPTH = 32  # containers nested in containers
MAX_INT_BYTES = 16  # a LONG1/LONG4 integer's bytes
MAX_COUNT = 10 ** 12  # a step, an epoch or a batch count: a plain int from 0 to this
_MARK = object()


class PeekRefused(Exception):
    """A peeked pickle holds what a training state never does, or more than the bounds allow."""


class _Peeker:
    """Reads a torch.save archive's data.pkl with its own bounded interpreter of the pickle opcodes torch.save
    writes (protocols 2 to 5): plain values, tuples, lists, dicts, OrderedDicts and torch's own names, each an
    opaque stand-in. Nothing the file names is called; every length, index, count and depth is bounded."""

    def __init__(self, data: bytes, records: set[str], prefix: str) -> None:
        self.data, self.pos, self.records, self.prefix = data, 0, records, prefix
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.depth: dict[int, int] = {}  # id -> nesting depth of each container made (kept alive in self.made)
        self.made: list[Any] = []  # every container made: alive until the end, so that no id is used twice
        self.count = 0
        self.placed: set[int] = set()  # containers already inside another: never changed after (depth stays true)

    # --- reading the opcode stream
    def take(self, n: int) -> bytes:
        """The next `n` bytes: a length declared beyond the pickle's end is refused, never allocated."""
        start = self.pos
        if start + n > len(self.data):
            raise PeekRefused(f"a value of {n} bytes where {len(self.data) - start} remain (truncated or forged)")
        self.pos = start + n
        return self.data[start:start + n]

    def uint(self, n: int) -> int:
        """The next `n` bytes as an unsigned little-endian integer."""
        if n == 1 and self.pos < len(self.data):
            self.pos += 1
            return self.data[self.pos - 1]
        return int.from_bytes(self.take(n), "little")

    def text(self, n: int) -> str:
        return self.take(n).decode("utf-8", "surrogatepass")

    # --- bounded construction
    def make(self, value: Any, children: Any = ()) -> Any:
        """Count `value`, a new object; a container gets the depth of its deepest child plus one."""
        self.count += 1
        if self.count > MAX_OBJECTS:
            raise PeekRefused(f"more than {MAX_OBJECTS} values")
        if isinstance(value, (tuple, list, dict)):
            self.made.append(value)
            self.depth[id(value)] = 1
            self.nest(value, children)
        return value

    def nest(self, parent: Any, children: Any) -> None:
        """Place `children` in the container `parent`: its depth grows with theirs, up to MAX_DEPTH."""
        deepest = self.depth[id(parent)]
        for child in children:
            below = self.depth.get(id(child))
            if below is not None:
                self.placed.add(id(child))
                deepest = max(deepest, below + 1)
        if deepest > MAX_DEPTH:
            raise PeekRefused(f"containers nested more than {MAX_DEPTH} deep")
        self.depth[id(parent)] = deepest

    def mutable(self, target: Any, kind: type) -> Any:
        if not isinstance(target, kind) or id(target) in self.placed or id(target) not in self.depth:
            raise PeekRefused(f"an item added to a {type(target).__name__}")
        return target

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise PeekRefused("an opcode with no mark before it")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def pop(self) -> Any:
        if not self.stack:
            raise PeekRefused("an empty stack popped")
        return self.stack.pop()

    def put(self, index: int) -> None:
        if index >= MAX_MEMO or len(self.memo) >= MAX_MEMO:
            raise PeekRefused(f"memo index {index} beyond {MAX_MEMO}")
        if not self.stack:
            raise PeekRefused("an empty stack memoized")
        self.memo[index] = self.stack[-1]

    def get(self, index: int) -> None:
        if index not in self.memo:
            raise PeekRefused(f"memo index {index} never set")
        self.stack.append(self.memo[index])

    def global_(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return _StateDict
        if module == "torch" or module.startswith("torch."):
            return _Opaque
        raise PeekRefused(f"unsupported global {module[:60]}.{name[:60]} (only tensors and plain values are read)")

    def call(self, func: Any, args: Any) -> Any:
        if not isinstance(args, tuple):
            raise PeekRefused("a call whose arguments are no tuple")
        if func is _Opaque:
            return self.make(_Opaque())
        if func is _StateDict and not args:
            return self.make(_StateDict())
        raise PeekRefused("a call of what a training state never calls")

    def persistent(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[2], str)):
            raise PeekRefused("an unsupported persistent id (not a tensor storage)")
        if f"{self.prefix}{pid[2]}" not in self.records:
            raise PeekRefused(f"storage {pid[2][:40]} is missing from the archive")
        return self.make(_Opaque())

    def load(self) -> Any:
        """The pickled value; PeekRefused for anything beyond a training state's opcodes, types and bounds."""
        data, take, uint = self.data, self.take, self.uint
        while True:
            stack = self.stack
            if self.pos >= len(data):
                raise PeekRefused("the pickle ends before its STOP (truncated)")
            op = data[self.pos]
            self.pos += 1
            if op == 0x71:  # BINPUT
                self.put(uint(1))
            elif op == 0x68:  # BINGET
                self.get(uint(1))
            elif op == 0x28:  # MARK
                if len(self.marks) >= MAX_DEPTH:
                    raise PeekRefused(f"marks nested more than {MAX_DEPTH} deep")
                self.marks.append(stack)
                self.stack = []
            elif op == 0x4B:  # BININT1
                stack.append(uint(1))
            elif op in (0x58, 0x8C, 0x8D):  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                stack.append(self.make(self.text(uint(4 if op == 0x58 else 1 if op == 0x8C else 8))))
            elif op in (0x85, 0x86, 0x87, 0x74):  # TUPLE1, TUPLE2, TUPLE3, TUPLE
                if op == 0x74:
                    items = tuple(self.pop_mark())
                else:
                    n = op - 0x84
                    if len(stack) < n:
                        raise PeekRefused("a tuple of more items than the stack holds")
                    items = tuple(stack[-n:])
                    del stack[-n:]
                self.stack.append(self.make(items, items))
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op in (0x72, 0x94):  # LONG_BINPUT, MEMOIZE
                self.put(uint(4) if op == 0x72 else len(self.memo))
            elif op == 0x6A:  # LONG_BINGET
                self.get(uint(4))
            elif op == 0x4D:  # BININT2
                stack.append(uint(2))
            elif op == 0x4A:  # BININT
                stack.append(self.make(int.from_bytes(take(4), "little", signed=True)))
            elif op in (0x8A, 0x8B):  # LONG1, LONG4
                n = uint(1 if op == 0x8A else 4)
                if n > MAX_INT_BYTES:
                    raise PeekRefused(f"an integer of {n} bytes")
                stack.append(self.make(int.from_bytes(take(n), "little", signed=True)))
            elif op == 0x47:  # BINFLOAT
                stack.append(self.make(struct.unpack(">d", take(8))[0]))
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op in (0x88, 0x89):  # NEWTRUE, NEWFALSE
                stack.append(op == 0x88)
            elif op in (0x42, 0x43, 0x8E):  # BINBYTES, SHORT_BINBYTES, BINBYTES8
                stack.append(self.make(take(uint(4 if op == 0x42 else 1 if op == 0x43 else 8))))
            elif op == 0x63:  # GLOBAL: module and name, each a line
                module = self.line()
                stack.append(self.global_(module, self.line()))
            elif op == 0x93:  # STACK_GLOBAL
                name, module = self.pop(), self.pop()
                if not (isinstance(module, str) and isinstance(name, str)):
                    raise PeekRefused("a global named by no string")
                stack.append(self.global_(module, name))
            elif op == 0x5D:  # EMPTY_LIST
                stack.append(self.make([]))
            elif op == 0x7D:  # EMPTY_DICT
                stack.append(self.make({}))
            elif op == 0x6C:  # LIST
                items = self.pop_mark()
                self.stack.append(self.make(items, items))
            elif op in (0x61, 0x65):  # APPEND, APPENDS
                items = [self.pop()] if op == 0x61 else self.pop_mark()
                target = self.mutable(self.stack[-1] if self.stack else None, list)
                self.nest(target, items)
                target.extend(items)
            elif op in (0x73, 0x75):  # SETITEM, SETITEMS
                items = [self.pop(), self.pop()][::-1] if op == 0x73 else self.pop_mark()
                target = self.mutable(self.stack[-1] if self.stack else None, dict)
                if len(items) % 2:
                    raise PeekRefused("a dict item without its value")
                self.nest(target, items)
                for key, value in zip(items[::2], items[1::2], strict=True):
                    if isinstance(key, (list, dict)):
                        raise PeekRefused("a dict key that is a container")
                    target[key] = value
            elif op in (0x52, 0x81):  # REDUCE, NEWOBJ
                args, func = self.pop(), self.pop()
                self.stack.append(self.call(func, args))
            elif op == 0x62:  # BUILD: an object's state (a state_dict's _metadata), kept by none
                self.pop()
                if not stack or not isinstance(stack[-1], (_Opaque, _StateDict)):
                    raise PeekRefused("a state set on a plain value")
            elif op == 0x51:  # BINPERSID
                stack.append(self.persistent(self.pop()))
            elif op == 0x30:  # POP
                self.pop()
            elif op == 0x80:  # PROTO
                if uint(1) > 5:
                    raise PeekRefused("a pickle protocol above 5")
            elif op == 0x95:  # FRAME: its length, then opcodes as usual
                uint(8)
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or self.marks:
                    raise PeekRefused("a pickle that does not end on one value")
                return stack[0]
            else:
                raise PeekRefused(f"opcode {bytes([op])!r}, which torch.save never writes")

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + 256)
        if end < 0:
            raise PeekRefused("a global's name longer than 256 bytes")
        return self.text(end - self.pos + 1)[:-1]


def read_pickle(archive: zipfile.ZipFile, name: str) -> bytes:
    """The archive's `name`, inflated to at most MAX_PICKLE_BYTES (a highly compressed bomb is read no further)."""
    with archive.open(name) as handle:
        data = handle.read(MAX_PICKLE_BYTES + 1)
    if len(data) > MAX_PICKLE_BYTES:
        raise PeekRefused(f"{name} inflates to more than {MAX_PICKLE_BYTES >> 20} MB (a training state's is well "
                          "under 1 MB)")
    return data


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
                state = _Peeker(read_pickle(archive, pickles[0]), set(names), prefix).load()
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
