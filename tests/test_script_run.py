"""``ScriptRun``: the files by which the processes of a single-node job agree on its run where the
script names the experiment (one claim wins, the run is published once, a claim left by a dead
process is known as such), and ``LaunchedRun``'s marker for it."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

from otel_forge.config import LAUNCHED_RUN_ENV, SCRIPT_OPENS, env_name
from otel_forge.mlflow.training.launched_run import LaunchedRun
from otel_forge.mlflow.training.run_source import RunOrigin, RunSource
from otel_forge.mlflow.training.script_run import PublishedRun, ScriptRun


def _claim(directory: str, barrier: multiprocessing.synchronize.Barrier, won: multiprocessing.Queue) -> None:
    barrier.wait()
    won.put(ScriptRun(Path(directory), "job/7 key").claim("exp", f"pid {os.getpid()}"))


def test_of_8_processes_claiming_at_once_exactly_one_wins(tmp_path) -> None:
    context = multiprocessing.get_context("fork")
    barrier, won = context.Barrier(8), context.Queue()
    processes = [context.Process(target=_claim, args=(str(tmp_path), barrier, won)) for _ in range(8)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
    assert sorted(won.get(timeout=5) for _ in processes) == [False] * 7 + [True]
    claim = ScriptRun(tmp_path, "job/7 key").claimed()
    assert claim is not None and claim["experiment"] == "exp"


def test_a_published_run_reads_back_and_files_are_per_key_and_private(tmp_path) -> None:
    first, other = ScriptRun(tmp_path, "slurm-1.0"), ScriptRun(tmp_path, "slurm-1.1")
    assert first.published() is None and first.wait_published(0.1) is None
    first.publish(PublishedRun("abc", "7", "proj"))
    assert first.published() == PublishedRun("abc", "7", "proj") and other.published() is None
    assert all(path.stat().st_mode & 0o077 == 0 for path in tmp_path.iterdir())
    first.remove()
    assert first.published() is None and list(tmp_path.iterdir()) == []


def test_a_claim_whose_process_ended_unpublished_is_abandoned_with_its_experiment(tmp_path) -> None:
    record = ScriptRun(tmp_path, "k")
    code = (
        "from pathlib import Path; from otel_forge.mlflow.training.script_run import ScriptRun; "
        f"ScriptRun(Path({str(tmp_path)!r}), 'k').claim('x', 'TrainingRun')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert record.abandoned() and json.loads(next(tmp_path.glob("*.claim")).read_text())["experiment"] == "x"
    record.publish(PublishedRun("r", None, None))
    assert not record.abandoned()  # published before it ended: the run stands


def test_a_live_claim_is_not_abandoned_and_a_released_one_can_be_claimed_again(tmp_path) -> None:
    record = ScriptRun(tmp_path, "k")
    assert record.claim(None, "the script's first MLflow run") and not record.abandoned()
    assert not record.claim("y", "TrainingRun")
    record.release()
    assert record.claimed() is None and record.claim("y", "TrainingRun")


def test_mlflow_imported_by_a_process_of_the_command_is_seen(tmp_path) -> None:
    record = ScriptRun(tmp_path, "k")
    assert not record.mlflow_imported() and not record.asked()
    record.mark_mlflow_imported()
    record.ask()
    assert record.mlflow_imported() and record.asked()
    assert not ScriptRun(tmp_path, "other").mlflow_imported()


def test_the_launched_marker_hands_the_command_the_job_key_and_directory_and_no_run() -> None:
    handed = LaunchedRun(RunSource(RunOrigin.SCRIPT), job_key="k", directory="/tmp/job")
    environ = handed.environ()
    assert environ[LAUNCHED_RUN_ENV] == SCRIPT_OPENS and env_name("run_id") not in environ
    assert environ[env_name("spool_dir")] == "/tmp/job"
    back = LaunchedRun.from_environ(environ)
    assert back is not None and back.script_opens and not back.pending and back.run_id is None
    assert back.job_key == "k" and back.directory == "/tmp/job"
