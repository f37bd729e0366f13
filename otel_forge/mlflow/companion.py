"""``CompanionProcess``: a training process's session on its node's companion, the process that
samples the node (``NodeSampling``: one agent for all the runs it samples into) and delivers the
run's journal (a ``JournalDelivery``), either or both.

Neither belongs in the training process: sampling took its GIL from the loop (5-9 ms of CPU a second
with 8 GPUs), MLflow's client 30-400 µs a value, and the training process is the one that dies (the
OOM killer, preemption: SIGKILL). The companion outlives it: it delivers the journal to its last
complete record and ends the run (KILLED where the training process died without closing it).

One companion serves the node (``CompanionLink`` says which processes share one): the first
training process to need it starts it (``python -m otel_forge.cli.companion``, its child), the
others connect to it, and it leaves once its last session has ended. On the connection: this
process's stderr, then ``start`` (the config, the node, whether to sample, the journal), ``attach``
once the run is open, ``stop`` at close; the companion answers ``DONE`` when the session has
ended. It ignores SIGINT and SIGTERM: a terminal's Ctrl-C or a scheduler's SIGTERM reaches the whole
process group, and the training process's close stops its session after them. A companion that dies
is started again by each process it served (at most ``MOST_RESTARTS`` times each), and the new one
takes each journal on from where it was delivered up to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path

from otel_forge.config import MLFLOW_RETRIES_VAR, ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.companion_link import DONE, CompanionLink, peer, send_message, send_stderr
from otel_forge.mlflow.training.run_journal import RunEnd
from otel_forge.node import NodeIdentity
from otel_forge.private_dirs import host_state_location, private_tree

_logger = logging.getLogger(__name__)

COMPANION_MODULE = "otel_forge.cli.companion"
_STOP_MARGIN_S = 5.0  # past the drain deadlines, for the session's last collect
_LISTENING_TIMEOUT_S = 30.0  # for a companion just started to listen (an interpreter's start, on a busy node)
MOST_RESTARTS = 3  # companions started again after one ended unasked, per training process


class CompanionProcess:
    """This process's session on the node's companion, which samples (``sample``) and delivers
    ``journal``; ``start``, ``attach``, ``stop``."""

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
        self._link: CompanionLink | None = None
        self._sock: socket.socket | None = None
        self.pid: int | None = None  # the companion's
        self._process: subprocess.Popen[bytes] | None = None  # the companion, where this process started it
        self._ended = threading.Event()  # the session ended: its DONE, or the companion's death while stopping
        self._lock = threading.Lock()  # the session in place: stop() and a restart agree on it
        self._stopping = False
        self._restarts = 0
        self._given_up = False
        self._attached: tuple[str, RunInfo | None] | None = None  # told again to a new companion

    def start(self) -> CompanionProcess:
        with self._lock:
            self._link = CompanionLink.for_this_process(private_tree(*host_state_location("companions")))
            self._join(self._link)
        return self

    def _join(self, link: CompanionLink) -> None:
        """A session on the node's companion, started here where none listens."""
        with link.locked():
            sock = link.connect()
            if sock is None:
                self._process = self._spawn(link)
                sock = link.connect()
        if sock is None:
            raise OSError("the otel-forge companion does not take connections")
        try:
            send_stderr(sock)  # first: the companion reads it before any message (a failure here is said)
        except OSError:
            sock.close()
            raise
        self._sock, self.pid, self._ended = sock, peer(sock)[0], threading.Event()
        journal = str(self.journal) if self.journal is not None else None
        self._send(("start", self.config, self.node, self.sample, journal, self.tracking_uri))
        if self._attached is not None:
            self._send(("attach", *self._attached))
        # Blocked in recv until the session ends: no wake-up, no cost, while it lives.
        threading.Thread(target=self._watch, args=(sock,), name="otel-forge-companion-watch", daemon=True).start()

    @staticmethod
    def _spawn(link: CompanionLink) -> subprocess.Popen[bytes]:
        environ = dict(os.environ)
        # The modules the parent sees (a script's directory, a test's fake NVML), the child sees.
        environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        environ[MLFLOW_RETRIES_VAR] = "0"  # its delivery retries, with its own backoff: one attempt a call
        process = subprocess.Popen(
            [sys.executable, "-m", COMPANION_MODULE, str(link.root), link.key],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=environ,
        )
        assert process.stdout is not None
        with process.stdout:  # it writes one byte once it listens, and closes its end
            listening = select.select([process.stdout], [], [], _LISTENING_TIMEOUT_S)[0] and process.stdout.read(1)
        if not listening:
            process.kill()
            process.wait()
            raise OSError(f"the otel-forge companion did not start listening in {_LISTENING_TIMEOUT_S:g} s")
        # Its exit, whenever it comes (after its last session, any process's), is reaped here.
        threading.Thread(target=process.wait, name="otel-forge-companion-reap", daemon=True).start()
        return process

    def _watch(self, sock: socket.socket) -> None:
        """The companion ended before the session did (killed, crashed): a new one takes the journal on
        from where it was delivered up to, and samples the node, so that the job's run goes on filling."""
        with contextlib.suppress(OSError):
            if sock.recv(1) == DONE:
                self._ended.set()
                return
        with self._lock:
            if sock is not self._sock or forked_from(self._pid):
                return
            if self._stopping or self._link is None:
                self._ended.set()
                return
            how = self._how_it_ended()
            if self._restarts >= MOST_RESTARTS:
                self._give_up(
                    "the otel-forge companion (pid %d) ended (%s) %d times; the run's journal is kept for "
                    "`otel-forge replay --all`", self.pid, how, self._restarts + 1,
                )  # fmt: skip
                return
            self._restarts += 1
            _logger.warning(
                "the otel-forge companion (pid %d) ended (%s); a new one delivers the run's journal", self.pid, how
            )
            try:
                self._join(self._link)
            except OSError as error:
                self._give_up(
                    "no otel-forge companion delivers the run's journal (%s); it is kept for `otel-forge replay --all`",
                    error,
                )

    def _how_it_ended(self) -> str:
        process = self._process
        if process is not None and process.pid == self.pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(timeout=5)
                return f"signal {-code}" if code < 0 else f"exit code {code}"
        return "its connection closed"

    def _give_up(self, message: str, *args: object) -> None:
        _logger.warning(message, *args)
        self._given_up = True
        self._ended.set()

    @property
    def delivers(self) -> bool:
        """A companion holds this session, or one will be started again: the journal is being delivered."""
        return self._sock is not None and not self._given_up

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """The run is open: the windows sampled so far, and all after, go to it."""
        with self._lock:
            self._attached = (run_id, known)
            self._send(("attach", run_id, known))

    def stop(self, end: RunEnd | None = None) -> None:
        """Deliver what is left and stop sampling; return once the session is done (or its time is up:
        the journal keeps what it could not deliver). ``end``: the run's end the journal could not keep."""
        with self._lock:
            self._stopping = True
            sock = self._sock
            if sock is None or forked_from(self._pid):
                return
            self._send(("stop", end))
        if not self._ended.wait(2 * self.config.close_deadline_s(self.node.node_count) + _STOP_MARGIN_S):
            _logger.warning("the otel-forge companion (pid %d) did not end this run's session in time", self.pid)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the watch, still in recv where the session did not end
        sock.close()

    def _send(self, message: tuple[object, ...]) -> None:
        if self._sock is None or forked_from(self._pid):
            return
        try:
            send_message(self._sock, message)
        except OSError as error:  # the companion died: the watch says so, and starts another
            _logger.debug("the otel-forge companion is gone: %s", error)
