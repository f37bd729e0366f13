"""``RunNotice``: the run a journal's delivery opened, told to the process that writes the journal.

A training process whose companion opens the run (``RunPlan.delivery_opens``) imports no MLflow and
connects to nothing: the companion opens the run from the journal's plan and description, then writes
this small file beside the journal (``run.json``), once the run is open, or while the server does not
answer, or once the run cannot be opened. The training process reads it (``RunOpener``) to learn the
run's id, which its MLflow calls and its framework's then resume (``MLFLOW_RUN_ID``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.mlflow.spool_files import write_atomically

NOTICE_FILE = "run.json"


@dataclass(frozen=True)
class RunNotice:
    """At most one of: ``run`` (the open run, as the journal keeps an ``OpenRun``), ``unanswered`` (the
    server does not answer: why, as the writer says it), ``refused`` (the run cannot be opened: why).
    None of them: the server is being asked."""

    run: dict[str, Any] | None = None
    unanswered: str | None = None
    refused: str | None = None

    def tell(self, directory: Path) -> None:
        """Written whole or not at all; a spool that cannot take it leaves the writer waiting, as for
        a server that does not answer."""
        with contextlib.suppress(OSError):
            write_atomically(directory / NOTICE_FILE, json.dumps(self.__dict__))

    @classmethod
    def read(cls, directory: Path) -> RunNotice | None:
        try:
            return cls(**json.loads((directory / NOTICE_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None  # none yet (or a journal delivered whole and removed)
