"""``SamplerProcess``: a ``SystemMetricsMonitor`` in a process of its own, for a training process.

Sampling in the training process took its GIL from the loop: 5-9 ms of CPU a second at the default
10 s interval with 8 GPUs (bench/overhead.py). In a child the training process pays only a few
pickled messages per run, and a fork of it (a ``DataLoader`` worker) forks no sampling thread.

The child (``python -m otel_forge.cli.sampler``) reads pickled messages on its stdin, each after its
length in 4 bytes: the config and
node first (it samples from then on; the windows wait for the run), ``attach`` once the run is open,
``stop`` at close. It stops as well when its stdin ends or its parent dies, and ignores SIGINT and
SIGTERM: a terminal's Ctrl-C or a scheduler's SIGTERM reaches the whole process group, and the
training process's close stops it after them, its last windows delivered.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from typing import Any

from otel_forge.config import ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.mlflow.client import RunInfo
from otel_forge.node import NodeIdentity

_logger = logging.getLogger(__name__)

SAMPLER_MODULE = "otel_forge.cli.sampler"
_STOP_MARGIN_S = 5.0  # past the drain deadline, for the child's last collect and its exit


class SamplerProcess:
    """The node's sampler, in a child process; ``start``, ``attach`` and ``stop`` as a monitor's."""

    def __init__(self, config: ForgeConfig, node: NodeIdentity) -> None:
        # The process collector reads the training process, not the sampler.
        self.config = config if config.pid is not None else config.replace(pid=os.getpid())
        self.node = node
        self._pid = os.getpid()
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> SamplerProcess:
        environ = dict(os.environ)
        # The modules the parent sees (a script's directory, a test's fake NVML), the child sees.
        environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._process = subprocess.Popen(
            [sys.executable, "-m", SAMPLER_MODULE, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=environ,
        )
        self._send(("start", self.config, self.node))
        return self

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """The run is open: the windows sampled so far, and all after, go to it."""
        self._send(("attach", run_id, known))

    def stop(self) -> None:
        """Stop sampling; return once the child has delivered (or spooled) its last windows."""
        if self._process is None or forked_from(self._pid):
            return
        self._send(("stop",))
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(self.config.drain_deadline_s + _STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            _logger.warning("the system-metrics sampler (pid %d) did not stop in time; killed", self._process.pid)
            self._process.kill()
            self._process.wait()

    def _send(self, message: tuple[Any, ...]) -> None:
        stdin = self._process.stdin if self._process is not None else None
        if stdin is None or stdin.closed or forked_from(self._pid):
            return
        frame = pickle.dumps(message)
        try:
            stdin.write(len(frame).to_bytes(4, "big") + frame)
            stdin.flush()
        except OSError as error:  # the child died: its own output said why
            _logger.warning("the system-metrics sampler is gone: %s", error)
