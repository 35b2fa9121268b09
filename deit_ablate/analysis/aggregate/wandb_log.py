"""The framing of a wandb transaction log (`run-*.wandb`): 32 KiB blocks of CRC-checked chunks.

wandb 0.31 writes these files from its Go core and ships no Python reader, so the framing is decoded
here; the payload of every record is a `wandb.proto.wandb_internal_pb2.Record`, parsed with wandb's own
protobuf definitions by `reader.py`. Layout: a 7-byte file header (b":W&B", magic 0xBEE1 as little-endian
uint16, version 0), then records cut into chunks that never cross a 32 KiB block; each chunk has a 7-byte
header (CRC-32 of the type byte and data, little-endian uint32; data length, uint16; type: 1 full,
2 first, 3 middle, 4 last). A block tail shorter than a chunk header is zero padding.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from deit_ablate.record.runfiles import kind_of

BLOCK_SIZE = 32 * 1024
FILE_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
CHUNK_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}
_FULL_CRC = _TYPE_CRC[FULL]


@dataclass
class LogRead:
    """The complete records of one log file, and what stopped the read early (None: a clean end)."""

    records: list[bytes]
    problem: str | None = None
    stopped_at: int = 0  # byte offset where reading stopped
    size: int = 0
    skipped: list[int] = field(default_factory=list)  # where each record above MAX_RECORD_BYTES starts (not read)


MAX_RECORD_BYTES = 16 << 20  # one record (a run's config, a history row) is a few kB; a log may hold millions
_ZEROS_READ = 1 << 20


def _open_log(path: Path) -> BinaryIO:
    """The log file opened for reading; a ValueError naming what it is when it is no regular file (a FIFO is never
    waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{kind_of(mode)}, not a log file")
    return os.fdopen(fd, "rb")


def _zeros_to_end(handle: BinaryIO, rest: bytes) -> bool:
    """Whether `rest` and everything after it in the file are zero bytes (read a MB at a time)."""
    while rest:
        if rest.count(0) != len(rest):
            return False
        rest = handle.read(_ZEROS_READ)
    return True


def _header_problem(buf: bytes) -> str | None:
    """What is wrong with the file header at the start of `buf`, or None."""
    if len(buf) < len(FILE_HEADER):
        return f"file is {len(buf)} bytes, shorter than the log header"
    return "not a wandb transaction log (bad header)" if buf[:6] != FILE_HEADER[:6] else None


def _chunk_problem(buf: bytes, pos: int, block_at: int, inside: bool) -> str | None:
    """What is wrong with the chunk at `pos` of the block read at `block_at` (`inside` a record or not), or None."""
    crc, length, kind = CHUNK_HEADER.unpack_from(buf, pos)
    at, start, end = block_at + pos, pos + CHUNK_HEADER.size, pos + CHUNK_HEADER.size + length
    if end > len(buf) and len(buf) < BLOCK_SIZE:
        return f"cut inside a record at byte {block_at + len(buf)} (chunk needs {block_at + end})"
    if end > len(buf) or kind not in _TYPE_CRC:
        return f"malformed chunk at byte {at}"
    if zlib.crc32(buf[start:end], _TYPE_CRC[kind]) != crc:
        return f"checksum mismatch at byte {at}"
    if (kind in (FULL, FIRST)) == inside:
        return f"chunk out of sequence at byte {at}"
    return None


def iter_log(path: str | Path, log: LogRead) -> Iterator[bytes]:
    """Each complete record of a wandb log, read a 32 KiB block at a time (a record above MAX_RECORD_BYTES is skipped,
    never gathered); what stopped the read and what was skipped are left in `log` when the iteration ends."""
    with _open_log(Path(path)) as handle:
        log.size = size = os.fstat(handle.fileno()).st_size
        buf = handle.read(BLOCK_SIZE)
        log.problem = _header_problem(buf)
        if log.problem:
            return
        block_at, pos, record_start, parts, gathered, inside = 0, len(FILE_HEADER), len(FILE_HEADER), [], 0, False
        hsize = CHUNK_HEADER.size
        while True:
            if pos + hsize > len(buf):  # the block's tail: padding, or the file's end
                if len(buf) < BLOCK_SIZE:
                    if pos < len(buf):
                        log.problem = f"cut inside a chunk header at byte {block_at + pos}"
                    break
                block_at, pos, buf = block_at + BLOCK_SIZE, 0, handle.read(BLOCK_SIZE)
                if not buf:
                    break
                continue
            crc, length, kind = CHUNK_HEADER.unpack_from(buf, pos)
            end = pos + hsize + length
            if kind == FULL and not inside and end <= len(buf):  # the common case first: a record in one chunk
                data = buf[pos + hsize:end]
                if zlib.crc32(data, _FULL_CRC) == crc:
                    pos, record_start = end, block_at + end
                    yield data
                    continue
            if kind == 0 and length == 0 and crc == 0:
                if not _zeros_to_end(handle, buf[pos:]):
                    log.problem = f"zero chunk header followed by data at byte {block_at + pos}"
                break
            log.problem = _chunk_problem(buf, pos, block_at, inside)
            if log.problem:
                break
            data = buf[pos + hsize:end]
            gathered, pos, inside = (gathered + length if inside else length), end, kind in (FIRST, MIDDLE)
            if gathered > MAX_RECORD_BYTES:  # skipped, read no further than its chunks
                if parts:
                    log.skipped.append(record_start)
                parts.clear()
            elif inside:
                parts.append(data)
            else:
                record = b"".join([*parts, data]) if parts else data
                parts.clear()
                yield record
            if not inside:
                record_start = block_at + end
        if inside:
            log.problem = f"cut inside a multi-block record at byte {size}"
        log.stopped_at = record_start if log.problem else size


def read_log(path: str | Path) -> LogRead:
    """Read every complete record of a wandb log; a cut or damaged tail ends the read with a `problem`."""
    log = LogRead([])
    log.records = list(iter_log(path, log))
    return log


def encode_log(records: Iterable[bytes]) -> bytes:
    """Frame serialized records the way wandb does (used to clone runs for benchmarks and tests)."""
    out = bytearray(FILE_HEADER)
    hsize = CHUNK_HEADER.size
    for data in records:
        offset, first = 0, True
        while True:
            left_in_block = BLOCK_SIZE - len(out) % BLOCK_SIZE
            if left_in_block < hsize:
                out += bytes(left_in_block)
                continue
            room = left_in_block - hsize
            chunk = data[offset : offset + room]
            offset += len(chunk)
            done = offset >= len(data)
            kind = (FULL if done else FIRST) if first else (LAST if done else MIDDLE)
            out += CHUNK_HEADER.pack(zlib.crc32(chunk, _TYPE_CRC[kind]), len(chunk), kind)
            out += chunk
            first = False
            if done:
                break
    return bytes(out)
