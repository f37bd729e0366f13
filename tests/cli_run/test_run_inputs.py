"""``otel-forge run`` refuses what cannot be right before CMD starts, in one line with exit 2, and
names what it was asked for and cannot give. Real ``mlflow server``."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from testkit.gpu_fakes import fake_gpu_env
from testkit.hermetic import hermetic_environ

FORGE_RUN = [sys.executable, "-m", "otel_forge.cli", "run"]


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = hermetic_environ({"OTEL_FORGE_SPOOL_DIR": str(cwd / "spool"), **(env or {})}, prefixes=("OTEL_", "MLFLOW_"))
    return subprocess.run(
        [*FORGE_RUN, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_a_run_id_that_does_not_exist_is_an_error_before_cmd_runs(mlflow_server, client, tmp_path) -> None:
    experiment = f"inputs-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "cmd-ran"
    result = _run(
        [
            "--tracking-uri",
            mlflow_server.uri,
            "--experiment",
            experiment,
            "--no-prometheus",
            "--run-id",
            "0123456789abcdef0123456789abcdef",
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        tmp_path,
    )

    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("otel-forge: error: invalid run_id (from --run-id): run 0123456789abcdef")
    assert "--create-if-missing" in lines[-1] and "Traceback" not in result.stderr
    assert not marker.exists()
    assert client.get_experiment_by_name(experiment) is None

    created = _run(
        [
            "--tracking-uri",
            mlflow_server.uri,
            "--experiment",
            experiment,
            "--no-prometheus",
            "--run-id",
            "0123456789abcdef0123456789abcdef",
            "--create-if-missing",
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        tmp_path,
    )
    assert created.returncode == 0, created.stderr
    assert marker.exists()


def test_a_requested_collector_that_is_absent_is_named(mlflow_server, tmp_path) -> None:
    no_driver = fake_gpu_env({"library_missing": True}, base={})  # NVML without its library, at the boundary
    result = _run(
        [
            "--tracking-uri",
            mlflow_server.uri,
            "--no-prometheus",
            "--collectors",
            "cpu,nvidia",
            "--interval",
            "0.2",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(1)",
        ],
        tmp_path,
        env=no_driver,
    )
    assert result.returncode == 0, result.stderr
    assert "otel-forge: collector nvidia absent:" in result.stderr


def test_a_local_store_that_cannot_be_written_is_one_line_at_once(tmp_path) -> None:
    # /proc takes no new file, even from root (a read-only file or directory for anyone else).
    result = _run(
        [
            "--tracking-uri",
            "sqlite:////proc/otel-forge-test/mlflow.db",
            "--no-prometheus",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("otel-forge: error: invalid tracking_uri (from --tracking-uri): cannot write")


def test_an_empty_variable_of_ours_is_one_line_and_cmd_never_runs(tmp_path) -> None:
    marker = tmp_path / "cmd-ran"
    result = _run(
        ["--no-prometheus", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        tmp_path,
        env={"OTEL_FORGE_MLFLOW_STATS": "", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        (
            "otel-forge: error: invalid mlflow_stats (from env OTEL_FORGE_MLFLOW_STATS): must name at least one of "
            "mean, max, min, got ''"
        )
    ]
    assert not marker.exists()
