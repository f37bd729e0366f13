"""``python -m otel_forge.cli.companion PARENT_PID``: a training process's companion, which samples
its node and delivers its run's journal (otel_forge/mlflow/companion.py)."""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from otel_forge.cli import configure_process
from otel_forge.scrub import error_line

_logger = logging.getLogger(__name__)

_HUNG_CALL_MARGIN_S = 2.0
PARENT_CHECK_S = 1.0  # how often a quiet companion checks that its training process is alive


def main(argv: list[str]) -> int:
    parent = int(argv[0])
    # Ctrl-C and a scheduler's SIGTERM reach the whole group: the training process's close stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_process(verbose=0)
    message = _next_message(parent)
    if message is None or message[0] != "start":
        return 0
    _, config, node, sample, journal, tracking_uri = message
    monitor = _monitor(config, node) if sample else None
    attach = _Attach(monitor)
    delivery = _delivery(Path(journal), config, tracking_uri, attach) if journal else None
    delivering = threading.Thread(target=delivery.run, name="otel-forge-journal", daemon=True) if delivery else None
    if delivering is not None:
        delivering.start()
    stopped, end = False, None
    while (message := _next_message(parent)) is not None:
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
    return 0


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


def _next_message(parent: int) -> tuple[Any, ...] | None:
    """The next message; None at the end of stdin or once the parent is gone."""
    while not select.select([0], [], [], PARENT_CHECK_S)[0]:
        if os.getppid() != parent:
            return None
    header = _read_exactly(4)
    frame = _read_exactly(int.from_bytes(header, "big")) if len(header) == 4 else b""
    try:
        return pickle.loads(frame) if frame else None
    except (pickle.UnpicklingError, EOFError):  # cut short: the parent died while writing
        return None


def _read_exactly(size: int) -> bytes:
    """``size`` bytes of stdin, fewer only at its end."""
    chunks: list[bytes] = []
    while size > 0 and (chunk := os.read(0, size)):
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
