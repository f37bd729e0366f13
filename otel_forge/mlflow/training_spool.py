"""What a ``TrainingRun`` could not deliver before close: its training metrics and the run's end.

A directory per run and process beside the system-metrics spools: ``spool.json`` (kind
``training``, run id, tracking URI without credentials, how the run ended and who ended it) and
the metric rows in files of at most one ``log_batch`` each, written whole (0600 in a 0700
directory). ``otel-forge replay PATH`` sends the rows in order, then ends the run as it ended.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from otel_forge.mlflow.client import MAX_METRICS_PER_BATCH
from otel_forge.mlflow.metric_buffer import MetricRow
from otel_forge.mlflow.spool import HEADER, write_atomically

_logger = logging.getLogger(__name__)

KIND = "training"
_SUFFIX = ".metrics.json"


class TrainingSpool:
    """Rows and the run's end, kept for ``otel-forge replay``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def keep(self, rows: Sequence[MetricRow], header: dict[str, Any]) -> bool:
        """Write the rows (in ``log_batch``-sized files) and the header; False if it cannot."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            for number, start in enumerate(range(0, len(rows), MAX_METRICS_PER_BATCH)):
                chunk = [list(row) for row in rows[start:start + MAX_METRICS_PER_BATCH]]
                write_atomically(self.path / f"{number:09d}{_SUFFIX}", json.dumps(chunk))
            write_atomically(self.path / HEADER, json.dumps({**header, "kind": KIND}))
            return True
        except OSError as error:
            _logger.warning("cannot keep the run's undelivered metrics in %s (%s): set OTEL_FORGE_SPOOL_DIR to a "
                            "writable directory; they are lost", self.path, error.strerror or error)
            return False

    @property
    def header(self) -> dict[str, Any]:
        return dict(json.loads((self.path / HEADER).read_text()))

    def batches(self) -> Iterator[tuple[Path, list[MetricRow]]]:
        """Each file's rows, oldest first; a file that is not rows is set aside as ``*.corrupt``."""
        for file in sorted(self.path.glob(f"*{_SUFFIX}")):
            try:
                rows = [(str(k), float(v), int(t), int(s)) for k, v, t, s in json.loads(file.read_text())]
            except (OSError, ValueError, TypeError) as error:
                _logger.warning("spool file %s is not metric rows (%s): set aside as %s.corrupt", file, error,
                                file.name)
                file.rename(file.with_name(file.name + ".corrupt"))
                continue
            yield file, rows

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def is_training_spool(path: Path) -> bool:
    try:
        return json.loads((path / HEADER).read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def training_spool_path(root: Path, run_id: str) -> Path:
    return root / f"{run_id}-training-{os.getpid()}"
