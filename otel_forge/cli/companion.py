"""``python -m otel_forge.cli.companion ROOT KEY``: the node's companion, which samples the node and
delivers the runs' journals for every training process that connects (otel_forge/mlflow/companion.py;
``CompanionLink`` says where it listens). It leaves once its last session has ended."""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

from otel_forge.cli import configure_process
from otel_forge.cli.companion_session import CompanionSession
from otel_forge.mlflow.companion_link import CompanionLink, peer, receive_stderr
from otel_forge.mlflow.system_metrics.node_sampling import NodeSampling

_logger = logging.getLogger(__name__)

IDLE_S = 0.5  # how long the companion waits, its last session ended, for another before it leaves


def main(argv: list[str]) -> int:
    # Ctrl-C and a scheduler's SIGTERM reach the whole group: the training processes' closes stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_process(verbose=0)
    link = CompanionLink(Path(argv[0]), argv[1])
    listener = link.listen()  # the process that started us holds the link's lock meanwhile
    _say_listening()
    _serve(listener, link)
    return 0


def _say_listening() -> None:
    os.write(1, b"r")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


class StderrOwners:
    """The companion's stderr is the stderr of the oldest process it serves: its lines reach a
    terminal, and a process's stderr (a pipe someone reads to its end) is let go with its session."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: list[int] = []  # their stderr's fds here, oldest first

    def add(self, fd: int) -> None:
        with self._lock:
            self._owners.append(fd)
            if len(self._owners) == 1:
                os.dup2(fd, 2)

    def remove(self, fd: int) -> None:
        with self._lock:
            index = self._owners.index(fd)
            self._owners.pop(index)
            if index == 0:
                self._to_stderr(self._owners[0] if self._owners else None)
            os.close(fd)

    @staticmethod
    def _to_stderr(fd: int | None) -> None:
        if fd is not None:
            os.dup2(fd, 2)
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)


def _serve(listener: socket.socket, link: CompanionLink) -> None:
    sessions: list[threading.Thread] = []
    owners = StderrOwners()
    sampling = NodeSampling()  # one agent for the runs it samples into
    while True:
        if select.select([listener], [], [], IDLE_S)[0]:
            if (session := _accept(listener, owners, sampling)) is not None:
                sessions.append(session)
            continue
        sessions = [session for session in sessions if session.is_alive()]
        if sessions:
            continue
        with link.locked():
            if select.select([listener], [], [], 0)[0]:
                continue  # connected before we took the lock: served
            link.remove()
            listener.close()
            return


def _accept(listener: socket.socket, owners: StderrOwners, sampling: NodeSampling) -> threading.Thread | None:
    conn, _ = listener.accept()
    pid, uid = peer(conn)
    if uid != os.getuid():  # the root is private: only a process of ours should reach it
        _logger.warning("a connection from uid %d refused", uid)
        conn.close()
        return None
    session = threading.Thread(target=_session, args=(conn, pid, owners, sampling), name=f"otel-forge-session-{pid}")
    session.start()
    return session


def _session(conn: socket.socket, pid: int, owners: StderrOwners, sampling: NodeSampling) -> None:
    if (stderr := receive_stderr(conn)) is not None:
        owners.add(stderr)
    try:
        going_on = CompanionSession(conn, pid, sampling).run()
    finally:
        if stderr is not None:
            owners.remove(stderr)
    if going_on is not None:
        going_on.join()  # the companion stays while it delivers


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
