"""A real ``mlflow server`` for tests: sqlite backend, 127.0.0.1, a free port, one worker (by default).

``MlflowServer`` can be stopped (SIGSTOP), resumed, killed and restarted on the same port and
database, so tests can inject the faults a tracking server really has. As a context manager it is
started on entry (if it is not running) and stopped on exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from testkit.servers import free_port


class MlflowServer:
    """``backend_uri``: another backend store (the fleet bench's PostgreSQL); default sqlite in ``root``."""

    def __init__(self, root: Path, port: int | None = None, backend_uri: str | None = None, workers: int = 1) -> None:
        self.root = root
        self.port = port or free_port()
        self.db = root / "mlflow.db"
        self.backend_uri = backend_uri or f"sqlite:///{self.db}"
        self.workers = workers
        self.artifacts = root / "artifacts"
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line (a subclass adds its options)."""
        return [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend_uri,
            "--default-artifact-root",
            str(self.artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
        ]

    def environ(self) -> dict[str, str]:
        """The server's environment: without the job runner, which keeps the cores busy after start."""
        return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

    def start(self, timeout_s: float = 90.0) -> MlflowServer:
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - the server's output until it stops
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environ(), start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            if self.healthy():
                return self
            time.sleep(0.25)
        self.kill()
        raise RuntimeError("mlflow server did not answer /health in time")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def _signal_group(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections but never answers (hung)."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole server tree (an outage); the database stays."""
        if self.process is None:
            return
        self._signal_group(signal.SIGCONT)
        self._signal_group(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None

    def stop(self) -> None:
        if self.process is None:
            return
        self._signal_group(signal.SIGCONT)
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.process.wait(timeout=15)
        self.process = None

    def __enter__(self) -> MlflowServer:
        return self if self.process is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
