"""``CompanionSession``: one training process's share of its node's companion: the node's sampling
where it asked for it, its run's journal delivered, until it says stop or dies."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
from pathlib import Path
from typing import Any

import psutil

from otel_forge.mlflow.companion_link import DONE, read_message
from otel_forge.scrub import error_line

_logger = logging.getLogger(__name__)

_HUNG_CALL_MARGIN_S = 2.0
CLIENT_CHECK_S = 1.0  # how often a quiet session checks that its training process is alive, without a pidfd


class CompanionSession:
    """Serves ``conn``, the connection of the training process ``pid``."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._pid = pid
        self._pidfd = _pidfd(pid)

    def run(self) -> None:
        try:
            self._serve()
        except Exception as error:  # noqa: BLE001 - one session's failure leaves the others served
            _logger.warning("the session of process %d ended: %s", self._pid, error_line(error))
        finally:
            with contextlib.suppress(OSError):
                self._conn.sendall(DONE)
            self._conn.close()
            if self._pidfd is not None:
                os.close(self._pidfd)

    def _serve(self) -> None:
        message = self._next_message()
        if message is None or message[0] != "start":
            return
        _, config, node, sample, journal, tracking_uri = message
        monitor = _monitor(config, node) if sample else None
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
        if delivery is not None and delivering is not None:
            if stopped:
                delivery.finish(config.close_deadline_s(node.node_count), end)
            # The training process died: its windows wait for the run its journal opens (or gives up on).
            while delivering.is_alive() and delivery.run_id is None:
                delivering.join(0.1)
        if monitor is not None:
            if delivery is not None and delivery.run_id is None:
                _keep_windows_for_the_run(monitor, delivery.plan)
            monitor.stop()
        if delivering is not None:
            # Stopped: a call hung past the drain deadline is not waited for (the journal keeps its items).
            delivering.join(config.close_deadline_s(node.node_count) + _HUNG_CALL_MARGIN_S if stopped else None)
            if delivering.is_alive() and delivery is not None:
                delivery.say_left()

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


def _pidfd(pid: int) -> int | None:
    """An fd that becomes readable when ``pid`` ends (Linux 5.3); None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _monitor(config: Any, node: Any) -> Any:
    from otel_forge.mlflow.system_metrics.monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(config, node=node, run_pending=True)
    try:
        return monitor.start()
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
