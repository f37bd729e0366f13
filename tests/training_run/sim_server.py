"""An in-memory tracking server for the delivery's simulation test (``test_delivery_simulation.py``).

It answers the calls a journal's delivery makes, as MLflow's SQL store would: a ``log_batch`` of
metrics keeps a value once per (key, step, timestamp, value), as MLflow drops an exact duplicate;
tags and params are kept, a param is never changed. It fails as the simulation tells it to, raising
MLflow's own ``MlflowException`` with the error code (and so the HTTP status) a real server gives,
or the text of a refused connection. Only what the delivery calls is here: the rest of MLflow's
client is not faked, and the real-process tests (``tests/faults``) run against a real server.
"""

from __future__ import annotations

import enum
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from mlflow.exceptions import MlflowException

EXPERIMENT_ID, EXPERIMENT = "1", "sim"


class Health(enum.Enum):
    UP = "up"
    REFUSED = "refused"  # takes no connection
    UNAUTHORIZED = "401"
    FORBIDDEN = "403"
    TOO_MANY = "429"  # with a Retry-After
    FAILING = "500"
    APPLIES_THEN_TIMES_OUT = "timeout"  # the call is applied, its answer lost: the caller sees a timeout
    REFUSES_VALUES = "400"  # a log_batch of metrics is refused as bad input (the other calls pass)


_ERRORS = {
    Health.UNAUTHORIZED: ("UNAUTHENTICATED", "credentials refused"),
    Health.FORBIDDEN: ("PERMISSION_DENIED", "no permission"),
    Health.TOO_MANY: ("RESOURCE_EXHAUSTED", "too many requests"),
    Health.FAILING: ("INTERNAL_ERROR", "the store failed"),
}


@dataclass
class SimRun:
    run_id: str
    status: str = "RUNNING"
    metrics: dict[str, list[tuple[int, int, float]]] = field(default_factory=lambda: defaultdict(list))
    seen: set[tuple[str, int, int, float]] = field(default_factory=set)
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    name: str = "sim-run"


class SimServer:
    """The server's state; ``client()`` is what the delivery is given as MLflow's client."""

    def __init__(self) -> None:
        self.health = Health.UP
        self.retry_after_s = 7.0
        self.runs: dict[str, SimRun] = {}
        self.refused: list[tuple[str, int, float]] = []  # values refused one by one: dropped by the delivery
        self.calls = 0
        self._ids = itertools.count()

    def create_run(self) -> str:
        run_id = f"{next(self._ids):032x}"
        self.runs[run_id] = SimRun(run_id)
        return run_id

    def client(self) -> SimClient:
        return SimClient(self)

    def answer(self) -> bool:
        """Fail the call as the server's health says; True where it is to be applied, then time out."""
        self.calls += 1
        if self.health in (Health.UP, Health.REFUSES_VALUES):
            return False
        if self.health is Health.REFUSED:
            raise MlflowException("API request failed: ConnectionError: [Errno 111] Connection refused")
        if self.health is Health.APPLIES_THEN_TIMES_OUT:
            return True
        code, message = _ERRORS[self.health]
        raise MlflowException(message, error_code=code)

    def retry_after(self, error: BaseException) -> float | None:
        """The Retry-After of a 429 (what ``asked_pause_s`` reads from a real server)."""
        status = getattr(error, "get_http_status_code", lambda: None)()
        return self.retry_after_s if status == 429 else None


class SimClient:
    """The calls of ``MlflowClient`` a journal's delivery makes, on a ``SimServer``."""

    def __init__(self, server: SimServer) -> None:
        self._server = server

    def _call(self, run_id: str, apply: Any) -> None:
        times_out = self._server.answer()
        if run_id not in self._server.runs:
            raise MlflowException(f"run {run_id} not found", error_code="RESOURCE_DOES_NOT_EXIST")
        apply(self._server.runs[run_id])
        if times_out:
            raise MlflowException("API request failed: ReadTimeout: Read timed out. (read timeout=30)")

    def log_batch(
        self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = (), synchronous: bool = True
    ) -> None:
        def apply(run: SimRun) -> None:
            for metric in metrics:
                identity = (metric.key, metric.step, metric.timestamp, metric.value)
                if identity not in run.seen:  # MLflow's store drops an exact duplicate
                    run.seen.add(identity)
                    run.metrics[metric.key].append((metric.step, metric.timestamp, metric.value))
            for param in params:
                if run.params.get(param.key, param.value) != param.value:
                    raise MlflowException("Changing param values is not allowed", error_code="INVALID_PARAMETER_VALUE")
                run.params[param.key] = param.value
            run.tags.update({tag.key: tag.value for tag in tags})

        self._call(run_id, apply)

    def set_tag(self, run_id: str, key: str, value: str, synchronous: bool = True) -> None:
        self._call(run_id, lambda run: run.tags.__setitem__(key, value))

    def set_terminated(self, run_id: str, status: str = "FINISHED") -> None:
        self._call(run_id, lambda run: setattr(run, "status", status))

    def update_run(self, run_id: str, status: str | None = None, name: str | None = None) -> None:
        def apply(run: SimRun) -> None:
            run.status = status or run.status
            run.name = name or run.name

        self._call(run_id, apply)

    def delete_tag(self, run_id: str, key: str) -> None:
        self._call(run_id, lambda run: run.tags.pop(key, None))

    def log_dict(self, run_id: str, data: Any, name: str) -> None:
        self._call(run_id, lambda run: None)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        self._call(run_id, lambda run: None)

    def get_run(self, run_id: str) -> Any:
        found: list[Any] = []
        self._call(run_id, found.append)
        run = found[0]
        info = SimpleNamespace(
            run_id=run.run_id,
            run_name=run.name,
            experiment_id=EXPERIMENT_ID,
            status=run.status,
            lifecycle_stage="active",
        )
        latest = [SimpleNamespace(key=key, step=values[-1][0]) for key, values in run.metrics.items()]
        return SimpleNamespace(info=info, data=SimpleNamespace(tags=dict(run.tags), _metric_objs=latest))

    def get_experiment(self, experiment_id: str) -> Any:
        self._server.answer()
        return SimpleNamespace(experiment_id=EXPERIMENT_ID, name=EXPERIMENT)

    def search_runs(self, *args: Any, **kwargs: Any) -> list[Any]:
        self._server.answer()
        return []

    def search_experiments(self, *args: Any, **kwargs: Any) -> list[Any]:
        self._server.answer()
        return []
