"""The run's status is the job's, a requeued job continues its run, one writer per node prefix.

Simulated SLURM jobs (2 nodes x 2 tasks, each node its own process group) against the session's
real ``mlflow server``; no run id is handed to any process unless the test says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from helpers import contiguous, loss_steps, node_history, node_steps, run_job, task_environ, the_run, unique
from jobsim import FORGE, TASK, Job, Task, slurm_environ

from testkit.hermetic import hermetic_environ
from testkit.servers import wait_for


def wrapped(*task_args: str):  # type: ignore[no-untyped-def]
    """``srun otel-forge run -- python task.py ...``: one wrapper per task."""
    return lambda task: [*FORGE, "run", "--", *TASK, "--rank", str(task.rank), "--node", str(task.node), *task_args]


def trainingrun(*task_args: str):  # type: ignore[no-untyped-def]
    return lambda task: [*TASK, "--api", "trainingrun", "--rank", str(task.rank), "--node", str(task.node), *task_args]


def test_a_node_that_fails_after_rank_0_finished_fails_the_run(mlflow_server, client, job_repo, tmp_path) -> None:
    # Node 1 trains 8 s, node 0 only 1 s (importing nothing, so it ends first even on a loaded
    # machine): rank 0 ends the run FINISHED first, node 1 then exits 3.
    result = run_job(
        "slurm",
        wrapped("--api", "none", "--seconds", "1", "--node-seconds", "1:8", "--fail-node", "1", "--exit-code", "3"),
        tmp_path,
        mlflow_server.uri,
        job_repo,
    )

    assert result.codes() == [0, 0, 3, 3], result.describe()
    run = the_run(client, result.experiment)
    assert run.info.status == "FAILED"
    assert run.data.tags["otel_forge.outcome.node_1"].startswith("FAILED")
    assert "otel_forge.outcome.node_0" not in run.data.tags
    # Node 1's windows after rank 0 ended still landed, in order.
    node_0, node_1 = (node_history(client, run.info.run_id, node) for node in ("node_0", "node_1"))
    assert contiguous([m.step for m in node_1]) and contiguous([m.step for m in node_0])
    assert node_1[-1].timestamp > node_0[-1].timestamp + 1500, (node_0[-1], node_1[-1])


def test_a_rank_that_raises_fails_the_run_though_rank_0_ends_well(mlflow_server, client, job_repo, tmp_path) -> None:
    result = run_job(
        "slurm",
        trainingrun("--seconds", "6", "--node-seconds", "1:3", "--raise-on-node", "1"),
        tmp_path,
        mlflow_server.uri,
        job_repo,
    )

    assert result.codes()[:2] == [0, 0] and all(code != 0 for code in result.codes()[2:]), result.describe()
    run = the_run(client, result.experiment)
    assert run.info.status == "FAILED"  # rank 0 closed FINISHED after node 1 had failed
    assert run.data.tags["otel_forge.job.outcome"] == "FAILED"
    assert run.data.tags["otel_forge.outcome.node_1"].startswith("FAILED")


def test_a_requeued_job_continues_its_run(mlflow_server, client, job_repo, tmp_path) -> None:
    experiment = unique("requeue")
    first = run_job(
        "slurm",
        trainingrun("--seconds", "5", "--raise-on-node", "1"),
        tmp_path,
        mlflow_server.uri,
        job_repo,
        experiment=experiment,
        name="attempt1",
    )
    run = the_run(client, experiment)
    assert run.info.status == "FAILED"
    before = {node: node_steps(client, run.info.run_id, node) for node in ("node_0", "node_1")}

    # SLURM requeues the job: same job id and step, every task started again.
    second = run_job(
        "slurm",
        trainingrun("--seconds", "5", "--first-step", "10"),
        tmp_path,
        mlflow_server.uri,
        job_repo,
        experiment=experiment,
        name="attempt2",
        job_id=first.job.job_id,
    )

    assert second.codes() == [0, 0, 0, 0], second.describe()
    run = the_run(client, experiment)  # still one run
    assert run.info.status == "FINISHED"  # this attempt's outcome, not the last one's
    assert not [tag for tag in run.data.tags if "outcome" in tag], run.data.tags
    for node, steps in before.items():
        after = node_steps(client, run.info.run_id, node)
        assert contiguous(after) and len(after) > len(steps) >= 2, (node, steps, after)
    assert loss_steps(client, run) == list(range(20))


def test_cmd_leftovers_cannot_rewrite_the_final_status(mlflow_server, client, tmp_path) -> None:
    # CMD exits 3 and leaves a child that resumed the run with mlflow.start_run(): at its exit,
    # MLflow's atexit would end the run FINISHED.
    experiment = unique("orphan")
    env = hermetic_environ(task_environ(mlflow_server.uri, experiment, tmp_path))
    result = subprocess.run(
        [
            *FORGE,
            "run",
            "--",
            *TASK,
            "--rank",
            "0",
            "--node",
            "0",
            "--seconds",
            "0.5",
            "--exit-code",
            "3",
            "--orphan-s",
            "8",  # still alive after the exit grace (5 s): a leftover
        ],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 3, result.stderr
    assert "left 1 process(es) running" in result.stderr
    run_id = the_run(client, experiment).info.run_id
    time.sleep(4)  # past the moment the orphan would have ended the run
    assert client.get_run(run_id).info.status == "FAILED"
    assert not [  # the job's own processes: its script, from its own directory
        p for p in psutil.process_iter(["cmdline", "cwd"])
        if "mlflow.start_run()" in " ".join(p.info["cmdline"] or []) and p.info["cwd"] == str(tmp_path)
    ]  # fmt: skip


def _monitor(run_id: str, task: Task, env: dict[str, str], cwd: Path, job_id: str) -> subprocess.Popen[str]:
    """``srun --ntasks-per-node=1 otel-forge monitor --run-id RUN`` on ``task``'s node."""
    return subprocess.Popen(
        [*FORGE, "monitor", "--run-id", run_id, "--no-prometheus"],
        cwd=cwd,
        env=hermetic_environ({**env, **slurm_environ(job_id, task, step="1")}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_second_agent_for_a_node_stands_down_with_one_warning(mlflow_server, client, job_repo, tmp_path) -> None:
    experiment = unique("two-agents")
    experiment_id = client.create_experiment(experiment)
    run_id = client.create_run(experiment_id).info.run_id
    env = {**task_environ(mlflow_server.uri, experiment, tmp_path), "MLFLOW_RUN_ID": run_id}
    job = Job(tmp_path, "slurm", nodes=2, tasks_per_node=1)
    monitor = _monitor(run_id, job.tasks()[0], env, job_repo, job.job_id)  # beside node 0's wrapper
    trained = tmp_path / "trained"
    job.start(wrapped("--until", str(trained)), lambda task: env, job_repo)
    # The job trains until each node has windows in the run, however loaded the machine.
    for node in ("node_0", "node_1"):
        wait_for(lambda node=node: len(node_steps(client, run_id, node)) >= 3, 120, 0.2, f"3 windows of {node}")
    trained.touch()
    finished = job.wait()
    time.sleep(1.0)
    os.killpg(monitor.pid, signal.SIGTERM)
    _, monitor_err = monitor.communicate(timeout=60)

    assert [f.returncode for f in finished] == [0, 0] and monitor.returncode == 0, (monitor_err, finished)
    warnings = [
        line
        for text in (monitor_err, *(f.stderr for f in finished))
        for line in text.splitlines()
        if "already writes system/node_0/" in line
    ]
    assert len(warnings) == 1, (warnings, monitor_err, finished)
    for node in ("node_0", "node_1"):
        steps = node_steps(client, run_id, node)
        assert len(steps) >= 3 and contiguous(steps), (node, steps)


def test_an_agent_restarted_after_a_crash_takes_its_node_back(mlflow_server, client, tmp_path) -> None:
    experiment = unique("takeover")
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    env = hermetic_environ(task_environ(mlflow_server.uri, experiment, tmp_path))
    command = [*FORGE, "monitor", "--run-id", run_id, "--no-prometheus", "--node-id", "node_0"]
    crashed = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: len(node_steps(client, run_id, "node_0")) >= 3, 60, 0.2, "3 windows of the first agent")
    os.killpg(crashed.pid, signal.SIGKILL)
    crashed.wait(timeout=30)
    delivered = node_steps(client, run_id, "node_0")

    restarted = subprocess.Popen([*command, "--duration", "2"], env=env, stderr=subprocess.PIPE, text=True)
    _, err = restarted.communicate(timeout=60)

    assert restarted.returncode == 0 and "already writes" not in err, err
    steps = node_steps(client, run_id, "node_0")
    assert contiguous(steps) and len(steps) > len(delivered), (delivered, steps)


def test_otel_forge_run_wrapping_the_launcher_samples_every_node(mlflow_server, client, job_repo, tmp_path) -> None:
    # `otel-forge run -- srun python train.py` on the batch node: node 0 is sampled by otel-forge,
    # node 1 by its own TrainingRun (local rank 0), each once.
    experiment = unique("batch-node")
    job_id = unique("slurm")[-8:]
    batch = {
        "SLURM_JOB_ID": job_id,
        "SLURM_NODEID": "0",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    env = hermetic_environ({**task_environ(mlflow_server.uri, experiment, tmp_path), **batch})
    launcher = [
        sys.executable,
        str(Path(TASK[1]).parent / "srun_like.py"),
        "--job-id",
        job_id,
        "--",
        *TASK,
        "--api",
        "trainingrun",
        "--seconds",
        "6",
    ]
    result = subprocess.run(
        [*FORGE, "run", "--", *launcher],
        check=False,
        cwd=job_repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    assert "already writes" not in result.stderr, result.stderr
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED"
    for node in ("node_0", "node_1"):
        steps = node_steps(client, run.info.run_id, node)
        assert len(steps) >= 3 and contiguous(steps), (node, steps, result.stderr)
