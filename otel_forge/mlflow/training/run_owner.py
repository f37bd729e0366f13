"""One thread that starts and ends a run (``RunOwner``), and the run it opened (``OpenRun``):
MLflow's active run is thread-local, and each of these calls is waited on under a deadline, so a
hung server cannot hold the caller."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from otel_forge.mlflow.client import TrackingClient

R = TypeVar("R")


@dataclass
class OpenRun:
    """The live run, as the owner thread opened it."""

    run_id: str
    run_name: str | None  # None where the run is not read (ranks other than 0)
    experiment_id: str | None  # None where nothing says it (a rank other than 0 given only the run id)
    experiment: str
    resumed: bool
    last_step: int | None
    client: TrackingClient = field(repr=False)
    described: bool = False  # the run already holds a job's params, tags and config

    def entry(self) -> dict[str, object]:
        """The run as a journal keeps it (its ``opened`` entry, a notice): what is known of it, not its
        client (which a copy would make, where it is made at its first call)."""
        return {name: getattr(self, name) for name in _ENTRY_FIELDS}

    @classmethod
    def from_entry(cls, known: Mapping[str, Any], client: TrackingClient, described: bool) -> OpenRun:
        return cls(
            known["run_id"], known.get("run_name"), known.get("experiment_id"), known.get("experiment") or "",
            bool(known.get("resumed")), known.get("last_step"), client, described,
        )  # fmt: skip


_ENTRY_FIELDS = ("run_id", "run_name", "experiment_id", "experiment", "resumed", "last_step")


class RunOwner:
    """One daemon thread that runs the run's start and end, each waited on under a deadline."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.Queue[tuple[Callable[[], object], concurrent.futures.Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((task, future))
        return future

    def call(self, task: Callable[[], R], deadline_s: float) -> R:
        return cast(R, self.submit(task).result(timeout=deadline_s))

    def close(self) -> None:
        self._tasks.put(None)

    def _serve(self) -> None:
        while (entry := self._tasks.get()) is not None:
            task, future = entry
            try:
                future.set_result(task())
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)
