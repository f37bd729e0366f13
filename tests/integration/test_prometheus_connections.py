"""``otel-forge monitor``'s ``/metrics`` under a flood of connections, as a hostile or broken neighbour
makes one: 600 idle kept-alive connections, 50 slowloris clients and clients that reset, with the
process's default fd limit and with ``ulimit -n 256``. Scrapes keep answering, with every collector's
metrics; the agent's threads stay bounded, it burns no CPU in a busy accept loop, prints no traceback."""

from __future__ import annotations

import contextlib
import http.client
import resource
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.servers import start_agent

IDLE = 600
SLOW = 50
SCRAPES = 15
HOLD_S = 6.0
# Metrics from collectors that open files to read (/proc, /sys): an fd-starved agent loses these first.
COLLECTED = (
    "system_cpu_utilization",
    "system_memory_usage_bytes",
    "process_cpu_time_seconds_total",
    "system_network_io_bytes_total",
    "system_filesystem_usage_bytes",
)


def _collector_errors(body: str) -> float:
    """``otel_forge_collector_errors_total``, every collector summed: a read that failed counts there."""
    lines = [line for line in body.splitlines() if line.startswith("otel_forge_collector_errors_total")]
    assert lines, body
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks (100 a second)


@pytest.fixture(autouse=True)
def _room_for_the_clients() -> None:
    """This test process holds ~700 sockets: raise its own soft fd limit if it is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 2048 or hard < 2048


@contextlib.contextmanager
def _flood(address: tuple[str, int]) -> Iterator[None]:
    """600 connections that send nothing, 50 that send a header byte a second, 50 that reset."""
    held = [socket.create_connection(address) for _ in range(IDLE)]
    slow = [socket.create_connection(address) for _ in range(SLOW)]
    for sock in slow:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
    stop = threading.Event()

    def dribble() -> None:
        while not stop.wait(1.0):
            for sock in slow:
                with contextlib.suppress(OSError):
                    sock.sendall(b"X")

    dribbler = threading.Thread(target=dribble, daemon=True)
    dribbler.start()
    for _ in range(SLOW):
        with contextlib.suppress(OSError):
            sock = socket.create_connection(address)
            sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset
    try:
        yield
    finally:
        stop.set()
        dribbler.join()
        for sock in held + slow:
            sock.close()


@pytest.mark.parametrize("fd_limit", [None, 256], ids=["default-fd-limit", "ulimit-n-256"])
def test_scrapes_answer_while_600_idle_50_slow_and_50_resetting_connections_are_held(fd_limit):
    agent = start_agent(
        ["--prometheus-host", "127.0.0.1", "--prometheus-port", "0", "--interval", "0.5"]
        + ["--collectors", "cpu,memory,process,network,disk"],
        fd_limit=fd_limit,
    )
    try:
        url = urllib.parse.urlsplit(agent.metrics_url)
        address = (url.hostname, url.port)
        first_body = agent.scrape()
        assert [name for name in COLLECTED if name not in first_body] == []
        threads_before = _threads(agent.pid)
        with _flood(address):
            cpu_before, started = _cpu_s(agent.pid), time.monotonic()
            answered = []
            for _ in range(SCRAPES):
                scraper = http.client.HTTPConnection(*address, timeout=10)
                scraper.request("GET", "/metrics")
                response = scraper.getresponse()
                answered.append((response.status, response.read().decode()))
                scraper.close()
                time.sleep(HOLD_S / SCRAPES)
            cpu_s, held_s = _cpu_s(agent.pid) - cpu_before, time.monotonic() - started
            threads_held = _threads(agent.pid)
        assert [status for status, _ in answered] == [200] * SCRAPES, agent.describe()
        # Every collector still reads: none lost its metrics to a descriptor the connections took.
        last_body = answered[-1][1]
        assert [name for name in COLLECTED if name not in last_body] == [], agent.describe()
        assert _collector_errors(last_body) == _collector_errors(first_body), agent.describe()
        assert threads_held <= threads_before + 1, (threads_before, threads_held)
        # A busy accept loop at the fd limit burns a whole core; sampling at 0.5 s and the scrapes, a few %.
        assert cpu_s < 0.5 * held_s, (cpu_s, held_s)
        assert agent.scrape()
    finally:
        agent.stop()
    for text in ("Traceback", "Too many open files", "EMFILE", "ERROR"):
        assert text not in agent.stderr, agent.stderr
