"""Fixtures of the multi-node tests: a hermetic environment, a git repository with a launch file
for the tasks to run in, and what every task of a simulated job is given (tests/multinode/jobsim.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hermetic import apply_hermetic  # noqa: E402

LAUNCH_TOML = "[optim]\nlr = 0.1\n"


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch: pytest.MonkeyPatch) -> None:
    apply_hermetic(monkeypatch)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=otel-forge tests", "-c", "user.email=tests@example.invalid",
                           "-c", "commit.gpgsign=false", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="session")
def job_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed repository holding the launch file the tasks name."""
    repo = tmp_path_factory.mktemp("job-repo")
    (repo / "cfg.toml").write_text(LAUNCH_TOML)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "the job")
    return repo


def unique(name: str) -> str:
    return f"job-{name}-{uuid.uuid4().hex[:8]}"


def task_environ(tracking_uri: str, experiment: str, tmp: Path) -> dict[str, str]:
    """What every task of a job gets besides its launcher's variables: the server, a fast interval."""
    return {"MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_EXPERIMENT_NAME": experiment,
            "OTEL_FORGE_SAMPLING_INTERVAL": "0.3", "OTEL_FORGE_PROMETHEUS": "false",
            "OTEL_FORGE_COLLECTORS": "cpu,memory,process", "OTEL_FORGE_SPOOL_DIR": str(tmp / "spool"),
            "TMPDIR": str(tmp), "GIT_CONFIG_NOSYSTEM": "1"}


def require(binary: str) -> None:
    assert shutil.which(binary), f"{binary} is needed to simulate this launcher"
