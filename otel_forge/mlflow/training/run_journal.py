"""The run's journal: everything the training process logs is appended here before anything else
happens to it, and a process that is not the training process delivers it (``journal_delivery``).

One directory per run and process in the spool root: ``spool.json`` (kind ``journal``, the writer's
pid and start time, the tracking URI without credentials), ``journal.log`` (entries framed as
``otel_forge.journal`` frames them: a record torn by a kill is detected and skipped), and, once a
delivery has begun, ``delivered.json`` (how far it has delivered, the run it delivers into, the
checkpoints it registered). Page-cache writes survive the training process's death; only a node's
crash can lose what the delivery process has not forced to disk yet (``journal_fsync_s``).

An entry is a JSON list whose first item says what it is:
``["plan", {...}]`` how to open the run, ``["describe", {...}]`` what a new run records,
``["opened", {...}]`` the run the training process opened, ``["m", step, timestamp_ms, {key: value}]``
one ``log()``, ``["rec", kind, payload]`` a ``Record``, ``["ckpt", step, path, model_name]`` a checkpoint,
``["end", status, rejected(, worker)]`` the run's end as the training process ended it (``worker``: the
launcher's worker that ended the job, for ``otel-forge run`` around a launcher), ``["disabled", why]``
the run is not to be opened (logging was disabled: a run id that names no run, a store that refuses).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_forge.journal import JournalWriter
from otel_forge.mlflow.spool_files import HEADER, make_spool_dir, write_atomically, writer_identity
from otel_forge.ratelimit import RateLimitedLogger

if TYPE_CHECKING:
    from otel_forge.mlflow.client import TrackingClient

_logger = logging.getLogger(__name__)

KIND = "journal"
JOURNAL_FILE = "journal.log"
CURSOR_FILE = "delivered.json"

PLAN, DESCRIBE, OPENED, METRICS, RECORD, CHECKPOINT, END = "plan", "describe", "opened", "m", "rec", "ckpt", "end"
DISABLED = "disabled"  # the run is not to be opened (a mistyped run id): nothing is delivered

_END_WAIT_S = 1.0  # for the lock of an append in flight: another thread's ends within it
_encode = json.JSONEncoder(separators=(",", ":")).encode  # NaN stays NaN: a diverged loss is worth seeing


@dataclass(frozen=True)
class RunEnd:
    """How the training process ended the run: what the journal's ``end`` entry holds."""

    status: str
    rejected: int = 0
    worker: str | None = None  # the launcher's worker that ended the job (``otel-forge run`` around a launcher)


@dataclass(frozen=True)
class Record:
    """One call that describes the run, as data: ``tags`` and ``params`` (key -> value), ``dict``
    and ``text`` artifacts (``{"name", "data"}``), ``run_name`` (the new name)."""

    kind: str
    payload: Any

    def deliver(self, client: TrackingClient, run_id: str) -> None:
        from otel_forge.mlflow.client import import_mlflow

        entities = import_mlflow().entities
        if self.kind == "tags":
            client.log_batch(run_id, tags=[entities.RunTag(k, v) for k, v in self.payload.items()], synchronous=True)
        elif self.kind == "params":
            client.log_batch(run_id, params=[entities.Param(k, v) for k, v in self.payload.items()], synchronous=True)
        elif self.kind == "dict":
            client.log_dict(run_id, self.payload["data"], self.payload["name"])
        elif self.kind == "run_name":
            client.update_run(run_id, name=self.payload)
        else:
            client.log_text(run_id, self.payload["data"], self.payload["name"])


class RunJournal:
    """The training process's side: one append per call, no lock held across I/O, no MLflow.

    Only ``metrics`` raises (``OSError``: its caller counts the values lost); an entry that
    describes or ends the run and cannot be written (a full or failing disk) is told, once a minute,
    and the delivery makes do without it (the end: ``end`` returns False, and its caller hands the
    status to the delivery by other means).
    """

    def __init__(self, directory: Path, tracking_uri: str, launcher: bool = False) -> None:
        make_spool_dir(directory)
        # launcher: `otel-forge run`'s own journal, delivered first (it opens the job's run).
        header = {"kind": KIND, "tracking_uri": tracking_uri, "launcher": launcher, **writer_identity()}
        write_atomically(directory / HEADER, json.dumps(header))
        self.directory = directory
        self._writer = JournalWriter(directory / JOURNAL_FILE)
        self._warnings = RateLimitedLogger(_logger)

    @classmethod
    def create(cls, root: Path, tracking_uri: str, launcher: bool = False) -> RunJournal:
        return cls(root / f"journal-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}", tracking_uri, launcher)

    def metrics(self, values: Mapping[str, float], step: int, timestamp_ms: int) -> None:
        self._writer.append(_encode([METRICS, step, timestamp_ms, values]).encode())

    def plan(self, plan: Mapping[str, object]) -> None:
        self._append(PLAN, plan)

    def describe(self, description: Mapping[str, object]) -> None:
        self._append(DESCRIBE, description)

    def opened(self, run: Mapping[str, object]) -> None:
        self._append(OPENED, run)

    def record(self, record: Record) -> None:
        self._append(RECORD, record.kind, record.payload)

    def checkpoint(self, step: int, path: str, model_name: str) -> None:
        self._append(CHECKPOINT, step, path, model_name)

    def disabled(self, why: str) -> None:
        self._append(DISABLED, why)

    def end(self, status: str, rejected: int, worker: str | None = None) -> bool:
        """The run's end; False where it is not journaled: a signal handler interrupted an append of
        this thread (its delivery ends the run KILLED, as the signal means), or the disk refused it."""
        entry = [END, status, rejected] if worker is None else [END, status, rejected, worker]
        return self._append(*entry, timeout_s=_END_WAIT_S)

    def _append(self, *entry: object, timeout_s: float = -1) -> bool:
        try:
            self._writer.append(_encode(list(entry)).encode(), timeout_s=timeout_s)
        except TimeoutError:
            return False
        except (OSError, ValueError) as error:  # a full or failing disk; a writer closed under us
            self._warnings.warning(
                "entry", "MLflow: the run's journal in %s cannot be written (%s): its %r entry is not kept",
                self.directory, getattr(error, "strerror", None) or error, entry[0],
            )  # fmt: skip
            return False
        return True


def decode(payload: bytes) -> list[Any] | None:
    """An entry, or None for bytes that are not one (written by another version, say)."""
    try:
        entry = json.loads(payload)
    except ValueError:
        return None
    return entry if isinstance(entry, list) and entry and isinstance(entry[0], str) else None


def is_journal(path: Path) -> bool:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads((path / HEADER).read_text()).get("kind") == KIND
    return False


def read_header(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / HEADER).read_text()))
