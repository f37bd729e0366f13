"""A forked child of a process with an open ``TrainingRun`` (every ``DataLoader(num_workers>0)``
forks) owns none of the run: it samples, spools, logs and ends nothing of it, and does not run its
exit or SIGTERM handlers. The parent's run: its values, one system step per window, FINISHED, no
spool left behind. Real 'fork' Pool / Process / os.fork / torch DataLoader against the real server."""

from __future__ import annotations

import collections
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from run_reading import anchor_steps

from testkit.hermetic import hermetic_environ

SCRIPT = Path(__file__).resolve().parent / "scripts" / "forking_job.py"
STEPS = 10


@pytest.mark.parametrize("mode", ["pool", "process", "os-fork", "dataloader", "early"])
def test_a_forked_child_leaves_the_parents_run_alone(mode, mlflow_server, client, tmp_path) -> None:
    experiment = f"fork-{mode}-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    env = hermetic_environ(
        {
            "MLFLOW_TRACKING_URI": mlflow_server.uri,
            "MLFLOW_EXPERIMENT_NAME": experiment,
            "OTEL_FORGE_SAMPLING_INTERVAL": "0.2",
            "OTEL_FORGE_PROMETHEUS": "false",
            "OTEL_FORGE_SPOOL_DIR": str(spool),
            # early: entering does not wait for the run; the children fork while it may be opening.
            "OTEL_FORGE_START_WAIT": "0" if mode == "early" else "15",
        },
        prefixes=("OTEL_", "MLFLOW_"),
    )
    # A child that blocked the parent (an inherited handler waiting on the run) would hang it: the timeout.
    job = subprocess.run(
        [sys.executable, str(SCRIPT), mode], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )

    assert job.returncode == 0, job.stderr
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED", (run.data.tags, job.stderr)
    assert not [tag for tag in run.data.tags if tag.startswith("otel_forge.outcome.")], run.data.tags
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(STEPS))
    windows = anchor_steps(client, run.info.run_id)
    assert windows == list(range(len(windows))), windows
    per_step = collections.Counter(
        m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
    )
    assert [step for step, n in per_step.items() if n > 1] == [], per_step  # one sampler: the parent's
    assert not spool.exists() or not list(spool.iterdir()), list(spool.iterdir())
