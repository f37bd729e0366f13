"""Which threads talk to a server. A call that must never wait on a server (``log()``, ``export()``,
``submit()``) is checked by what it did, not by how fast it was: ``SocketIO`` counts the socket
operations each watched call made on its own thread, and that count must be 0 (the work was queued
for another thread). Installed on ``socket.socket``, so MLflow's HTTP client (http.client, urllib3)
is seen whatever it calls."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_OPERATIONS = ("connect", "connect_ex", "send", "sendall", "sendto", "recv", "recv_into", "recvfrom")


class SocketIO:
    """Counts socket operations made on a thread while it is inside ``watching()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.operations = 0  # made by watched calls on their own thread
        self.watched_calls = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        for name in _OPERATIONS:
            monkeypatch.setattr(socket.socket, name, self._counted(getattr(socket.socket, name)), raising=True)

    def _counted(self, operation: Callable[..., Any]) -> Callable[..., Any]:
        def counted(sock: socket.socket, *args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "watching", False):
                with self._lock:
                    self.operations += 1
            return operation(sock, *args, **kwargs)

        return counted

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count what the current thread does on sockets inside this block."""
        self._local.watching = True
        try:
            yield
        finally:
            self._local.watching = False
            with self._lock:
                self.watched_calls += 1

    def watched(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` wrapped so that every call of it is watched, on whichever thread it runs."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.watching():
                return call(*args, **kwargs)

        return wrapper


@pytest.fixture
def socket_io(monkeypatch: pytest.MonkeyPatch) -> SocketIO:
    return SocketIO(monkeypatch)
