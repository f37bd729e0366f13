"""Fixtures of the multi-node tests: a hermetic environment and a git repository with a launch
file for the tasks to run in (helpers.py and jobsim.py hold the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import LAUNCH_TOML

from testkit.git_repo import commit_all
from testkit.hermetic import apply_hermetic


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch: pytest.MonkeyPatch) -> None:
    apply_hermetic(monkeypatch)


@pytest.fixture(scope="session")
def job_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed repository holding the launch file the tasks name."""
    repo = tmp_path_factory.mktemp("job-repo")
    (repo / "cfg.toml").write_text(LAUNCH_TOML)
    commit_all(repo, "the job")
    return repo
