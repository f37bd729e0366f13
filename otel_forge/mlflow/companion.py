"""``CompanionProcess``: the training process's companion, a child process that samples the node (a
``SystemMetricsMonitor``) and delivers the run's journal (a ``JournalDelivery``), either or both.

Neither belongs in the training process: sampling took its GIL from the loop (5-9 ms of CPU a second
with 8 GPUs), MLflow's client 30-400 µs a value, and the training process is the one that dies (the
OOM killer, preemption: SIGKILL). The companion outlives it: it delivers the journal to its last
complete record and ends the run (KILLED where the training process died without closing it).

The child (``python -m otel_forge.cli.companion``) reads pickled messages on its stdin, each after
its length in 4 bytes: ``start`` first (the config, the node, whether to sample, the journal),
``attach`` once the run is open, ``stop`` at close. It ignores SIGINT and SIGTERM: a terminal's
Ctrl-C or a scheduler's SIGTERM reaches the whole process group, and the training process's close
stops it after them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

from otel_forge.config import MLFLOW_RETRIES_VAR, ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.training.run_journal import RunEnd
from otel_forge.node import NodeIdentity

_logger = logging.getLogger(__name__)

COMPANION_MODULE = "otel_forge.cli.companion"
_STOP_MARGIN_S = 5.0  # past the drain deadlines, for the child's last collect and its exit
MOST_RESTARTS = 3  # companions started again after one ended unasked, per training process


class CompanionProcess:
    """The child that samples (``sample``) and delivers ``journal``; ``start``, ``attach``, ``stop``."""

    def __init__(
        self, config: ForgeConfig, node: NodeIdentity, *, sample: bool, journal: Path | None, tracking_uri: str
    ) -> None:
        # The process collector reads the training process, not the companion.
        self.config = config if config.pid is not None else config.replace(pid=os.getpid())
        self.node = node
        self.sample = sample
        self.journal = journal
        self.tracking_uri = tracking_uri
        self._pid = os.getpid()
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the child in place: stop() and a restart agree on it
        self._stopping = False
        self._restarts = 0
        self._attached: tuple[str, RunInfo | None] | None = None  # told again to a new child

    def start(self) -> CompanionProcess:
        with self._lock:
            self._spawn()
        return self

    def _spawn(self) -> None:
        environ = dict(os.environ)
        # The modules the parent sees (a script's directory, a test's fake NVML), the child sees.
        environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        environ[MLFLOW_RETRIES_VAR] = "0"  # its delivery retries, with its own backoff: one attempt a call
        self._process = process = subprocess.Popen(
            [sys.executable, "-m", COMPANION_MODULE, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=environ,
            start_new_session=False,
        )
        journal = str(self.journal) if self.journal is not None else None
        self._send(("start", self.config, self.node, self.sample, journal, self.tracking_uri))
        if self._attached is not None:
            self._send(("attach", *self._attached))
        # Blocked in waitpid until the child ends: no wake-up, no cost, while it lives.
        threading.Thread(target=self._watch, args=(process,), name="otel-forge-companion-watch", daemon=True).start()

    def _watch(self, process: subprocess.Popen[bytes]) -> None:
        """The companion ended before it was stopped (killed, crashed): a new one takes its journal on
        from where it delivered up to, and samples the node, so that the job's run goes on filling."""
        code = process.wait()
        with self._lock:
            if self._stopping or forked_from(self._pid) or process is not self._process:
                return
            if self._restarts >= MOST_RESTARTS:
                _logger.warning(
                    "the otel-forge companion (pid %d) ended (%s) %d times; the run's journal is kept for "
                    "`otel-forge replay --all`", process.pid, _how_it_ended(code), self._restarts + 1,
                )  # fmt: skip
                return
            self._restarts += 1
            _logger.warning(
                "the otel-forge companion (pid %d) ended (%s); a new one delivers the run's journal",
                process.pid,
                _how_it_ended(code),
            )
            self._spawn()

    @property
    def delivers(self) -> bool:
        """A companion runs, or one will be started again: the journal is being delivered."""
        process = self._process
        return process is not None and (process.poll() is None or self._restarts < MOST_RESTARTS)

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """The run is open: the windows sampled so far, and all after, go to it."""
        with self._lock:
            self._attached = (run_id, known)
            self._send(("attach", run_id, known))

    def stop(self, end: RunEnd | None = None) -> None:
        """Deliver what is left and stop sampling; return once the child is done (or its time is up:
        the journal keeps what it could not deliver). ``end``: the run's end the journal could not keep."""
        with self._lock:
            self._stopping = True
        if self._process is None or forked_from(self._pid):
            return
        self._send(("stop", end))
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):  # a child that died: what was buffered for it is moot
                self._process.stdin.close()
        try:
            self._process.wait(2 * self.config.close_deadline_s(self.node.node_count) + _STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            _logger.warning("the otel-forge companion (pid %d) did not stop in time; killed", self._process.pid)
            self._process.kill()
            self._process.wait()

    def _send(self, message: tuple[object, ...]) -> None:
        stdin = self._process.stdin if self._process is not None else None
        if stdin is None or stdin.closed or forked_from(self._pid):
            return
        frame = pickle.dumps(message)
        try:
            stdin.write(len(frame).to_bytes(4, "big") + frame)
            stdin.flush()
        except OSError as error:  # the child died: its watcher says so, and starts another
            _logger.debug("the otel-forge companion is gone: %s", error)


def _how_it_ended(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"
