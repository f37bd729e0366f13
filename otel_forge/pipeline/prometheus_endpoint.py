"""The Prometheus ``/metrics`` endpoint: HTTP/1.1 on one asyncio event loop (one thread, whatever the
number of connections), answering every scrape from a ``PrometheusRendering`` (the last collect's bodies).

Connections are bounded the way node_exporter's Go server bounds them: a request head must arrive within
``header_timeout_s`` of the connection or of its first byte, a kept-alive connection waits at most
``idle_timeout_s`` for its next request, a response is written within ``write_timeout_s``. At most
``max_connections`` are open, fewer when the process's file-descriptor limit leaves less than
``fd_reserve`` for the collectors: a new connection over the bound closes the one that has waited
longest for a request (a scraper gets in; a flood of idle or slow clients cannot hold the endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_forge.pipeline.prometheus_rendering import PrometheusRendering

_logger = logging.getLogger(__name__)

_HEAD_LIMIT = 16 * 1024  # bytes of a request head (Prometheus sends ~300)
_HEAD_END = b"\r\n\r\n"

Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ConnectionLimits:
    """How long and how many: a connection that breaks a bound is closed."""

    header_timeout_s: float = 10.0
    # Longer than Prometheus's usual scrape intervals (15 s to 2 min): its kept-alive connection is reused.
    idle_timeout_s: float = 150.0
    write_timeout_s: float = 30.0
    max_connections: int = 512
    fd_reserve: int = 64  # descriptors left for the collectors, the exporters and MLflow's client
    # The listen backlog, which is also how many connections the loop accepts in one go before any is
    # admitted (asyncio's accept loop): a burst may hold that many descriptors over the bound.
    backlog: int = 64

    def connection_cap(self) -> int:
        """``max_connections``, or what the fd limit leaves once the fds in use, an accept burst and the
        reserve are counted."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        try:
            in_use = len(os.listdir("/proc/self/fd"))
        except OSError:
            in_use = 0
        return max(1, min(self.max_connections, soft - in_use - self.backlog - self.fd_reserve))


class _BadRequest(Exception):
    """A request answered with ``status`` and the connection closed."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


@dataclass
class _Request:
    method: str
    version: str
    headers: dict[str, str]

    @classmethod
    def parse(cls, head: bytes) -> _Request:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest("400 Bad Request")
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if line and not colon:
                raise _BadRequest("400 Bad Request")
            headers[name.strip().lower()] = value.strip()
        return cls(parts[0], parts[2], headers)

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless told not to; a request body (never read) ends it."""
        connection = self.headers.get("connection", "").lower()
        if self.headers.get("content-length", "0") != "0" or "transfer-encoding" in self.headers:
            return False
        return connection == "keep-alive" if self.version == "HTTP/1.0" else connection != "close"


@dataclass(eq=False)
class _Connection:
    writer: asyncio.StreamWriter
    waiting_since: float = field(default_factory=time.monotonic)
    answering: bool = False

    def close(self) -> None:
        self.writer.transport.abort()  # no lingering: a client that stopped reading holds no fd


