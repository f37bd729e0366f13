"""The on-disk spool: windows that could not wait in memory, kept in order until delivered.

A directory per exporter: ``spool.json`` (run id, node id, tracking URI without credentials,
first step once known) and one JSON file per window, named by a sequence number so a listing is
the delivery order. Files are written whole (temp file + rename): a crash loses at most the window
being written. The total size of the window files is capped; past the cap ``append`` refuses.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from otel_forge.mlflow.spool_files import HEADER, STATS, make_spool_dir, write_atomically
from otel_forge.mlflow.system_metrics.windows import Window

_logger = logging.getLogger(__name__)

_SUFFIX = ".window.json"
CORRUPT_SUFFIX = ".corrupt"
# Sequence numbers start high so windows older than all held ones can be put in front.
_FIRST_SEQUENCE = 10**11


def _sequence(path: Path) -> int:
    return int(path.name.split(".")[0])


class WindowSpool:
    """A bounded, ordered, on-disk queue of windows (``worker.Overflow`` of ``Window``)."""

    def __init__(self, path: Path, max_bytes: int, header: Mapping[str, object] | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._header: dict[str, object] = dict(header or {})
        self._refused: set[str] = set()
        self.set_aside = 0  # files found not to be windows
        files = sorted(path.glob(f"*{_SUFFIX}")) if path.is_dir() else []
        # Sequence numbers only (a window's file name follows from it): small, whatever the spool holds.
        self._sequences: collections.deque[int] = collections.deque(_sequence(f) for f in files)
        self._bytes = sum(f.stat().st_size for f in files)
        self._next_sequence = self._sequences[-1] + 1 if self._sequences else _FIRST_SEQUENCE
        if path.is_dir() and (path / HEADER).exists():
            self._header = {**json.loads((path / HEADER).read_text()), **self._header}

    @classmethod
    def open(cls, path: Path) -> WindowSpool:
        """An existing spool, for replay."""
        if not (path / HEADER).is_file():
            raise FileNotFoundError(f"{path} is not an otel-forge spool (no {HEADER})")
        return cls(path, max_bytes=0)

    @property
    def header(self) -> dict[str, Any]:
        """A copy of ``spool.json``: JSON, whose fields replay reads as what the exporter wrote (Any
        until replay's ``_job_run_id`` takes a typed header)."""
        return dict(self._header)

    def update_header(self, **fields: object) -> None:
        with self._lock:
            self._header.update(fields)
            if self.path.is_dir():
                self._guarded(lambda: write_atomically(self.path / HEADER, json.dumps(self._header)))

    def __len__(self) -> int:
        return len(self._sequences)

    @staticmethod
    def pending_files(path: Path) -> list[Path]:
        """The windows a spool directory keeps, without opening it (another process may write it)."""
        return sorted(path.glob(f"*{_SUFFIX}"))

    def _file(self, sequence: int) -> Path:
        return self.path / f"{sequence:012d}{_SUFFIX}"

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def append(self, window: Window) -> bool:
        with self._lock:
            if not self._write(window, self._next_sequence):
                return False
            self._sequences.append(self._next_sequence)
            self._next_sequence += 1
            return True

    def prepend(self, windows: list[Window]) -> int:
        """Put ``windows`` (older than every window held) in front, in their order."""
        with self._lock:
            sequence = self._sequences[0] if self._sequences else self._next_sequence
            kept = 0
            for window in reversed(windows):
                sequence -= 1
                if self._write(window, sequence):
                    self._sequences.appendleft(sequence)
                    kept += 1
            return kept

    def _write(self, window: Window, sequence: int) -> bool:
        text = json.dumps(window.to_json())
        if self._bytes + len(text) > self.max_bytes:
            self._refuse(
                "full",
                "the spool %s is full (%d bytes, OTEL_FORGE_SPOOL_MAX_BYTES): windows that "
                "cannot wait in memory are dropped and counted",
                self.path,
                self.max_bytes,
            )
            return False
        if not self._guarded(lambda: self._write_window(sequence, text)):
            return False
        self._bytes += len(text)
        return True

    def _write_window(self, sequence: int, text: str) -> None:
        if not self.path.is_dir():
            make_spool_dir(self.path)  # never into a directory someone else owns or planted
            write_atomically(self.path / HEADER, json.dumps(self._header))
        write_atomically(self._file(sequence), text)

    def _guarded(self, write: Callable[[], None]) -> bool:
        try:
            write()
            return True
        except OSError as error:
            self._refuse(
                "unwritable",
                "cannot write the spool %s (%s): set OTEL_FORGE_SPOOL_DIR to a writable "
                "directory of your own; windows wait in memory only, and past that are dropped and counted",
                self.path,
                error.strerror or error,
            )
            return False

    def _refuse(self, reason: str, message: str, *args: object) -> None:
        """Warn once per reason; the worker counts every window the spool refuses."""
        if reason not in self._refused:
            self._refused.add(reason)
            _logger.warning(message, *args)

    def peek(self) -> Window | None:
        """The oldest window. A file that is not one (corrupt, foreign) is set aside as
        ``<name>.corrupt`` with a warning naming it, and the next one is read: it never blocks."""
        with self._lock:
            while self._sequences:
                path = self._file(self._sequences[0])
                try:
                    return Window.from_json(json.loads(path.read_text()))
                except (OSError, ValueError, KeyError, TypeError) as error:
                    self._set_aside(path, error)
            return None

    def peek_many(self, count: int) -> list[Window]:
        """The oldest ``count`` windows, up to the first that cannot be read (``peek`` sets that
        one aside once it is the oldest)."""
        with self._lock:
            windows = []
            for sequence in itertools.islice(self._sequences, count):
                try:
                    windows.append(Window.from_json(json.loads(self._file(sequence).read_text())))
                except (OSError, ValueError, KeyError, TypeError):
                    break
            return windows

    def _set_aside(self, path: Path, error: Exception) -> None:
        self._sequences.popleft()
        self.set_aside += 1
        try:
            self._bytes -= path.stat().st_size
            path.rename(path.with_name(path.name + CORRUPT_SUFFIX))
        except OSError:
            pass
        _logger.warning(
            "spool file %s is not a window (%s: %s): set aside as %s%s",
            path,
            type(error).__name__,
            error,
            path.name,
            CORRUPT_SUFFIX,
        )

    def pop(self) -> None:
        with self._lock:
            if self._sequences:
                head = self._file(self._sequences.popleft())
                self._bytes -= head.stat().st_size
                head.unlink()

    def write_stats(self, stats: dict[str, int]) -> None:
        """Delivery counts beside the windows, for ``otel-forge doctor``."""
        if self.path.is_dir():
            self._guarded(lambda: write_atomically(self.path / STATS, json.dumps(stats)))

    def discard(self) -> int:
        """Delete the spool and every window in it; how many windows there were."""
        with self._lock:
            count = len(self._sequences)
            self._sequences.clear()
            self._bytes = 0
            shutil.rmtree(self.path, ignore_errors=True)
            return count

    def remove_if_empty(self) -> bool:
        """Delete the directory when no window is left; True if it is gone."""
        with self._lock:
            if self._sequences:
                return False
            shutil.rmtree(self.path, ignore_errors=True)
            return True
