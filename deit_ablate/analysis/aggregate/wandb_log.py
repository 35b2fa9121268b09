"""The framing of a wandb transaction log (`run-*.wandb`): 32 KiB blocks of CRC-checked chunks.

wandb 0.31 writes these files from its Go core and ships no Python reader, so the framing is decoded
here; the payload of every record is a `wandb.proto.wandb_internal_pb2.Record`, parsed with wandb's own
protobuf definitions by `reader.py`. Layout: a 7-byte file header (b":W&B", magic 0xBEE1 as little-endian
uint16, version 0), then records cut into chunks that never cross a 32 KiB block; each chunk has a 7-byte
header (CRC-32 of the type byte and data, little-endian uint32; data length, uint16; type: 1 full,
2 first, 3 middle, 4 last). A block tail shorter than a chunk header is zero padding.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BLOCK_SIZE = 32 * 1024
FILE_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
CHUNK_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}


@dataclass
class LogRead:
    """The complete records of one log file, and what stopped the read early (None: a clean end)."""

    records: list[bytes]
    problem: str | None = None
    stopped_at: int = 0  # byte offset where reading stopped
    size: int = 0


def read_log(path: str | Path) -> LogRead:
    """Read every complete record of a wandb log; a cut or damaged tail ends the read with a `problem`."""
    buf = Path(path).read_bytes()
    size = len(buf)
    records: list[bytes] = []
    if size < len(FILE_HEADER):
        return LogRead(records, f"file is {size} bytes, shorter than the log header", 0, size)
    if buf[:4] != FILE_HEADER[:4] or buf[4:6] != FILE_HEADER[4:6]:
        return LogRead(records, "not a wandb transaction log (bad header)", 0, size)
    pos = len(FILE_HEADER)
    parts: list[bytes] = []
    record_start = pos
    hsize = CHUNK_HEADER.size
    while pos < size:
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < hsize:
            pos += left_in_block
            continue
        if pos + hsize > size:
            return LogRead(records, f"cut inside a chunk header at byte {pos}", record_start, size)
        crc, length, kind = CHUNK_HEADER.unpack_from(buf, pos)
        if kind == 0 and length == 0 and crc == 0:
            rest = buf[pos:]
            if rest.count(0) == len(rest):
                break  # zero padding up to the end: a clean end
            return LogRead(records, f"zero chunk header followed by data at byte {pos}", record_start, size)
        start, end = pos + hsize, pos + hsize + length
        if end > size:
            return LogRead(records, f"cut inside a record at byte {size} (chunk needs {end})", record_start, size)
        if length > left_in_block - hsize or kind not in _TYPE_CRC:
            return LogRead(records, f"malformed chunk at byte {pos}", record_start, size)
        data = buf[start:end]
        if zlib.crc32(data, _TYPE_CRC[kind]) != crc:
            return LogRead(records, f"checksum mismatch at byte {pos}", record_start, size)
        if kind == FULL and not parts:
            records.append(data)
            record_start = end
        elif kind == FIRST and not parts:
            parts.append(data)
        elif kind == MIDDLE and parts:
            parts.append(data)
        elif kind == LAST and parts:
            parts.append(data)
            records.append(b"".join(parts))
            parts.clear()
            record_start = end
        else:
            return LogRead(records, f"chunk out of sequence at byte {pos}", record_start, size)
        pos = end
    if parts:
        return LogRead(records, f"cut inside a multi-block record at byte {size}", record_start, size)
    return LogRead(records, None, size, size)


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
