"""``JournalWriter``: appends records to a journal file, from any thread, without a lock held
across I/O.

An append reserves its byte range under a lock (framing needs only the end offset, since
``frame`` is pure), then writes it with one ``pwrite`` outside the lock. Appends from several
threads therefore land out of order for an instant: a later range may be written while an earlier
one is still zeros. ``JournalReader`` reads a region of zeros where a header should be as "not
written yet", so a live tail never skips past it.

The data is in the page cache when ``append`` returns: it survives the process's death, SIGKILL
included. Only a crash of the node loses what ``sync`` has not forced to disk.

A write that fails (a full disk, an I/O error) leaves no hole behind: a reader waits at a hole for
ever while its writer lives, and a final read resyncs at the next block, losing the records after
it there. The failed range is given back where nothing was reserved after it (the file is cut back
to where it began), else it is filled with a record of ``GAP_KIND`` that readers pass over, by the
next append that can write.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from pathlib import Path
from types import TracebackType

from otel_forge.journal.framing import frame

# Not O_APPEND: every write says its offset (pwrite), which is how ranges are reserved.
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
_MODE = 0o600
GAP_KIND = "gap"  # the payload ``["gap"]`` (padded with spaces) of a record that fills a failed range
_GAP_HEAD, _GAP_TAIL = b'["' + GAP_KIND.encode() + b'"', b"]"


class JournalWriter:
    """Appends logical records to the journal at ``path`` (created 0600 if missing; appends
    start at its current size).

    ``append`` may be called from any number of threads. ``close`` waits for the appends in
    flight; an append after it, or in a process forked from the one that opened the writer (its
    ranges would collide with the parent's), raises ``ValueError``.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = os.open(path, _FLAGS, _MODE)
        self._end = os.fstat(self._fd).st_size
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # close() waits here for writes in flight
        self._writing = 0
        self._refusal: str | None = None  # why appends are refused, once they are
        self._gaps: list[tuple[int, int]] = []  # (offset, payload size) of failed writes to fill
        _refuse_in_forked_children(self)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def end(self) -> int:
        """The offset after the last range reserved (its bytes may still be being written)."""
        return self._end

    def append(self, payload: bytes, timeout_s: float = -1) -> None:
        """Append ``payload`` as one record. Raises ``OSError`` when the write fails: the range it
        reserved is given back, or filled with a gap record by a later append (see the module).

        ``timeout_s``: how long to wait for the reservation lock, for a caller that may have
        interrupted its own thread inside an append (a signal handler): ``TimeoutError`` then.
        """
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"{self._path}: the journal is being appended to by the interrupted code")
        try:
            if self._refusal is not None:
                raise ValueError(self._refusal)
            offset = self._end
            data = frame(offset, payload)
            self._end = offset + len(data)
            self._writing += 1
            gaps = self._take_gaps() if self._gaps else None
        finally:
            self._lock.release()
        try:
            if gaps:
                self._fill(self._fd, gaps)
            _write_at(self._fd, data, offset)
        except OSError:
            self._give_back(offset, len(data), len(payload))
            raise
        finally:
            with self._lock:
                self._writing -= 1
                if self._refusal is not None and not self._writing:
                    self._idle.notify_all()

    def _take_gaps(self) -> list[tuple[int, int]]:
        gaps, self._gaps = self._gaps, []
        return gaps

    def _fill(self, fd: int, gaps: list[tuple[int, int]]) -> None:
        """Write a gap record over each failed range; those that fail again are kept for the next append."""
        for number, (offset, size) in enumerate(gaps):
            try:
                _write_at(fd, frame(offset, _gap_payload(size)), offset)
            except OSError:
                with self._lock:
                    self._gaps[:0] = gaps[number:]
                raise

    def _give_back(self, offset: int, length: int, size: int) -> None:
        """The range at ``offset`` could not be written: the file ends before it again, where nothing
        was reserved after it; else it is a gap to fill."""
        with self._lock:
            if self._end == offset + length:
                try:
                    if os.fstat(self._fd).st_size > offset:
                        os.ftruncate(self._fd, offset)  # what a short write left there would read as damage
                    self._end = offset
                    return
                except OSError:
                    pass
            self._gaps.append((offset, size))

    def sync(self) -> None:
        """Force what was appended to disk (``fdatasync``): it then survives a crash of the node."""
        with self._lock:
            if self._refusal is not None:
                raise ValueError(self._refusal)
            self._writing += 1
        try:
            os.fdatasync(self._fd)
        finally:
            with self._lock:
                self._writing -= 1
                if self._refusal is not None and not self._writing:
                    self._idle.notify_all()

    def close(self) -> None:
        """Close the file once the appends in flight have written (no sync: see ``sync``)."""
        with self._idle:
            if self._fd < 0:
                return
            self._refusal = self._refusal or f"{self._path}: the journal writer is closed"
            self._idle.wait_for(lambda: not self._writing)
            gaps = self._take_gaps()
            fd, self._fd = self._fd, -1
        with contextlib.suppress(OSError):
            self._fill(fd, gaps)  # the last chance: a final read skips what is left
        os.close(fd)

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _after_fork_in_child(self) -> None:
        # The child has a copy of the end offset, not a share of it: its appends would overwrite
        # the parent's. Its lock may have been held by a thread the child does not have.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._writing = 0
        self._refusal = f"{self._path}: the journal writer belongs to the process that forked this one"


def _refuse_in_forked_children(writer: JournalWriter) -> None:
    # A weak reference: the hook lives as long as the process, the writer need not.
    reference = weakref.ref(writer)

    def after_in_child() -> None:
        alive = reference()
        if alive is not None:
            alive._after_fork_in_child()  # noqa: SLF001 - the writer's own hook

    os.register_at_fork(after_in_child=after_in_child)


def _gap_payload(size: int) -> bytes:
    """``["gap"]`` padded with spaces to ``size`` bytes: framed at the same offset, it takes the same
    bytes as the record it stands for (framing depends on the offset and the payload's size alone)."""
    return _GAP_HEAD + b" " * (size - len(_GAP_HEAD) - len(_GAP_TAIL)) + _GAP_TAIL


def _write_at(fd: int, data: bytes, offset: int) -> None:
    written = os.pwrite(fd, data, offset)
    if written == len(data):
        return
    view = memoryview(data)  # a short write (a signal, a full disk): write the rest
    while written < len(data):
        written += os.pwrite(fd, view[written:], offset + written)
