"""SIGKILL of ``otel-forge run`` while the tracking server hangs: the windows not yet delivered are
on disk (every window is written to the spool before it is sent), and ``otel-forge replay``
delivers them after, continuing the node's steps."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from otel_forge.mlflow.training.run_journal import is_journal
from testkit.hermetic import hermetic_environ
from testkit.servers import wait_for


def test_windows_of_a_killed_run_survive_in_the_spool(pausable_server, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    server, err, spool = pausable_server, tmp_path / "stderr.txt", tmp_path / "spool"
    env = hermetic_environ({"OTEL_FORGE_SPOOL_DIR": str(spool)}, prefixes=("OTEL_", "MLFLOW_"))
    with open(err, "w") as stderr:  # otel-forge run's own lines (the run, what it serves) are on its stderr
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "otel_forge.cli",
                "run",
                "--tracking-uri",
                server.uri,
                "--no-prometheus",
                "--experiment",  # named: the run opens at once, not once the script could have named one (30 s)
                f"outage-{uuid.uuid4().hex[:8]}",
                "--interval",
                "0.2",
                "--collectors",
                "cpu,memory",
                "--",
                sys.executable,
                "-c",
                "import time; time.sleep(120)",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "serving mlflow run" in err.read_text(), 60, 0.05, "the run to be sampled")
        run_id = re.search(r"otel-forge: run ([0-9a-f]{32})", err.read_text()).group(1)  # type: ignore[union-attr]
        client = MlflowClient(server.uri)
        wait_for(lambda: client.get_run(run_id).data.metrics, 30, 0.1, "the first window")
        key = min(client.get_run(run_id).data.metrics)  # the anchor: in every window (the others when changed)
        wait_for(lambda: len(client.get_metric_history(run_id, key)) >= 2, 30, 0.1, "the first windows")
        server.pause()
        time.sleep(2.0)  # ~10 windows wait for a server that does not answer
        os.killpg(process.pid, signal.SIGKILL)  # otel-forge and CMD: nothing gets to close
        process.wait(timeout=10)
    finally:
        server.resume()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    # In the job's directory (otel-forge run keeps a job's spools together), the node's windows
    # (beside the run's journal, which a replay of the whole directory delivers too).
    [kept] = [header.parent for header in spool.glob("run-*/*/spool.json") if not is_journal(header.parent)]
    waiting = len(list(kept.glob("*.window.json")))
    assert waiting >= 5, sorted(p.name for p in kept.iterdir())

    result = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "replay", str(kept)],
        capture_output=True,
        text=True,
        timeout=120,
        env=hermetic_environ(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    steps = sorted(m.step for m in client.get_metric_history(run_id, key))
    assert steps == list(range(len(steps))) and len(steps) >= 2 + waiting - 1, (steps, waiting)
