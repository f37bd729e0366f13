"""``python -m otel_forge.cli.sampler PARENT_PID``: the node's sampler for a training process, which
started it and talks to it on its stdin (otel_forge/mlflow/system_metrics/sampler_process.py)."""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
from typing import Any

from otel_forge.cli import configure_process
from otel_forge.mlflow.system_metrics.monitor import SystemMetricsMonitor
from otel_forge.scrub import error_line

_logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0  # how often a quiet sampler checks that its training process is alive


def main(argv: list[str]) -> int:
    parent = int(argv[0])
    # Ctrl-C and a scheduler's SIGTERM reach the whole group: the training process's close stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_process(verbose=0)
    message = _next_message(parent)
    if message is None or message[0] != "start":
        return 0
    _, config, node = message
    monitor = SystemMetricsMonitor(config, node=node, run_pending=True)
    try:
        monitor.start()
    except Exception as error:  # noqa: BLE001 - the node's sampling must never cost the run
        _logger.warning("system metrics not sampled: %s", error_line(error))
        return 1
    try:
        while (message := _next_message(parent)) is not None and message[0] == "attach":
            monitor.attach(message[1], message[2])
    finally:
        monitor.stop()
    return 0


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