class _MetricsServer:
    """The connections of one endpoint, on its event loop."""

    def __init__(self, rendering: PrometheusRendering, limits: ConnectionLimits, cap: int) -> None:
        self._rendering = rendering
        self._limits = limits
        self._cap = cap
        self._connections: set[_Connection] = set()
        # A scrape before the first collect runs that collect: off the loop, so other connections go on.
        self._renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="otel-forge-prometheus-render")
        self.evicted = 0

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        # drain() then returns once the response is with the kernel: closing never cuts a body short.
        writer.transport.set_write_buffer_limits(high=0)
        self._admit(connection)
        try:
            await self._serve(reader, connection)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as error:
            _logger.debug("prometheus connection ended: %r", error)
        finally:
            self._connections.discard(connection)
            connection.close()

    def _admit(self, connection: _Connection) -> None:
        if len(self._connections) >= self._cap:
            waiting = [c for c in self._connections if not c.answering]
            if waiting:
                oldest = min(waiting, key=lambda c: c.waiting_since)
                self._connections.discard(oldest)
                oldest.close()
                self.evicted += 1
                _logger.debug("prometheus endpoint at %d connections: closed the longest waiting", self._cap)
        self._connections.add(connection)

    async def _serve(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        wait_s = self._limits.header_timeout_s  # a new connection: its first head within the header timeout
        while True:
            connection.waiting_since, connection.answering = time.monotonic(), False
            with _closed_after(connection, wait_s):
                first = await reader.read(1)
            if not first:
                return  # the client closed, or the wait ran out
            try:
                with _closed_after(connection, self._limits.header_timeout_s):
                    head = first + await reader.readuntil(_HEAD_END)
                request = _Request.parse(head[: -len(_HEAD_END)])
            except asyncio.LimitOverrunError:
                return await self._answer_error(connection, "431 Request Header Fields Too Large")
            except _BadRequest as bad:
                return await self._answer_error(connection, bad.status)
            connection.answering = True
            if not await self._answer(connection, request):
                return
            wait_s = self._limits.idle_timeout_s

    async def _answer(self, connection: _Connection, request: _Request) -> bool:
        """Answer ``request``; True if the connection stays open for the next."""
        if request.method not in ("GET", "HEAD"):
            await self._answer_error(connection, "405 Method Not Allowed", (("Allow", "GET, HEAD"),))
            return False
        accept, accept_encoding = request.headers.get("accept"), request.headers.get("accept-encoding")
        answer = self._rendering.made_body(accept, accept_encoding)
        if answer is None:  # the first scrape of a collect translates and encodes it: off the loop
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(self._renderer, self._rendering.body, accept, accept_encoding)
        body, headers = answer
        keep_alive = request.keep_alive
        fields = (*headers, ("Content-Length", str(len(body))), *(() if keep_alive else (("Connection", "close"),)))
        await self._write(connection, "200 OK", fields, body if request.method == "GET" else b"")
        return keep_alive

    async def _answer_error(self, connection: _Connection, status: str, headers: Headers = ()) -> None:
        connection.answering = True
        body = status.encode() + b"\n"
        fields = (*headers, ("Content-Type", "text/plain"), ("Content-Length", str(len(body))), ("Connection", "close"))
        await self._write(connection, status, fields, body)

    async def _write(self, connection: _Connection, status: str, headers: Headers, body: bytes) -> None:
        head = [f"HTTP/1.1 {status}", f"Date: {_http_date()}"]
        head += [f"{name}: {value}" for name, value in headers]
        # Status, headers and body in one write: one send a scrape (two would wait out the scraper's
        # delayed ACK: Nagle's algorithm holds the second, ~40 ms a scrape).
        connection.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        if connection.writer.transport.get_write_buffer_size():  # the kernel did not take it all at once
            with _closed_after(connection, self._limits.write_timeout_s):
                await connection.writer.drain()

    def close_connections(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections.clear()
        self._renderer.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def _closed_after(connection: _Connection, seconds: float) -> Iterator[None]:
    """Close ``connection`` if the block still waits after ``seconds``: its read then ends (b"", or
    IncompleteReadError), its drain raises ConnectionError. A timer, not ``asyncio.wait_for``, which
    wraps each wait in a task of its own (Python < 3.12): a third of a cached scrape's CPU."""
    timer = asyncio.get_running_loop().call_later(seconds, connection.close)
    try:
        yield
    finally:
        timer.cancel()


@functools.lru_cache(maxsize=1)
def _date_of(second: int) -> str:
    return email.utils.formatdate(second, usegmt=True)


def _http_date() -> str:
    """The ``Date`` header, formatted once a second."""
    return _date_of(int(time.time()))


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # A client's reset or an accept at the fd limit (the loop retries in a second) is not the node's error.
    _logger.debug("prometheus endpoint: %s", context.get("exception") or context.get("message"))


@dataclass
class PrometheusEndpoint:
    """The HTTP server of ``/metrics``, on an event loop of its own thread."""

    url: str
    _loop: asyncio.AbstractEventLoop
    _server: _MetricsServer
    _listener: asyncio.Server
    _thread: threading.Thread

    @classmethod
    def serve(
        cls, rendering: PrometheusRendering, host: str, port: int, limits: ConnectionLimits | None = None
    ) -> PrometheusEndpoint:
        """Bind ``host:port`` (0: a free port) and serve; raises OSError when it cannot bind."""
        limits = limits or ConnectionLimits()
        sock = bind(host, port, limits.backlog)
        server = _MetricsServer(rendering, limits, limits.connection_cap())
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(_log_loop_error)
        serving = asyncio.start_server(server.serve_connection, sock=sock, limit=_HEAD_LIMIT, backlog=limits.backlog)
        listener = loop.run_until_complete(serving)
        thread = threading.Thread(target=loop.run_forever, name="otel-forge-prometheus", daemon=True)
        thread.start()
        bound_host, bound_port = str(sock.getsockname()[0]), sock.getsockname()[1]
        url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}/metrics"
        return cls(url, loop, server, listener, thread)

    def close(self) -> None:
        """Stop listening and end every connection, kept-alive ones included."""

        async def stop() -> None:
            self._listener.close()
            self._server.close_connections()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


def bind(host: str, port: int, backlog: int | None = None) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port), as the endpoint serves it; OSError if it cannot."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=backlog)
