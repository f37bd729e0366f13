"""The README runs as written: the quick start's first command in the checkout on a fresh local
store, and every Python block in a fresh folder. (The quick start's second command, ``./run-tests``,
is the one that runs this test: CI runs it on every change.)"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from testkit.hermetic import hermetic_environ

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
SUITE_COMMAND = "./run-tests"


def _blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def _quick_start_commands() -> list[str]:
    section = README[README.index("## Quick start") :].split("\n## ", 1)[0]
    (block,) = _blocks("bash", section)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _environ() -> dict[str, str]:
    # `python`, `pip` and `otel-forge` are this interpreter's, as in the venv the README assumes.
    env = hermetic_environ(prefixes=("OTEL_", "MLFLOW_"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@contextlib.contextmanager
def _fresh_store(store: Path) -> Iterator[None]:
    """The checkout's ./mlflow.db made fresh for the command; one already there is put back after."""
    kept = store.with_name(store.name + ".before-readme-test")
    if store.exists():
        store.rename(kept)
    try:
        yield
    finally:
        store.unlink(missing_ok=True)
        if kept.exists():
            kept.rename(store)


def _runs(store: Path, experiment: str) -> list:  # type: ignore[type-arg]
    client = MlflowClient(f"sqlite:///{store}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment} in {store}"
    return client.search_runs([found.experiment_id])


def test_the_quick_start_commands_are_the_install_run_and_the_suite() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2 and commands[1] == SUITE_COMMAND, commands


def test_the_quick_start_installs_and_runs_a_job_into_a_fresh_local_store() -> None:
    command = _quick_start_commands()[0]
    store = ROOT / "mlflow.db"
    with _fresh_store(store):
        result = subprocess.run(
            command, shell=True, cwd=ROOT, env=_environ(), capture_output=True, text=True, timeout=600, check=False
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        (run,) = _runs(store, "otel-forge")
        client = MlflowClient(f"sqlite:///{store}")
        assert run.info.status == "FINISHED"
        keys = set(run.data.metrics)
        assert "train/loss" in keys and any(key.startswith("system/") for key in keys), keys
        assert client.search_logged_models(experiment_ids=[run.info.experiment_id]), "no checkpoint logged"
        # A run of a few seconds at the default 10 s interval: every system chart is still a line (a
        # rank's progress keys begin with its first step: in a job this short, in its last window).
        system = [key for key in keys if key.startswith("system/") and not key.startswith("system/training_rank_")]
        points = {key: len(client.get_metric_history(run.info.run_id, key)) for key in system}
        seconds = (run.info.end_time - run.info.start_time) / 1000
        assert len(points) >= 20 and min(points.values()) >= 2, (seconds, points)


PYTHON_BLOCKS = _blocks("python")


def test_the_readme_has_python_blocks() -> None:
    assert len(PYTHON_BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_a_python_block_runs_as_written(index: int, tmp_path: Path) -> None:
    env = {**_environ(), "OTEL_EXPORTER_PROMETHEUS_PORT": "0"}  # beside other agents on this machine
    result = subprocess.run(
        [sys.executable, "-c", PYTHON_BLOCKS[index]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "WARNING" not in result.stderr, result.stderr[-3000:]
    if "TrainingRun" in PYTHON_BLOCKS[index]:
        (run,) = _runs(tmp_path / "mlflow.db", "quickstart")
        assert run.info.run_id in result.stdout  # tracking_entry() inside the block names the run
        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 100
        assert run.data.params["lr"] == "0.0003"
        assert [m.name for m in client.search_logged_models(experiment_ids=[run.info.experiment_id])]
    if "otel_forge.monitor" in PYTHON_BLOCKS[index]:
        stores = [path for path in (tmp_path / "mlflow.db", tmp_path / "mlruns") if path.exists()]
        assert stores, "MLflow's default store was not written"
    if "instrument(" in PYTHON_BLOCKS[index]:
        assert "system.cpu.logical.count" in result.stdout and "system.memory.usage" in result.stdout
