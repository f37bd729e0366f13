"""The lean install (``pip install otel-forge``: mlflow-skinny, not mlflow) on a node: a child Python
in which every package outside the core dependencies' closure is unimportable (tests/lean_python.py)
runs a TrainingRun, and the node agent it starts, against the session's real ``mlflow server``; a
local store without the [local] extra is refused in one line that names the install."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import pytest
from lean_python import lean_environ, started_pythons, uninstalled_modules

from testkit.hermetic import hermetic_environ

# What the full mlflow adds over mlflow-skinny (its requirements, diffed), and numpy and pandas.
FULL_STACK = ("sklearn", "scipy", "pandas", "numpy", "pyarrow", "matplotlib", "flask", "sqlalchemy", "alembic")

LEAN_RUN = """
import json, sys, time
from pathlib import Path
for name in {full_stack!r}:
    try:
        __import__(name)
    except ModuleNotFoundError:
        continue
    raise SystemExit(f"{{name}} is importable in the lean Python")

from otel_forge import ForgeConfig, TrainingRun

config = ForgeConfig.resolve(environ={{}}, sampling_interval_s=0.2, prometheus=False)
checkpoint = Path("checkpoint-step-3")
checkpoint.mkdir()
(checkpoint / "weights.bin").write_bytes(b"0" * 64)
with TrainingRun({{"lr": 0.1}}, tracking_uri={uri!r}, experiment={experiment!r}, forge_config=config,
                 register_checkpoints=True, handle_sigterm=False, launch_argv=["train.py"]) as run:
    assert run.start(timeout_s=60), run.open_error
    for step in range(5):
        run.log({{"loss": 1.0 / (step + 1)}}, step=step)
    run.register_checkpoint(3, checkpoint)
    time.sleep(2.5)  # a few of the node agent's windows
print(json.dumps({{"run_id": run.run_id, "loaded": sorted(set({full_stack!r}) & set(sys.modules))}}))
"""


@pytest.fixture(scope="module")
def lean_run(mlflow_server, tmp_path_factory):
    """One TrainingRun in a lean Python: its run id, what it printed, and the Pythons it started."""
    workdir = tmp_path_factory.mktemp("lean-run")
    environ, log = lean_environ(workdir / "site", hermetic_environ())
    script = LEAN_RUN.format(full_stack=FULL_STACK, uri=mlflow_server.uri, experiment=f"lean-{uuid.uuid4().hex[:8]}")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=environ,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["run_id"], result, started_pythons(log), done.stderr


def test_the_full_mlflow_stack_is_what_the_lean_python_lacks() -> None:
    # The finder blocks what the full mlflow brings over mlflow-skinny; mlflow itself stays.
    assert set(FULL_STACK) <= uninstalled_modules()
    assert not {"mlflow", "otel_forge", "opentelemetry", "psutil", "pynvml"} & uninstalled_modules()


def test_a_training_run_and_its_node_agent_deliver_with_mlflow_skinny_alone(lean_run, client) -> None:
    run_id, result, pythons, _ = lean_run
    assert result["loaded"] == []
    # The node's sampler process is a Python the finder was installed in too.
    assert any("otel_forge.cli.companion" in argv for argv in pythons), pythons
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1"}
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [1.0, 0.5, 1 / 3, 0.25, 0.2]
    keys = set(run.data.metrics)
    for key in ("cpu_utilization_percentage", "system_memory_usage_megabytes", "disk_usage_percentage"):
        assert f"system/{key}" in keys, sorted(keys)
    assert client.get_metric_history(run_id, "system/network_receive_megabytes")


def test_a_checkpoint_is_registered_with_mlflow_skinny_alone(lean_run, client) -> None:
    run_id, _, _, stderr = lean_run
    experiment_id = client.get_run(run_id).info.experiment_id
    models = client.search_logged_models(experiment_ids=[experiment_id])
    assert [m.source_run_id for m in models] == [run_id], stderr[-3000:]


def test_a_local_store_without_the_local_extra_is_refused_in_one_line(tmp_path) -> None:
    environ, _ = lean_environ(tmp_path / "site", hermetic_environ())
    workdir = tmp_path / "job"
    workdir.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "run", "--no-prometheus", "--", sys.executable, "-c", "pass"],
        env=environ,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert "sqlite://" in lines[0] and "pip install 'otel-forge[local]'" in lines[0], lines[0]
    assert not (workdir / "mlflow.db").exists()  # nothing made that cannot be used


def test_where_the_sql_store_is_installed_a_local_store_is_written(tmp_path) -> None:
    from otel_forge.config import local_store_problem

    assert local_store_problem(f"sqlite:///{tmp_path}/mlflow.db") is None  # the dev install has the [local] extra
    assert (tmp_path / "mlflow.db").exists()
    assert local_store_problem("http://127.0.0.1:5000") is None
