"""``Cursor``: how far a journal's delivery has got, kept beside the journal (``delivered.json``) after
every call, so that a delivery that starts again (a new companion, a replay) sends nothing twice."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_forge.mlflow.spool_files import write_atomically
from otel_forge.mlflow.training.run_journal import CURSOR_FILE

_logger = logging.getLogger(__name__)

_DESCRIBED_POLL_S = 0.02  # how often a TrainingRun looks whether its description is in


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
        write_atomically(directory / CURSOR_FILE, json.dumps(dataclasses.asdict(self)))


def wait_described(directory: Path, timeout_s: float) -> bool:
    """Wait, at most ``timeout_s``, until the delivery of the journal in ``directory`` has described
    its run (or delivered the journal whole); True then."""
    deadline = time.monotonic() + timeout_s
    while not _described(directory):
        if time.monotonic() >= deadline:
            _logger.info("MLflow: the run's description is not delivered yet; it follows in the background")
            return False
        time.sleep(_DESCRIBED_POLL_S)
    return True


def _described(directory: Path) -> bool:
    if not directory.exists():
        return True
    cursor = Cursor.load(directory)
    return cursor.run is not None and not cursor.undescribed
