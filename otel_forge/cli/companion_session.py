"""``CompanionSession``: one training process's share of its node's companion: the node's sampling
where it asked for it, its run's journal delivered, until it says stop or dies."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from otel_forge.mlflow.companion_link import DONE, read_message
from otel_forge.mlflow.delivery.engine import HUNG_AT_CLOSE_S
from otel_forge.mlflow.system_metrics.node_sampling import NodeSampling, SampledRun
from otel_forge.scrub import error_line

_logger = logging.getLogger(__name__)

# Past the drain deadline: a hung call is left within HUNG_AT_CLOSE_S, and the delivery ends.
_PAST_DEADLINE_S = HUNG_AT_CLOSE_S + 1.0
CLIENT_CHECK_S = 1.0  # how often a quiet session checks that its training process is alive, without a pidfd


class CompanionSession:
    """Serves ``conn``, the connection of the training process ``pid``."""

    def __init__(self, conn: socket.socket, pid: int, sampling: NodeSampling) -> None:
        self._conn = conn
        self._pid = pid
        self._pidfd = _pidfd(pid)
        self._sampling = sampling

    def run(self) -> threading.Thread | None:
        """Serve the session and answer ``DONE``. A delivery that goes on past the close's deadline
        (its calls answered) is returned: the caller lets the process go (its stderr), then awaits it."""
        try:
            return self._serve()
        except Exception as error:  # noqa: BLE001 - one session's failure leaves the others served
            _logger.warning("the session of process %d ended: %s", self._pid, error_line(error))
            return None
        finally:
            with contextlib.suppress(OSError):
                self._conn.sendall(DONE)
            self._conn.close()
            if self._pidfd is not None:
                os.close(self._pidfd)

    def _serve(self) -> threading.Thread | None:
        message = self._next_message()
        if message is None or message[0] != "start":
            return None
        _, config, node, sample, journal, tracking_uri = message
        monitor = _sampled_run(self._sampling, config, node) if sample else None
        attach = _Attach(monitor)
        delivery = _delivery(Path(journal), config, tracking_uri, attach) if journal else None
        delivering = threading.Thread(target=delivery.run, name="otel-forge-journal", daemon=True) if delivery else None
        if delivering is not None:
            delivering.start()
        stopped, end = False, None
        while (message := self._next_message()) is not None:
            if message[0] == "attach":
                attach(message[1], message[2])
            elif message[0] == "stop":
                stopped, end = True, message[1]
                break
        deadline_s = config.close_deadline_s(node.node_count) if stopped else None
        if delivery is not None and delivering is not None:
            if deadline_s is not None:
                delivery.finish(deadline_s, end)
            # The training process died: its windows wait for the run its journal opens (or gives up on).
            while delivering.is_alive() and delivery.run_id is None:
                delivering.join(0.1)
        if monitor is not None:
            if delivery is not None and delivery.run_id is None:
                _keep_windows_for_the_run(monitor, delivery.plan)
            monitor.stop()
        if delivering is None or delivery is None:
            return None
        if deadline_s is None:
            delivering.join()  # its training process died: the delivery has its patience
        elif _goes_on_past(deadline_s, delivering, delivery):
            delivery.say_going_on(os.getpid())
            return delivering
        elif delivering.is_alive():
            delivery.say_left()  # neither answered nor left by the delivery past the deadline
        return None

    def _next_message(self) -> tuple[Any, ...] | None:
        """The next message; None at the connection's end or once its training process is gone (a
        forked child of it may hold the connection open)."""
        watched = [self._conn.fileno()] if self._pidfd is None else [self._conn.fileno(), self._pidfd]
        while True:
            ready = select.select(watched, [], [], None if self._pidfd is not None else CLIENT_CHECK_S)[0]
            if watched[0] in ready:
                return read_message(self._conn)
            if ready or not psutil.pid_exists(self._pid):
                return None


def _goes_on_past(deadline_s: float, delivering: threading.Thread, delivery: Any) -> bool:
    """Whether the delivery goes on past the close's deadline (a call answered after it). One that
    hangs is left by the delivery itself, within ``HUNG_AT_CLOSE_S``, and says what it kept."""
    until = time.monotonic() + deadline_s + _PAST_DEADLINE_S
    while delivering.is_alive() and not delivery.answered_past_deadline and time.monotonic() < until:
        delivering.join(0.05)
    return delivering.is_alive() and delivery.answered_past_deadline


def _pidfd(pid: int) -> int | None:
    """An fd that becomes readable when ``pid`` ends (Linux 5.3); None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _sampled_run(sampling: NodeSampling, config: Any, node: Any) -> SampledRun | None:
    try:
        return sampling.sample(config, node)
    except Exception as error:  # noqa: BLE001 - the node's sampling must never cost the run
        _logger.warning("system metrics not sampled: %s", error_line(error))
        return None


def _keep_windows_for_the_run(monitor: Any, plan: dict[str, Any]) -> None:
    """The run never opened here: the windows wait for it, found by its job key once replayed."""
    key = (plan.get("node") or {}).get("job_key")
    if key and monitor.exporter is not None:
        monitor.exporter.keep_for_job_run(plan["experiment"], key)


class _Attach:
    """The monitor's windows go to the run once, whoever learns it first: the training process
    (it opened the run) or the journal's delivery (it opened it for a training process that died)."""

    def __init__(self, monitor: Any) -> None:
        self._monitor = monitor
        self._lock = threading.Lock()
        self._attached = False

    def __call__(self, run_id: str, known: Any) -> None:
        with self._lock:
            if self._monitor is None or self._attached:
                return
            self._attached = True
        self._monitor.attach(run_id, known)


def _delivery(journal: Path, config: Any, tracking_uri: str, attach: _Attach) -> Any:
    from otel_forge.mlflow.client import RunInfo
    from otel_forge.mlflow.training.journal_delivery import JournalDelivery

    def on_run(run: Any) -> None:
        attach(run.run_id, RunInfo(run.experiment_id, run.run_name or "", run.experiment))

    return JournalDelivery.for_config(journal, config, tracking_uri, on_run=on_run)
