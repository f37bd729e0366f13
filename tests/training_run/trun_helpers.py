"""Helpers for the TrainingRun tests against a real ``mlflow server``: unique names, and Python
snippets run in a subprocess of their own (the proxy is testkit/proxy.py, the waiting testkit/servers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from testkit.servers import REPO_ROOT


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _script_environ(env: dict[str, str] | None) -> dict[str, str]:
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    return environment


def run_script(
    code: str, env: dict[str, str] | None = None, timeout_s: float = 60.0, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_script_environ(env),
        cwd=cwd or REPO_ROOT,
    )


def popen_script(
    code: str, env: dict[str, str] | None = None, cwd: Path | None = None, stdin: int | None = None
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-u", "-c", code],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_script_environ(env),
        cwd=cwd or REPO_ROOT,
    )
