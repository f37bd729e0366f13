"""``JournalReader``: tails a journal file, record by record, with the cursor after each.

A live journal is read while writers append to it, from several threads that each reserve a range
and then write it outside any lock. What the reader finds past the last complete record is then
"not yet", not damage: a range still zeros (reserved, unwritten), a record cut by the end of the
file, a checksum that fails because a write is half visible. A live read stops there and returns
the record once it is whole. Only a final read (the writer known dead: nothing more comes) calls
such bytes damage, skips them and counts them. It resyncs at the next intact record: leveldb goes
on at the next block, which would lose the intact records after the damage in its block (up to
32 KiB of them), so a final read first looks there for a header whose checksum holds.

Where the damage is tells what it was. At the end of the file (``torn_tail_bytes``), it is a write
its writer's death (or the node's crash) cut short: its ``log()`` never returned. Damage with intact
records after it (``damaged``) is not what a death leaves, whose appends all end at the file's end;
the file was changed there: overwritten, cut while it was written to (the writer goes on past a
hole), or corrupted on disk. (A writer with several threads appending at once can also leave an
unwritten range a few records before its end when killed.)

Each ``read()`` reads from its offset afresh: bytes read earlier as zeros may since be written.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from otel_forge.journal.framing import (
    BLOCK_SIZE,
    HEADER_SIZE,
    RecordType,
    checksum_matches,
    parse_header,
    room_in_block,
)

_logger = logging.getLogger(__name__)

_FLAGS = os.O_RDONLY | os.O_CLOEXEC
CHUNK_BYTES = 1 << 20  # read this much at a time (more only for a record that is longer)


@dataclass(frozen=True)
class _Record:
    payload: bytes
    end: int


@dataclass(frozen=True)
class _Damage:
    """No record at the offset: the bytes up to ``resume`` hold none (a live writer may yet
    complete them); ``why`` says what was found. ``rescan``: where the damaged physical record
    begins, after which a final read looks for an intact one before ``resume``."""

    resume: int
    why: str
    rescan: int | None = None


class JournalReader:
    """Reads the journal at ``path`` from ``offset`` (0, or a cursor a previous reader handed out).

    ``skipped`` counts the damaged stretches a final read has skipped: each a run of bytes that
    held no complete record (a torn record, a range never written, a checksum that fails, a
    fragmented record missing a fragment), from a record boundary to where reading resumed;
    adjacent ones count once. ``skipped_bytes`` is their total length. Of them, ``damaged`` and
    ``damaged_bytes`` are those with an intact record after them (``damaged_at``: where the first
    began), ``torn_tail_bytes`` the one that runs to the end of the file, if any.
    """

    def __init__(self, path: Path, offset: int = 0) -> None:
        if offset < 0:
            raise ValueError(f"offset {offset} < 0")
        self._path = path
        self._fd = os.open(path, _FLAGS)
        self._offset = offset
        self.skipped = 0
        self.skipped_bytes = 0
        self._skipped_to = -1  # where the last skip ended: a skip from there extends it
        self.damaged = 0
        self.damaged_bytes = 0
        self.damaged_at: int | None = None
        self._stretch: tuple[int, int] | None = None  # the last skipped stretch, no record read after it yet
        # What this read() call has read: the file's bytes from _start, up to _size.
        self._buffer = b""
        self._start = 0
        self._size = 0

    @property
    def path(self) -> Path:
        return self._path

    @property
    def offset(self) -> int:
        """Where the next record starts: a cursor handed out by ``read``, or 0."""
        return self._offset

    @offset.setter
    def offset(self, offset: int) -> None:
        if offset < 0:
            raise ValueError(f"offset {offset} < 0")
        self._offset = offset
        self._stretch = None  # read from elsewhere: what was skipped before is no one's tail

    @property
    def at_end(self) -> bool:
        """The last ``read`` took every record to the end of the file as it then was (it did not stop
        at a record not whole yet, nor at ``limit``)."""
        return self._offset >= self._size

    @property
    def torn_tail_bytes(self) -> int:
        """The bytes a final read skipped at the end of the file: a write cut short (0: none)."""
        stretch = self._stretch
        return stretch[1] - stretch[0] if stretch is not None and stretch[1] >= self._size else 0

    def read(self, final: bool = False, limit: int | None = None) -> list[tuple[bytes, int]]:
        """The complete records from the offset on (at most ``limit``), each with the offset just
        after it; the offset moves past them.

        Not ``final``: stops at the first record that is not whole yet, which a later call returns
        once it is. ``final`` (the writer is dead): skips what is damaged or torn, counting it in
        ``skipped``, so the offset ends at the end of the file unless ``limit`` stopped it first.
        """
        records: list[tuple[bytes, int]] = []
        self._size = os.fstat(self._fd).st_size
        self._buffer, self._start = b"", self._offset
        try:
            while limit is None or len(records) < limit:
                if self._offset >= self._size:
                    break
                found = self._next(self._offset)
                if isinstance(found, _Record):
                    if self._stretch is not None:  # damage with an intact record after it
                        self._count_damaged(*self._stretch)
                    records.append((found.payload, found.end))
                    self._offset = found.end
                elif final:
                    self._skip(found)
                else:
                    break
        finally:
            self._buffer = b""  # not kept between calls: the file may change under it
        return records

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JournalReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _next(self, start: int) -> _Record | _Damage:
        """The logical record at ``start`` (a record boundary, before the end of the file)."""
        fragments: list[bytes] = []
        position = start
        while True:
            if room_in_block(position) < HEADER_SIZE:
                position += room_in_block(position)  # the trailer
            header_bytes = self._bytes(position, HEADER_SIZE)
            if len(header_bytes) < HEADER_SIZE:
                return _Damage(self._size, "cut short by the end of the file")
            header = parse_header(header_bytes)
            if header.length > room_in_block(position) - HEADER_SIZE or header.kind not in _TYPES:
                return _Damage(self._next_block(position), "no header (zeros, or not one)", position)
            end = position + HEADER_SIZE + header.length
            data = self._bytes(position + HEADER_SIZE, header.length)
            if len(data) < header.length:
                return _Damage(self._size, "cut short by the end of the file", position)
            if not checksum_matches(header, data):
                return _Damage(self._next_block(position), "a checksum that fails", position)
            kind = header.kind
            if fragments and kind in (RecordType.FULL, RecordType.FIRST):
                return _Damage(position, "a fragmented record without its last fragment")
            if not fragments and kind in (RecordType.MIDDLE, RecordType.LAST):
                return _Damage(end, "a fragment without its first")
            if kind == RecordType.FULL:
                return _Record(data, end)
            fragments.append(data)
            if kind == RecordType.LAST:
                return _Record(b"".join(fragments), end)
            position = end

    def _skip(self, damage: _Damage) -> None:
        resume = min(damage.resume, self._size)
        if damage.rescan is not None and (found := self._intact_after(damage.rescan, resume)) is not None:
            resume = found
        if self._offset != self._skipped_to:
            self.skipped += 1
            self._stretch = (self._offset, resume)
        elif self._stretch is not None:
            self._stretch = (self._stretch[0], resume)
        self.skipped_bytes += resume - self._offset
        _logger.debug("%s: skipped bytes %d to %d: %s", self._path, self._offset, resume, damage.why)
        self._offset = self._skipped_to = resume

    def _count_damaged(self, start: int, end: int) -> None:
        self.damaged += 1
        self.damaged_bytes += end - start
        self.damaged_at = start if self.damaged_at is None else min(self.damaged_at, start)
        self._stretch = None

    def _intact_after(self, position: int, before: int) -> int | None:
        """The first offset after ``position`` and before ``before`` (both in one block) where an
        intact physical record starts: a header of a known type whose checksum holds over data that
        fits its block. Read afresh (the damage path only): the buffer may be past ``position``."""
        end = min(before, self._next_block(position), self._size)
        data = os.pread(self._fd, end - position, position) if end > position else b""
        # A header's type byte is its 7th: candidates are where one of the known types stands.
        for match in _TYPE_BYTE.finditer(data, HEADER_SIZE):
            at = match.start() - (HEADER_SIZE - 1)
            header = parse_header(data, at)
            payload = data[at + HEADER_SIZE : at + HEADER_SIZE + header.length]
            fits = header.length <= room_in_block(position + at) - HEADER_SIZE and len(payload) == header.length
            if fits and checksum_matches(header, payload):
                return position + at
        return None

    def _next_block(self, position: int) -> int:
        return position - position % BLOCK_SIZE + BLOCK_SIZE

    def _bytes(self, position: int, count: int) -> bytes:
        """The file's bytes at ``position`` (not before the last asked for), fewer at its end."""
        start = position - self._start
        if start + count > len(self._buffer):
            self._fill(position, count)
            start = 0
        return self._buffer[start : start + count]

    def _fill(self, position: int, count: int) -> None:
        # Keep what is buffered from ``position`` on and read on from where it ends.
        kept = self._buffer[position - self._start :] if position < self._start + len(self._buffer) else b""
        read_from = position + len(kept)
        want = min(max(count - len(kept), CHUNK_BYTES), self._size - read_from)
        fresh = os.pread(self._fd, want, read_from) if want > 0 else b""
        self._buffer, self._start = kept + fresh, position


_TYPES = frozenset(int(kind) for kind in RecordType)
_TYPE_BYTE = re.compile(b"[" + bytes(sorted(_TYPES)) + b"]")
