"""``otel-forge replay --all``: what earlier processes left in the spool root, delivered without naming
a directory, oldest first; a spool whose writer still runs is its writer's, and stays.

Against a real ``mlflow server``: an agent SIGKILLed while its server was away leaves windows, a
training process SIGKILLed likewise leaves its journal; a third agent still runs, spooling."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from testkit.hermetic import hermetic_environ
from testkit.servers import REPO_ROOT, free_port, wait_for

DEAD = "http://127.0.0.1:{port}"

TRAIN = """
import os, signal
from otel_forge import ForgeConfig, TrainingRun
run = TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, system_metrics=False,
                  forge_config=ForgeConfig.resolve(start_wait_s=0))
for step in range(20):
    run.log({{"loss": float(step)}}, step=step)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _environ(root: Path) -> dict[str, str]:
    # A short patience: the training process's companion gives its journal up soon after its death.
    own = {"OTEL_FORGE_SPOOL_DIR": str(root), "OTEL_FORGE_DELIVERY_PATIENCE": "1", "PYTHONPATH": str(REPO_ROOT)}
    return hermetic_environ(own, prefixes=("OTEL_", "MLFLOW_"))


def _agent(run_id: str, uri: str, node: str, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "otel_forge.cli", "monitor", "--run-id", run_id, "--tracking-uri", uri,
               "--interval", "0.3", "--no-prometheus", "--node-id", node]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)


def _windows(root: Path, node: str) -> list[Path]:
    return [f for spool in root.glob(f"*-{node}-*") for f in spool.glob("*.window.json")]


def test_replay_all_delivers_what_dead_processes_left_and_leaves_a_live_ones_spool(mlflow_server, client, tmp_path):
    root, dead = tmp_path / "spool", DEAD.format(port=free_port())
    env = _environ(root)
    experiment = f"replay-all-{uuid.uuid4().hex[:8]}"
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id

    killed = _agent(run_id, dead, "node_left", env)
    wait_for(lambda: len(_windows(root, "node_left")) >= 2, 60, 0.1, "the killed agent's windows spooled")
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    training = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRAIN.format(uri=dead, experiment=experiment))],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert training.returncode == -signal.SIGKILL, training.stderr
    journals = list(root.glob("journal-*"))
    assert len(journals) == 1
    # Its companion gives the journal up (patience 1 s) once the training process is gone.
    wait_for(lambda: not (journals[0] / "delivery.lock").exists() or _unlocked(journals[0]), 60, 0.2, "given up")
    live = _agent(run_id, dead, "node_live", env)
    try:
        wait_for(lambda: _windows(root, "node_live"), 60, 0.1, "the live agent's windows spooled")
        replayed = subprocess.run(
            [sys.executable, "-m", "otel_forge.cli", "replay", "--all", "--tracking-uri", mlflow_server.uri],
            env=env, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
        assert _windows(root, "node_live")  # a running writer's spool is its own: untouched
    finally:
        live.kill()
        live.wait(10)

    assert not _windows(root, "node_left") and not journals[0].exists()  # delivered, removed
    assert client.get_metric_history(run_id, "system/node_left/cpu_utilization_percentage")
    assert not client.get_metric_history(run_id, "system/node_live/cpu_utilization_percentage")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (trained,) = [r for r in runs if r.info.run_id != run_id]
    assert sorted(m.step for m in client.get_metric_history(trained.info.run_id, "loss")) == list(range(20))
    assert trained.info.status == "KILLED"


def test_replay_all_with_nothing_left_says_so(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "replay", "--all"],
        env=_environ(tmp_path / "spool"), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout.strip()) == (
        0,
        f"otel-forge: nothing left to deliver in {tmp_path / 'spool'}",
    )


def test_replay_needs_a_path_or_all_one_of_them(tmp_path):
    for argv in ([], [str(tmp_path), "--all"]):
        result = subprocess.run(
            [sys.executable, "-m", "otel_forge.cli", "replay", *argv],
            env=_environ(tmp_path / "spool"), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [
            "otel-forge: error: invalid arguments: give a spool directory (PATH) or --all, one of them"
        ]


def _unlocked(journal: Path) -> bool:
    """No process delivers ``journal`` now: the delivery's own lock is free (taken and let go)."""
    from otel_forge.mlflow.spool_files import SpoolBusy, claim

    try:
        with claim(journal):
            return True
    except SpoolBusy:
        return False
