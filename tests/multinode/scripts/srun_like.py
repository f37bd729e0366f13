"""Starts a job step as ``srun`` does on a 2-node allocation: 2 tasks per node, each with its SLURM
variables, each node's tasks in a process group; exits with the first non-zero task code."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..", "..")]  # jobsim, and testkit it uses

from jobsim import Job  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-id", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    processes = []
    leaders: dict[int, int] = {}
    for task in Job(directory=None, launcher="slurm").tasks():  # type: ignore[arg-type]
        env = {**os.environ, **Job(None, "slurm", job_id=args.job_id).launcher_environ(task)}  # type: ignore[arg-type]
        argv = [*command, "--rank", str(task.rank), "--node", str(task.node)]
        process = subprocess.Popen(argv, env=env, process_group=leaders.get(task.node, 0))
        leaders.setdefault(task.node, process.pid)
        processes.append(process)
    codes = [process.wait() for process in processes]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
