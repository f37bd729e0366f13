"""More rows of the fault matrix (docs/reliability.md), each against a real ``mlflow server`` and a real
training process in a process group of its own (testkit/training_job.py): a read-only spool, a journal
damaged in the middle or cut, SIGKILL of the training process or its companion at random moments,
a server down at the job's start. What each asserts is what a user sees: no exception in the script,
every value whose ``log()`` reported no drop in MLflow once, the run's status, a line that is true."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from trun_helpers import unique

from testkit.servers import wait_for
from testkit.training_job import TrainingJob

pytestmark = pytest.mark.slow

WIDTH = 100  # values a log() call

# Logs STEPS steps of WIDTH values, RATE steps a second, printing "step N REJECTED" once each log()
# returned; at step HOOK_AT prints "hook" and waits for the file GO. LEAVE runs last in the block.
LOOP = """
import os, sys, time
from otel_forge import TrainingRun
values = lambda step: {{f"v{{i}}": step + i / 1000 for i in range({width})}}
with TrainingRun(config={{"lr": 0.25}}, tracking_uri={uri!r}, experiment={experiment!r},
                 system_metrics=False) as run:
    for step in range({steps}):
        if step == {hook_at}:
            print("hook", flush=True)
            while not os.path.exists({go!r}):
                time.sleep(0.02)
        run.log(values(step), step=step)
        print("step", step, run.rejected, flush=True)
        if {rate}:
            time.sleep(1 / {rate})
    print("logged", run.rejected, flush=True)
    {leave}
print("exited", run.rejected, flush=True)
"""


def _loop(
    directory: Path, uri: str, experiment: str, spool: Path, *, steps: int, rate: float = 0, hook_at: int = -1,
    leave: str = "pass", env: dict[str, str] | None = None,
) -> TrainingJob:  # fmt: skip
    code = LOOP.format(
        uri=uri, experiment=experiment, width=WIDTH, steps=steps, rate=rate, hook_at=hook_at,
        go=str(directory / "go"), leave=leave,
    )  # fmt: skip
    return TrainingJob(textwrap.dedent(code), directory, {"OTEL_FORGE_SPOOL_DIR": str(spool), **(env or {})})


def _go(job: TrainingJob) -> None:
    (job.directory / "go").touch()


def _steps_logged(lines: list[str]) -> dict[int, int]:
    """step -> values dropped so far, from the loop's lines."""
    return {int(parts[1]): int(parts[2]) for parts in (line.split() for line in lines) if parts[0] == "step"}


def _kept_steps(logged: dict[int, int]) -> list[int]:
    """The steps whose log() dropped nothing (the count did not move)."""
    return [step for step, so_far in sorted(logged.items()) if so_far == logged.get(step - 1, 0)]


def _the_run(client, experiment: str, timeout_s: float = 90.0):
    def found():
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs[0] if len(runs) == 1 and runs[0].info.status != "RUNNING" else None

    return wait_for(found, timeout_s, 0.5, message=f"one ended run in {experiment}")


def _steps_in(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _assert_once(client, run_id: str, steps: list[int], keys: tuple[str, ...] = ("v0", f"v{WIDTH - 1}")) -> None:
    for key in keys:
        found = _steps_in(client, run_id, key)
        repeated = sorted({step for step in found if found.count(step) > 1})
        missing, extra = sorted(set(steps) - set(found)), sorted(set(found) - set(steps))
        assert found == steps, f"{key}: missing steps {missing[:20]}, repeated {repeated[:20]}, extra {extra[:20]}"


# --- a read-only spool ------------------------------------------------------------------------


@pytest.fixture
def read_only_spool(tmp_path):
    from testkit.small_disk import can_mount, read_only_disk

    if not can_mount():
        pytest.skip("mounting a read-only tmpfs needs root (a mode of 0500 does not stop root)")
    with read_only_disk(tmp_path / "readonly") as disk:
        yield disk / "spool"


@pytest.mark.parametrize(("leave", "status", "code"), [("pass", "FINISHED", 0), ("sys.exit(3)", "FAILED", 3)])
def test_a_read_only_spool_raises_nothing_and_the_run_holds_the_count_of_what_was_lost(
    leave, status, code, read_only_spool, tmp_path, mlflow_server, client
):
    """The spool is on a read-only file system from the start (EROFS, root included): the journal
    cannot be made, so nothing can be logged. Nothing reaches the script; every value is counted lost,
    with the reason, in the last line and in the run's ``otel_forge.log.rejected`` tag; the run ends
    as the job did. Before: the run ended without the tag the last line named (``end_here``)."""
    experiment = unique("readonly")
    job = _loop(tmp_path / "job", mlflow_server.uri, experiment, read_only_spool, steps=30, leave=leave)
    with job:
        assert job.wait() == code
    stderr = job.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    lost = 30 * WIDTH
    assert job.wait_line("logged") == f"logged {lost}"
    assert f"the run's journal cannot be written in {read_only_spool} (Read-only file system)" in stderr
    assert (
        f"{lost} metric value(s) were dropped in all: {lost} lost (the run's journal could not be written: "
        f"{read_only_spool}: Read-only file system); tag otel_forge.log.rejected of the run holds the count"
    ) in stderr, stderr[-3000:]
    run = _the_run(client, experiment)
    assert run.info.status == status
    assert run.data.tags.get("otel_forge.log.rejected") == str(lost), "the last line names a tag the run lacks"
    assert not run.data.metrics


@pytest.fixture
def failing_spool(tmp_path):
    from testkit.small_disk import can_fail_a_disk, failing_disk

    if not can_fail_a_disk():
        pytest.skip("an ext4 file system on a loop device needs root, /dev/loop-control and ext4")
    with failing_disk(tmp_path / "disk", tmp_path / "disk.img") as disk:
        yield disk


def test_a_spool_disk_that_turns_read_only_mid_job_raises_nothing_and_every_kept_value_arrives(
    failing_spool, tmp_path, mlflow_server, client
):
    """The spool's disk fails mid-job and the kernel remounts it read-only (ext4,
    ``errors=remount-ro``) under the open journal: every append after is EROFS. Nothing reaches the
    script; every value journaled before is in the run once; the rest are counted lost with the
    reason, in the last line and in the run's tag; the run ends FINISHED (its end, which the journal
    cannot keep, handed to the companion)."""
    experiment = unique("erofs")
    job = _loop(tmp_path / "job", mlflow_server.uri, experiment, failing_spool.where / "spool", steps=90,
                rate=50, hook_at=40)  # fmt: skip
    with job:
        job.wait_line("hook")
        failing_spool.fail()
        assert failing_spool.read_only()
        _go(job)
        assert job.wait() == 0
    stderr = job.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    logged = _steps_logged(job.lines())
    kept = _kept_steps(logged)
    lost = int(job.wait_line("exited").split()[1])
    assert kept == list(range(40)) and lost == WIDTH * (90 - 40), f"{lost} lost; kept {kept[-3:]}"
    assert (
        f"{lost} metric value(s) were dropped in all: {lost} lost (the run's journal could not be written: "
        "Read-only file system)"
    ) in stderr, stderr[-3000:]
    run = _the_run(client, experiment)
    assert run.info.status == "FINISHED"
    assert run.data.tags.get("otel_forge.log.rejected") == str(lost)
    _assert_once(client, run.info.run_id, kept)
