"""Real processes for integration tests: a Prometheus server and an ``otel-forge monitor`` agent.

Every server binds 127.0.0.1 on a free port and runs in its own process group, so ``stop()``
(and the ``kill()`` a finalizer calls) ends the whole tree and nothing outlives the test.
Both process classes are context managers; tests hold them in fixtures that stop them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from testkit import gpu_fakes
from testkit.hermetic import hermetic_environ

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_BINARY = "prometheus"
# Prometheus's own scrape Accept header (scrape/scrape.go, 2.x): OpenMetrics preferred.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    interval_s: float = 0.1,
    message: str | Callable[[], str] = "condition",
) -> T:
    """Call ``predicate`` until it returns something truthy and return that; fail after ``timeout_s``.

    An exception from ``predicate`` counts as "not yet"; the last one is named on timeout.
    """
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
        except Exception as error:  # noqa: BLE001 - retried until the deadline
            result, last_error = None, error
        if result:
            return result
        if time.monotonic() >= deadline:
            what = message() if callable(message) else message
            detail = f"; last error: {last_error!r}" if last_error is not None else ""
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}{detail}")
        time.sleep(interval_s)


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """GET ``url``: (status, body text). An HTTP error status is returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _kill_group(process: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _stop_group(process: subprocess.Popen[Any], sig: int, timeout_s: float) -> int:
    """Send ``sig`` to the process group, wait ``timeout_s``, then SIGKILL the group. Exit code."""
    if process.poll() is None:
        _kill_group(process, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
    # Children of the leader (if any) go too, whatever the leader did.
    _kill_group(process, signal.SIGKILL)
    return process.wait()


class _LineReader:
    """Drains a pipe on a daemon thread, so the child never blocks on a full pipe."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._condition = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: Any) -> None:
        for line in stream:
            with self._condition:
                self.lines.append(line.rstrip("\n"))
                self._condition.notify_all()
        stream.close()
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def wait_for_line(self, predicate: Callable[[str], bool], timeout_s: float) -> str | None:
        """The first line matching ``predicate``; None if the stream ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    return None
                self._condition.wait(remaining)

    def join(self, timeout_s: float = 5.0) -> None:
        self._thread.join(timeout_s)

    @property
    def text(self) -> str:
        with self._condition:
            return "\n".join(self.lines)


# --- Prometheus ---------------------------------------------------------------------------------


class PrometheusServer:
    """A real ``prometheus`` process; ``query`` runs PromQL through its HTTP API."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, directory: Path) -> None:
        self.process = process
        self.url = url
        self.directory = directory

    @property
    def log(self) -> str:
        path = self.directory / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant-query result vector: ``[{"metric": {labels}, "value": [ts, "text"]}, ...]``."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        status, body = http_get(url)
        reply = json.loads(body)
        if status != 200 or reply.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed ({status}): {reply.get('error', body)}")
        return reply["data"]["result"]

    def wait_for_series(self, promql: str, timeout_s: float = 10.0, min_series: int = 1) -> list[dict[str, Any]]:
        """Poll ``promql`` until it returns at least ``min_series`` series; return them."""
        return wait_for(
            lambda: (lambda result: result if len(result) >= min_series else None)(self.query(promql)),
            timeout_s,
            interval_s=0.2,
            message=lambda: f"{min_series} series of {promql!r}; targets: {self.targets_health()}",
        )

    def targets_health(self) -> list[tuple[str, str, str]]:
        """(scrape URL, health, last error) per active target, for failure messages."""
        try:
            _, body = http_get(f"{self.url}/api/v1/targets")
            return [(t["scrapeUrl"], t["health"], t["lastError"]) for t in json.loads(body)["data"]["activeTargets"]]
        except Exception as error:  # noqa: BLE001 - only for diagnostics
            return [("?", "?", repr(error))]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        return _stop_group(self.process, sig, timeout_s)

    def kill(self) -> None:
        _stop_group(self.process, signal.SIGKILL, 5.0)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def prometheus_config(
    scrape_targets: Sequence[str], scrape_interval_s: float = 1, rule_files: Sequence[str | Path] | None = None
) -> str:
    """prometheus.yml text: one job, ``otel-forge``, scraping ``scrape_targets`` (host:port)."""
    config: dict[str, Any] = {
        "global": {
            "scrape_interval": f"{scrape_interval_s}s",
            "evaluation_interval": f"{scrape_interval_s}s",
            "scrape_timeout": f"{scrape_interval_s}s",
        },
        "scrape_configs": [{"job_name": "otel-forge", "static_configs": [{"targets": list(scrape_targets)}]}],
    }
    if rule_files:
        config["rule_files"] = [str(path) for path in rule_files]
    # JSON is YAML: no YAML library needed.
    return json.dumps(config, indent=2)


def start_prometheus(
    tmp_path: Path,
    scrape_targets: Sequence[str],
    scrape_interval_s: float = 1,
    rule_files: Sequence[str | Path] | None = None,
    ready_timeout_s: float = 30.0,
) -> PrometheusServer:
    """Start Prometheus on 127.0.0.1:<free port> scraping ``scrape_targets``; wait for ``/-/ready``."""
    directory = Path(tmp_path) / "prometheus"
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "prometheus.yml"
    config_path.write_text(prometheus_config(scrape_targets, scrape_interval_s, rule_files))
    port = free_port()
    with open(directory / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS_BINARY,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=directory,
        )
    server = PrometheusServer(process, f"http://127.0.0.1:{port}", directory)
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {process.returncode}:\n{server.log}")
            return http_get(f"{server.url}/-/ready", timeout_s=1.0)[0] == 200

        _wait_or_raise(ready, ready_timeout_s, lambda: f"prometheus ready\n{server.log[-3000:]}")
    except BaseException:
        server.kill()
        raise
    return server


def _wait_or_raise(predicate: Callable[[], bool], timeout_s: float, message: Callable[[], str]) -> None:
    """``wait_for``, but an exception from ``predicate`` that says the process died ends it at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except RuntimeError:
            raise
        except Exception:  # noqa: BLE001 - not answering yet
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {message()}")
        time.sleep(0.1)


# --- the agent ----------------------------------------------------------------------------------

SERVING_PREFIX = "otel-forge: serving prometheus "


class AgentProcess:
    """An ``otel-forge monitor`` subprocess in its own process group."""

    def __init__(self, process: subprocess.Popen[str], stdout: _LineReader, stderr: _LineReader) -> None:
        self.process = process
        self._stdout = stdout
        self._stderr = stderr
        self.metrics_url: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stdout(self) -> str:
        return self._stdout.text

    @property
    def stderr(self) -> str:
        return self._stderr.text

    @property
    def scrape_target(self) -> str:
        """``host:port`` of the Prometheus endpoint, as a scrape config names it."""
        assert self.metrics_url is not None, "the agent serves no Prometheus endpoint"
        return urllib.parse.urlsplit(self.metrics_url).netloc

    def wait_serving(self, timeout_s: float) -> str:
        line = self._stdout.wait_for_line(lambda text: text.startswith(SERVING_PREFIX), timeout_s)
        if line is None:
            code = self.process.poll()
            state = f"exited with {code}" if code is not None else f"still running after {timeout_s} s"
            raise RuntimeError(
                f"otel-forge monitor {state} without serving Prometheus\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
            )
        self.metrics_url = line[len(SERVING_PREFIX) :].strip()
        return self.metrics_url

    def scrape(self) -> str:
        """The text of one ``/metrics`` scrape."""
        assert self.metrics_url is not None
        try:
            status, body = http_get(self.metrics_url)
        except OSError as error:
            raise AssertionError(f"GET {self.metrics_url}: {error}; {self.describe()}") from None
        assert status == 200, f"GET {self.metrics_url}: {status}; {self.describe()}"
        return body

    def describe(self) -> str:
        """Its state and output, for a failure message."""
        code = self.process.poll()
        state = "running" if code is None else f"exited with {code}"
        return f"otel-forge monitor {state}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"

    def send_signal(self, sig: int) -> None:
        """``sig`` to the agent itself (as a terminal or an init system would)."""
        self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        """Send ``sig`` to the group; after ``timeout_s``, SIGKILL. The exit code (-N: killed by N)."""
        code = _stop_group(self.process, sig, timeout_s)
        self._stdout.join()
        self._stderr.join()
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL, 5.0)

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def agent_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a spawned agent: the hermetic one (testkit/hermetic.py), plus ``env``.

    A ``PYTHONPATH`` in ``env`` is put in front of the inherited one.
    """
    merged = hermetic_environ()
    # A spool root of its own: an agent delivers in the background what ended processes left in its
    # root (threads and CPU a test of the agent does not expect), and the default one holds what other
    # tests left.
    merged["OTEL_FORGE_SPOOL_DIR"] = spool = tempfile.mkdtemp(prefix="otel-forge-agent-spool-")
    atexit.register(shutil.rmtree, spool, ignore_errors=True)  # not left in /tmp by every test run
    for key, value in (env or {}).items():
        if key == "PYTHONPATH" and merged.get("PYTHONPATH"):
            value = os.pathsep.join([value, merged["PYTHONPATH"]])
        merged[key] = value
    return merged


def monitor_command(args: Sequence[str]) -> list[str]:
    """``otel-forge monitor ARGS`` as run from this interpreter."""
    return [sys.executable, "-m", "otel_forge.cli", "monitor", *args]


def spawn_agent(args: Sequence[str], env: Mapping[str, str] | None = None, fd_limit: int | None = None) -> AgentProcess:
    """Start ``otel-forge monitor ARGS`` without waiting for anything (under ``ulimit -n FD_LIMIT``)."""
    command = monitor_command(args)
    if fd_limit is not None:
        command = ["bash", "-c", f'ulimit -n {fd_limit} && exec "$@"', "bash", *command]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=agent_environment(env),
        start_new_session=True,
        cwd=REPO_ROOT,
    )
    return AgentProcess(process, _LineReader(process.stdout), _LineReader(process.stderr))


def start_agent(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 30.0,
    fd_limit: int | None = None,
) -> AgentProcess:
    """Start ``otel-forge monitor ARGS``; return once it prints ``otel-forge: serving prometheus URL``."""
    agent = spawn_agent(args, env, fd_limit)
    try:
        agent.wait_serving(ready_timeout_s)
    except BaseException:
        agent.kill()
        raise
    return agent


def fake_gpu_env(scenario: Mapping[str, Any]) -> dict[str, str]:
    """Env additions that make a spawned agent import the fakes of ``tests/fakes`` with ``scenario``."""
    return gpu_fakes.fake_gpu_env(scenario, base={})
