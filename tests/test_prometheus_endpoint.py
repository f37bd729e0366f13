"""The ``/metrics`` endpoint's connections, as node_exporter's server treats them: one thread whatever the
number of connections, a header and an idle timeout, a bound on connections that lets a scraper in
(the longest-waiting connection makes room), HTTP answered as a client expects, resets logged at DEBUG."""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from otel_forge.pipeline.prometheus_endpoint import ConnectionLimits, PrometheusEndpoint
from otel_forge.pipeline.prometheus_rendering import PrometheusRendering

CLOSE_WAIT_S = 5.0  # how long a test waits for the server to close a connection: a wait, not a measure


@pytest.fixture
def serve() -> Iterator:
    endpoints: list[PrometheusEndpoint] = []

    def serve(limits: ConnectionLimits) -> tuple[str, int]:
        endpoint = PrometheusEndpoint.serve(PrometheusRendering(), "127.0.0.1", 0, limits)
        endpoints.append(endpoint)
        host, port = endpoint.url.split("//")[1].split("/")[0].rsplit(":", 1)
        return host, int(port)

    yield serve
    for endpoint in endpoints:
        endpoint.close()


def _closed_by_server(sock: socket.socket, within_s: float = CLOSE_WAIT_S) -> bool:
    """True once the server ends the connection (EOF or reset) within ``within_s``; False if still open."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _raw(address: tuple[str, int], request: bytes) -> bytes:
    """The server's whole answer to ``request`` on a connection of its own, read until it closes."""
    with socket.create_connection(address, timeout=CLOSE_WAIT_S) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_a_silent_or_slow_client_is_closed_after_the_header_timeout_an_idle_one_after_the_idle_timeout(serve):
    address = serve(ConnectionLimits(header_timeout_s=0.5, idle_timeout_s=3.0))
    silent = socket.create_connection(address)
    slow = socket.create_connection(address)
    slow.sendall(b"GET /metrics HTTP/1.1\r\n")
    stop = threading.Event()

    def dribble() -> None:  # slowloris: a header byte every 0.1 s, never the blank line
        while not stop.wait(0.1):
            try:
                slow.sendall(b"X")
            except OSError:
                return

    threading.Thread(target=dribble, daemon=True).start()
    scraper = http.client.HTTPConnection(*address, timeout=CLOSE_WAIT_S)
    scraper.request("GET", "/metrics")
    assert scraper.getresponse().read() is not None
    try:
        assert _closed_by_server(silent)
        assert _closed_by_server(slow)
        # Kept alive past the header timeout: a scraper's connection waits for the next scrape...
        assert not _closed_by_server(scraper.sock, within_s=1.0)
        # ...and is closed once idle longer than the idle timeout.
        assert _closed_by_server(scraper.sock)
    finally:
        stop.set()
        for sock in (silent, slow):
            sock.close()
        scraper.close()


def test_over_the_connection_bound_the_longest_waiting_connection_makes_room_for_a_scraper(serve):
    address = serve(ConnectionLimits(max_connections=4))
    held = []
    for _ in range(4):
        held.append(socket.create_connection(address))
        time.sleep(0.05)  # their order of arrival, as the server sees it
    scraper = http.client.HTTPConnection(*address, timeout=CLOSE_WAIT_S)
    scraper.request("GET", "/metrics")
    assert scraper.getresponse().status == 200
    assert _closed_by_server(held[0])
    assert [_closed_by_server(sock, within_s=0.2) for sock in held[1:]] == [False, False, False]
    for sock in held:
        sock.close()
    scraper.close()


def test_connections_share_one_thread_and_resets_are_logged_at_debug_only(serve, caplog):
    caplog.set_level(logging.DEBUG)
    before = {t.ident for t in threading.enumerate()}  # an endpoint of another test is not this one's
    address = serve(ConnectionLimits())
    held = [socket.create_connection(address) for _ in range(100)]
    for _ in range(20):  # a client that resets its connection mid-request, and one after its request
        for request in (b"GET /metr", b"GET /metrics HTTP/1.1\r\n\r\n"):
            sock = socket.create_connection(address)
            sock.sendall(request)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
    scraper = http.client.HTTPConnection(*address, timeout=CLOSE_WAIT_S)
    scraper.request("GET", "/metrics")
    assert scraper.getresponse().status == 200
    serving = [t.name for t in threading.enumerate() if t.ident not in before]
    assert len(serving) <= 2, serving  # the event loop, and the thread a first collect renders on
    loud = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert loud == [], [r.getMessage() for r in loud]
    assert any("connection ended" in r.getMessage() for r in caplog.records)
    for sock in held:
        sock.close()
    scraper.close()


def test_http_as_a_client_expects_it(serve):
    address = serve(ConnectionLimits())
    head = _raw(address, b"HEAD /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n"), head  # no body
    assert b"Content-Length: " in head
    post = _raw(address, b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi")
    assert post.startswith(b"HTTP/1.1 405 ") and b"Allow: GET, HEAD" in post
    assert _raw(address, b"HELLO\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    huge = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    assert _raw(address, huge).startswith(b"HTTP/1.1 431 ")
    # HTTP/1.0 without keep-alive: one answer, then the server closes (_raw reads until it does).
    old = _raw(address, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert old.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close" in old
