"""The tracking server never answers while an ``otel-forge run`` job runs (nothing listens at its
address): the job runs and exits 0, and nothing it logged is lost. The launcher's run description,
CMD's training values and the node's system windows stay in the job's spool directory, said in one
line at the start, and one ``otel-forge replay`` of it makes the one run of the job once a server
answers."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from run_reading import anchor_steps

from otel_forge.mlflow.training.run_journal import is_journal
from testkit.hermetic import hermetic_environ
from testkit.servers import free_port

STEPS = 20
TRAIN = """
import time
from otel_forge import TrainingRun
with TrainingRun(config={{"lr": 0.1}}, experiment={named!r}) as run:
    for step in range({STEPS}):
        run.log({{"loss": 1.0 / (step + 1)}}, step)
        time.sleep(0.1)
"""


def _forge(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.parametrize("named", [None, "named-by-the-script"])
def test_a_job_whose_server_never_answers_keeps_everything_for_replay(named, mlflow_server, client, tmp_path) -> None:
    spool = tmp_path / "spool"
    env = hermetic_environ(
        {"OTEL_FORGE_SPOOL_DIR": str(spool), "OTEL_FORGE_START_WAIT": "1", "OTEL_FORGE_DRAIN_DEADLINE": "2"},
        prefixes=("OTEL_", "MLFLOW_"),
    )
    experiment = f"never-answered-{uuid.uuid4().hex[:8]}"
    down = f"http://127.0.0.1:{free_port()}"
    options = ["--tracking-uri", down, "--experiment", experiment, "--no-prometheus", "--interval", "0.3"]
    job = _forge(
        "run", *options, "--", sys.executable, "-c", TRAIN.format(named=named, STEPS=STEPS), cwd=tmp_path, env=env
    )

    assert job.returncode == 0, job.stderr
    assert "Traceback" not in job.stderr
    # One line says it all: what happened, where everything is kept, the command that delivers it; the
    # job's last line says nothing was delivered, and what waits there.
    (job_dir,) = [path for path in spool.iterdir() if path.is_dir()]
    said = [
        f"otel-forge: MLflow at {down} does not answer: connection refused; {sys.executable} -c runs, "
        f"everything is kept in {job_dir}, otel-forge replay {job_dir} delivers it"
    ]
    if named:  # the script names another experiment than otel-forge run's: which one wins, said once
        said.append(
            f"MLflow: this job's run is the one otel-forge "
            f"run opened, in experiment {experiment}; experiment {named}, named here, is not used (otel-forge run "
            f"--experiment {named} puts the job there)"
        )
    *lines, last = job.stderr.splitlines()
    assert lines == said, job.stderr
    kept_line = re.escape(f"otel-forge: nothing reached MLflow at {down}: {STEPS} value(s) and ") + r"([1-9]\d*)"
    kept_line += re.escape(
        f" system-metrics window(s) are kept in {job_dir}; otel-forge replay {job_dir} delivers them"
    )
    assert re.fullmatch(kept_line, last), last
    kept = sorted(path for path in job_dir.iterdir() if path.is_dir())
    journals = [path for path in kept if is_journal(path)]
    windows = [path for path in kept if not is_journal(path)]
    assert len(journals) == 2 and len(windows) == 1, kept  # ours and CMD's TrainingRun's; the node's windows

    # One replay of the job's directory: the job's run first (under the job key), then the windows.
    replayed = _forge("replay", str(job_dir), "--tracking-uri", mlflow_server.uri, cwd=tmp_path, env=env)
    assert replayed.returncode == 0, replayed.stderr
    assert not job_dir.exists()  # all delivered

    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.data.tags for r in runs]
    run_id = runs[0].info.run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(STEPS))
    assert runs[0].data.params["lr"] == "0.1"
    steps = anchor_steps(client, run_id)
    assert len(steps) >= 3 and steps == list(range(len(steps))), steps
    assert client.get_run(run_id).info.status == "FINISHED"
    assert named is None or client.get_experiment_by_name(named) is None  # no empty experiment either
