"""leveldb's log format: 32 KiB blocks of checksummed physical records.

The layout is leveldb's (``doc/log_format.md``), the one W&B's ``.wandb`` datastore reuses and
Prometheus's WAL adapts. A file is a sequence of ``BLOCK_SIZE`` blocks; each physical record is a
7-byte header (checksum: 4 bytes little-endian, length: 2 bytes little-endian, type: 1 byte) and
``length`` bytes of data. A logical record that does not fit in the rest of its block is split into
FIRST, MIDDLE..., LAST fragments. Fewer than ``HEADER_SIZE`` bytes left in a block are a trailer
of zeros, and the next record starts at the next block.

Type 0 is no record: it is what a range reads as before its bytes are written (a hole left by
``pwrite`` further on), so a header of zeros never passes for a record.
"""

from __future__ import annotations

import struct
import zlib
from enum import IntEnum
from typing import NamedTuple

BLOCK_SIZE = 32768
HEADER_SIZE = 7

_HEADER = struct.Struct("<IHB")


class RecordType(IntEnum):
    """The type byte of a physical record."""

    FULL = 1
    FIRST = 2
    MIDDLE = 3
    LAST = 4


# The checksum is zlib.crc32 over the type byte then the data, unmasked, as W&B's datastore
# computes it: leveldb uses crc32c (masked), which the standard library does not have. The type
# byte's part is computed once; crc32 continues from it over the data.
_SEEDS: dict[int, int] = {int(kind): zlib.crc32(bytes([kind])) for kind in RecordType}
_FULL_SEED = _SEEDS[RecordType.FULL]
_FULL = int(RecordType.FULL)  # a plain int packs faster than the enum member


class Header(NamedTuple):
    """A physical record's header as read; ``kind`` is not checked to be a ``RecordType``."""

    checksum: int
    length: int
    kind: int


def frame(offset: int, payload: bytes) -> bytes:
    """The bytes that append ``payload`` as one logical record to a file that ends at ``offset``:
    the trailer of zeros first if the block there has no room for a header, then the fragments."""
    room = BLOCK_SIZE - offset % BLOCK_SIZE
    size = len(payload)
    if size + HEADER_SIZE <= room:  # the common case: one FULL record in this block
        return _HEADER.pack(zlib.crc32(payload, _FULL_SEED), size, _FULL) + payload
    return _frame_fragments(room, payload)


def _frame_fragments(room: int, payload: bytes) -> bytes:
    parts: list[bytes | memoryview] = []
    view = memoryview(payload)
    start = 0
    first = True  # not start == 0: with exactly a header's room left, the first fragment is empty
    while True:
        if room < HEADER_SIZE:
            parts.append(bytes(room))  # the trailer (empty when the last fragment filled its block)
            room = BLOCK_SIZE
        end = min(len(payload), start + room - HEADER_SIZE)
        kind = _fragment_type(first, last=end == len(payload))
        first = False
        data = view[start:end]
        parts.append(_HEADER.pack(zlib.crc32(data, _SEEDS[kind]), end - start, kind))
        parts.append(data)
        if end == len(payload):
            return b"".join(parts)
        room -= HEADER_SIZE + end - start
        start = end


def _fragment_type(first: bool, last: bool) -> RecordType:
    if first:
        return RecordType.FULL if last else RecordType.FIRST
    return RecordType.LAST if last else RecordType.MIDDLE


def parse_header(buffer: bytes, position: int = 0) -> Header:
    """The header at ``position`` in ``buffer`` (which holds at least ``HEADER_SIZE`` bytes there)."""
    return Header._make(_HEADER.unpack_from(buffer, position))


def checksum_matches(header: Header, data: bytes) -> bool:
    """Whether ``header`` is of a known type and its checksum was computed over ``data``."""
    seed = _SEEDS.get(header.kind)
    return seed is not None and zlib.crc32(data, seed) == header.checksum


def room_in_block(offset: int) -> int:
    """How many bytes are left in the block that ``offset`` falls in."""
    return BLOCK_SIZE - offset % BLOCK_SIZE
