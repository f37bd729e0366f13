"""Git repositories for the tests that check what a run records of its source (commit, dirty state)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git(repo: Path, *args: str) -> str:
    """``git ARGS`` in ``repo`` with a test identity and no signing; its stdout, stripped."""
    return subprocess.run(
        [
            "git",
            "-c",
            "user.name=otel-forge tests",
            "-c",
            "user.email=tests@example.invalid",
            "-c",
            "commit.gpgsign=false",
            *args,
        ],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def commit_all(repo: Path, message: str) -> str:
    """``repo`` made a repository (if it is not one) with everything in it committed; the commit."""
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")
