"""A bounded reader of the pickle torch.save writes: plain values, OrderedDicts and torch's own names (each an opaque
stand-in), never calling anything the file names, within bounds on the bytes inflated, the values, the memo and the
depth; what a run's step is peeked with (resume.peek_training_state)."""

from __future__ import annotations

import struct
import zipfile
from typing import Any


class Opaque:
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
_MARK = object()


# framing, tuples, lists, dicts, globals and BUILD: Peeker.structure
STRUCTURE_OPS = frozenset((0x30, 0x80, 0x95, 0x85, 0x86, 0x87, 0x74, 0x63, 0x93, 0x5D, 0x7D, 0x6C, 0x61, 0x65, 0x73,
                           0x75, 0x62))


class PeekRefused(Exception):
    """A peeked pickle holds what a training state never does, or more than the bounds allow."""


class Peeker:
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
            return Opaque
        raise PeekRefused(f"unsupported global {module[:60]}.{name[:60]} (only tensors and plain values are read)")

    def call(self, func: Any, args: Any) -> Any:
        if not isinstance(args, tuple):
            raise PeekRefused("a call whose arguments are no tuple")
        if func is Opaque:
            return self.make(Opaque())
        if func is _StateDict and not args:
            return self.make(_StateDict())
        raise PeekRefused("a call of what a training state never calls")

    def persistent(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[2], str)):
            raise PeekRefused("an unsupported persistent id (not a tensor storage)")
        if f"{self.prefix}{pid[2]}" not in self.records:
            raise PeekRefused(f"storage {pid[2][:40]} is missing from the archive")
        return self.make(Opaque())

    def load(self) -> Any:
        """The pickled value; PeekRefused for anything beyond a training state's opcodes, types and bounds."""
        data, take, uint = self.data, self.take, self.uint
        while True:
            stack = self.stack
            if self.pos >= len(data):
                raise PeekRefused("the pickle ends before its STOP (truncated)")
            op = data[self.pos]
            self.pos += 1
            if op in STRUCTURE_OPS:
                self.structure(op)
            elif op == 0x71:  # BINPUT
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
            elif op in (0x52, 0x81):  # REDUCE, NEWOBJ
                args, func = self.pop(), self.pop()
                self.stack.append(self.call(func, args))
            elif op == 0x51:  # BINPERSID
                stack.append(self.persistent(self.pop()))
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or self.marks:
                    raise PeekRefused("a pickle that does not end on one value")
                return stack[0]
            else:
                raise PeekRefused(f"opcode {bytes([op])!r}, which torch.save never writes")

    def structure(self, op: int) -> None:
        """The opcodes of framing and those that build tuples, lists, dicts and named objects (STRUCTURE_OPS)."""
        stack = self.stack
        if op == 0x30:  # POP
            self.pop()
        elif op == 0x80:  # PROTO
            if self.uint(1) > 5:
                raise PeekRefused("a pickle protocol above 5")
        elif op == 0x95:  # FRAME: its length, then opcodes as usual
            self.uint(8)
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
        elif op == 0x62:  # BUILD: an object's state (a state_dict's _metadata), kept by none
            self.pop()
            if not stack or not isinstance(stack[-1], (Opaque, _StateDict)):
                raise PeekRefused("a state set on a plain value")

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
