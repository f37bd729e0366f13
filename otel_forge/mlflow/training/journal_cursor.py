"""``Cursor``: how far a journal's delivery has got, kept beside the journal (``delivered.json``) after
every call, so that a delivery that starts again (a new companion, a replay) sends nothing twice; and
what the journal holds past it (``undelivered``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_forge.journal import JournalReader
from otel_forge.mlflow.spool_files import write_atomically
from otel_forge.mlflow.training.run_journal import CURSOR_FILE, END, JOURNAL_FILE, METRICS, OPENED, decode

_logger = logging.getLogger(__name__)

_DESCRIBED_POLL_S = 0.02  # how often a TrainingRun looks whether its description is in
# The cursor holds the whole description (a large config's: hundreds of KB): while it waits, the
# TrainingRun parses it again only once the file changed, and at least this often all the same.
_DESCRIBED_REREAD_S = 0.25
_COUNT_RECORDS = 10_000  # records a count reads at once


@dataclass
class Cursor:
    """What ``delivered.json`` holds: the journal offset delivered up to, the run, models, refusals,
    and the entries that say how to open and describe the run (the offset may be past them)."""

    offset: int = 0
    plan: dict[str, Any] = field(default_factory=dict)
    describe: dict[str, Any] = field(default_factory=dict)
    opened: dict[str, Any] | None = None
    run: dict[str, Any] | None = None
    models: dict[str, str] = field(default_factory=dict)
    refused: int = 0
    undescribed: bool = False  # the run is ours to describe, and its description is not delivered yet
    ended: str | None = None  # the status the run was ended with: a delivery after that one ends nothing

    @classmethod
    def load(cls, directory: Path) -> Cursor:
        try:
            return cls(**json.loads((directory / CURSOR_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return cls()

    def save(self, directory: Path) -> None:
        # The fields as they are (JSON's own types): asdict would deep-copy the description first.
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        write_atomically(directory / CURSOR_FILE, json.dumps(fields))


def wait_described(directory: Path, timeout_s: float) -> bool:
    """Wait, at most ``timeout_s``, until the delivery of the journal in ``directory`` has described
    its run (or delivered the journal whole); True then."""
    deadline = time.monotonic() + timeout_s
    version: tuple[int, int, int] | None = None  # of the cursor file read last
    read_at = 0.0
    while True:
        if not directory.exists():
            return True
        now = time.monotonic()
        if (seen := _version(directory)) != version or now - read_at >= _DESCRIBED_REREAD_S:
            version, read_at = seen, now
            if _described(Cursor.load(directory)):
                return True
        if now >= deadline:
            _logger.info("MLflow: the run's description is not delivered yet; it follows in the background")
            return False
        time.sleep(_DESCRIBED_POLL_S)


def _version(directory: Path) -> tuple[int, int, int] | None:
    """Which cursor file is there: each save is a new file (``write_atomically``)."""
    try:
        stat = os.stat(directory / CURSOR_FILE)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _described(cursor: Cursor) -> bool:
    return cursor.run is not None and not cursor.undescribed


@dataclass(frozen=True)
class Undelivered:
    """What a journal holds past its delivery's cursor: metric values, the run's end, and its run."""

    values: int
    end: str | None  # the status it was ended with, where the journal has its end
    run_id: str | None = None  # the run it is delivered into, where one is known (opened, or found by its delivery)


def undelivered(directory: Path, offset: int | None = None) -> Undelivered:
    """What the journal in ``directory`` holds from ``offset`` on (default: its delivery's cursor)."""
    cursor = Cursor.load(directory)
    run_id = (cursor.run or cursor.opened or {}).get("run_id")
    values, end = 0, None
    with JournalReader(directory / JOURNAL_FILE, cursor.offset if offset is None else offset) as reader:
        while records := reader.read(final=True, limit=_COUNT_RECORDS):  # memory bounded, whatever the journal's size
            for payload, _ in records:
                entry = decode(payload) or [""]
                if entry[0] == METRICS:
                    values += len(entry[3])
                elif entry[0] == END:
                    end = entry[1]
                elif entry[0] == OPENED and isinstance(entry[1], dict):
                    run_id = entry[1].get("run_id", run_id)
    return Undelivered(values, end, run_id)


def registered_models(directory: Path) -> dict[int, str]:
    """The checkpoints the journal's delivery has registered so far: step -> model id."""
    return {int(step): model_id for step, model_id in Cursor.load(directory).models.items()}
