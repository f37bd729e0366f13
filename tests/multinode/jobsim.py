"""A multi-node job simulated on one machine, as a launcher would start it.

``Job(launcher, nodes, tasks_per_node)`` gives every task the variables its launcher sets (SLURM,
torchrun or Open MPI); each simulated node is a process group of its own; every task waits on one
start file, so all of them start at the same moment. Under MPI, which has no node index, each node
also gets a host name of its own (a UTS namespace: ``unshare --uts``), as real nodes have.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testkit.hermetic import hermetic_environ

FORGE = [sys.executable, "-m", "otel_forge.cli"]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TASK = [sys.executable, str(SCRIPTS / "task.py")]
# Wait for the start file, then become the task: every task starts at the same moment.
_START_GATE = 'while [ ! -e "$0" ]; do sleep 0.005; done; exec "$@"'
_HOSTNAME_GATE = 'hostname "$0" && exec "$@"'


@dataclass(frozen=True)
class Task:
    node: int
    local_rank: int
    rank: int
    world_size: int
    nodes: int
    tasks_per_node: int


def slurm_environ(job_id: str, task: Task, step: str = "0") -> dict[str, str]:
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_STEP_ID": step,
        "SLURM_STEPID": step,
        "SLURM_PROCID": str(task.rank),
        "SLURM_LOCALID": str(task.local_rank),
        "SLURM_NODEID": str(task.node),
        "SLURM_NTASKS": str(task.world_size),
        "SLURM_JOB_NUM_NODES": str(task.nodes),
        "SLURM_NNODES": str(task.nodes),
        "SLURM_NTASKS_PER_NODE": str(task.tasks_per_node),
    }


def torchrun_environ(job_id: str, task: Task) -> dict[str, str]:
    return {
        "RANK": str(task.rank),
        "LOCAL_RANK": str(task.local_rank),
        "WORLD_SIZE": str(task.world_size),
        "LOCAL_WORLD_SIZE": str(task.tasks_per_node),
        "GROUP_RANK": str(task.node),
        "GROUP_WORLD_SIZE": str(task.nodes),
        "ROLE_RANK": str(task.rank),
        "ROLE_WORLD_SIZE": str(task.world_size),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def mpi_environ(job_id: str, task: Task) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(task.rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(task.local_rank),
        "OMPI_COMM_WORLD_SIZE": str(task.world_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(task.tasks_per_node),
        "OMPI_UNIVERSE_SIZE": str(task.world_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(task.local_rank),
        "PMIX_NAMESPACE": f"prterun-sim-{job_id}@1",
        "PMIX_RANK": str(task.rank),
    }


LAUNCHERS: dict[str, Callable[[str, Task], dict[str, str]]] = {
    "slurm": slurm_environ,
    "torchrun": torchrun_environ,
    "mpi": mpi_environ,
}


def mpi_hostname(job_id: str, node: int) -> str:
    return f"sim-{job_id}-n{node}"


@dataclass
class Finished:
    task: Task
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Job:
    """Tasks started together, one process group per node; ``wait()`` gives each task's outcome."""

    directory: Path
    launcher: str
    nodes: int = 2
    tasks_per_node: int = 2
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    name: str = "job"  # names its tasks' output files: one directory may hold several jobs
    processes: list[tuple[Task, subprocess.Popen[str]]] = field(default_factory=list)

    def tasks(self) -> list[Task]:
        world = self.nodes * self.tasks_per_node
        return [
            Task(node, local, node * self.tasks_per_node + local, world, self.nodes, self.tasks_per_node)
            for node in range(self.nodes)
            for local in range(self.tasks_per_node)
        ]

    def launcher_environ(self, task: Task) -> dict[str, str]:
        return LAUNCHERS[self.launcher](self.job_id, task)

    def start(self, argv: Callable[[Task], Sequence[str]], environ: Callable[[Task], dict[str, str]], cwd: Path) -> Job:
        """Start every task; ``argv``/``environ`` give a task's command and its own variables."""
        gate = self.directory / f"start-{uuid.uuid4().hex}"
        leaders: dict[int, int] = {}
        for task in self.tasks():
            command = list(argv(task))
            if self.launcher == "mpi":
                command = [
                    "unshare",
                    "--uts",
                    "--fork",
                    "sh",
                    "-c",
                    _HOSTNAME_GATE,
                    mpi_hostname(self.job_id, task.node),
                    *command,
                ]
            env = hermetic_environ({**environ(task), **self.launcher_environ(task)})
            out = open(self._output_path(task, "out"), "w")  # noqa: SIM115 - the child holds its own copy
            err = open(self._output_path(task, "err"), "w")  # noqa: SIM115
            group = leaders.get(task.node, 0)  # 0: a new group, led by this task
            process = subprocess.Popen(
                ["sh", "-c", _START_GATE, str(gate), *command],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                text=True,
                process_group=group,
            )
            out.close()
            err.close()
            leaders.setdefault(task.node, process.pid)
            self.processes.append((task, process))
        gate.touch()
        return self

    def wait(self, timeout_s: float = 120.0) -> list[Finished]:
        deadline = time.monotonic() + timeout_s
        finished = []
        for task, process in self.processes:
            try:
                code = process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"task {task} still running after {timeout_s} s:\n{self.output(task)}") from None
            finished.append(Finished(task, code, *self.output(task)))
        return finished

    def _output_path(self, task: Task, stream: str) -> Path:
        return self.directory / f"{self.name}-task{task.rank}.{stream}"

    def output(self, task: Task) -> tuple[str, str]:
        return self._output_path(task, "out").read_text(), self._output_path(task, "err").read_text()

    def kill(self) -> None:
        for node_leader in {process.pid for task, process in self.processes if task.local_rank == 0}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node_leader, signal.SIGKILL)
        for _, process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
