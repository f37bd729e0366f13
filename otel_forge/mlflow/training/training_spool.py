"""What a ``TrainingRun`` could not deliver before close: its records (tags, params, config and
launch file), its training metrics and the run's end.

A directory per run and process beside the system-metrics spools: ``spool.json`` (kind
``training``, run id, tracking URI without credentials, how the run ended and who ended it),
``records.json``, and the metric rows in files of at most one ``log_batch`` each, all written
whole (0600 in a 0700 directory). ``otel-forge replay PATH`` sends the records, then the rows in
order, then ends the run as it ended.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.mlflow.client import MAX_METRICS_PER_BATCH, import_mlflow
from otel_forge.mlflow.spool_files import HEADER, make_spool_dir, write_atomically
from otel_forge.mlflow.training.metric_buffer import MetricRow

_logger = logging.getLogger(__name__)

KIND = "training"
_SUFFIX = ".metrics.json"
RECORDS = "records.json"


@dataclass(frozen=True)
class Record:
    """One call that describes the run, as data (so it can wait in a spool): ``tags`` and
    ``params`` (key -> value), ``dict`` and ``text`` artifacts (``{"name", "data"}``)."""

    kind: str
    payload: Any

    def deliver(self, client: Any, run_id: str) -> None:
        entities = import_mlflow().entities
        if self.kind == "tags":
            client.log_batch(run_id, tags=[entities.RunTag(k, v) for k, v in self.payload.items()], synchronous=True)
        elif self.kind == "params":
            client.log_batch(run_id, params=[entities.Param(k, v) for k, v in self.payload.items()], synchronous=True)
        elif self.kind == "dict":
            client.log_dict(run_id, self.payload["data"], self.payload["name"])
        else:
            client.log_text(run_id, self.payload["data"], self.payload["name"])


class TrainingSpool:
    """Rows and the run's end, kept for ``otel-forge replay``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def keep(self, rows: Sequence[MetricRow], header: dict[str, Any], records: Sequence[Record] = ()) -> bool:
        """Write the records, the rows (in ``log_batch``-sized files) and the header; False if it cannot."""
        try:
            make_spool_dir(self.path)
            if records:
                write_atomically(self.path / RECORDS, json.dumps([dataclasses.asdict(r) for r in records]))
            for number, start in enumerate(range(0, len(rows), MAX_METRICS_PER_BATCH)):
                chunk = [list(row) for row in rows[start : start + MAX_METRICS_PER_BATCH]]
                write_atomically(self.path / f"{number:09d}{_SUFFIX}", json.dumps(chunk))
            self.write_header(header)
            return True
        except OSError as error:
            _logger.warning(
                "cannot keep the run's undelivered metrics in %s (%s): set OTEL_FORGE_SPOOL_DIR to a "
                "writable directory; they are lost",
                self.path,
                error.strerror or error,
            )
            return False

    @property
    def header(self) -> dict[str, Any]:
        return dict(json.loads((self.path / HEADER).read_text()))

    def write_header(self, header: dict[str, Any]) -> None:
        write_atomically(self.path / HEADER, json.dumps({**header, "kind": KIND}))

    def records(self) -> list[Record]:
        path = self.path / RECORDS
        return [Record(**record) for record in json.loads(path.read_text())] if path.exists() else []

    def records_delivered(self) -> None:
        (self.path / RECORDS).unlink(missing_ok=True)

    def batches(self) -> Iterator[tuple[Path, list[MetricRow]]]:
        """Each file's rows, oldest first; a file that is not rows is set aside as ``*.corrupt``."""
        for file in sorted(self.path.glob(f"*{_SUFFIX}")):
            try:
                rows = [(str(k), float(v), int(t), int(s)) for k, v, t, s in json.loads(file.read_text())]
            except (OSError, ValueError, TypeError) as error:
                _logger.warning(
                    "spool file %s is not metric rows (%s): set aside as %s.corrupt", file, error, file.name
                )
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
