"""Framework jobs as a user runs them, for the tests in this folder: a command under ``otel-forge run``
(or alone, otel_forge in its code), with its own experiment and spool, against a real server."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit.hermetic import hermetic_environ

SCRIPTS = Path(__file__).resolve().parent / "scripts"
FORGE_RUN = [sys.executable, "-m", "otel_forge.cli", "run"]
RUN_LINE = re.compile(r"^otel-forge: run ([0-9a-f]{32}) in experiment", re.MULTILINE)
TIMEOUT_S = 180.0
HF_STEPS = 6  # hf_trainer.py's max_steps


@dataclass
class Job:
    result: subprocess.CompletedProcess[str]
    experiment: str

    @property
    def run_id(self) -> str:
        found = RUN_LINE.search(self.result.stderr)  # otel-forge run's own lines: on its stderr
        assert found, f"no 'otel-forge: run' line in stderr:\n{self.result.stdout}\n{self.result.stderr}"
        return found.group(1)


def job_environ(tmp: Path, uri: str, experiment: str, **extra: str) -> dict[str, str]:
    own = {
        "OTEL_FORGE_SPOOL_DIR": str(tmp / "spool"),
        "OTEL_FORGE_SAMPLING_INTERVAL": "0.3",
        "OTEL_FORGE_PROMETHEUS": "false",
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_EXPERIMENT_NAME": experiment,
        "TMPDIR": str(tmp),
        "HF_HUB_OFFLINE": "1",
    }
    return hermetic_environ(own, prefixes=("OTEL_", "MLFLOW_"), **extra)


def run_job(tmp: Path, uri: str, command: list[str], forge: bool, **extra: str) -> Job:
    """``command`` under ``otel-forge run`` (``forge``) or alone (otel_forge in its code, if at all)."""
    experiment = f"frameworks-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [*FORGE_RUN, "--", *command] if forge else command,
        cwd=tmp,
        env=job_environ(tmp, uri, experiment, **extra),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    return Job(result, experiment)


def runs_of(client: Any, job: Job) -> list[Any]:
    experiment = client.get_experiment_by_name(job.experiment)
    assert experiment is not None, job.result.stderr
    return client.search_runs([experiment.experiment_id])


def the_one_run(client: Any, job: Job) -> Any:
    """The job's one top-level run, asserted to hold training metrics and the node's system metrics."""
    runs = runs_of(client, job)
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(top) == 1, [(r.info.run_name, r.data.tags.get("mlflow.parentRunId")) for r in runs]
    [run] = top
    keys = set(run.data.metrics)
    assert any(k.startswith("system/") for k in keys), sorted(keys)
    return run


def steps(client: Any, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def python(script: Path, *args: str) -> list[str]:
    return [sys.executable, str(script), *args]
