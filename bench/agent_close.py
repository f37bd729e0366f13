"""CPU an ``otel-forge monitor`` agent spends closing: from its SIGINT to its exit.

Run:  python -m bench.agent_close [--rounds 5] [--windows 3] [--json]

Setup: a private ``mlflow server`` (testkit.mlflow_server.MlflowServer: sqlite, 127.0.0.1, one worker)
and a run; each round starts an agent serving it as a node (``--interval 1``, no Prometheus), waits
for ``--windows`` windows in the run, reads the agent's CPU time (psutil), sends SIGINT and reaps it
with ``os.wait4``: its close is the CPU of its whole life (the rusage) minus that reading. The close
delivers the last window, ends the node's part, and exits.

Subjects, interleaved round by round:

- ``otel-forge``: the command as installed (``otel_forge.cli:console_main``: atexit handlers, then
  the process ends without the interpreter's teardown of its modules);
- ``teardown``: the same agent through ``sys.exit(main())``, the interpreter's own exit, as the
  command was before: what tearing down the modules MLflow, SQLAlchemy and pydantic bring costs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench._common import wait_until

SUBJECTS = {
    "otel-forge": [sys.executable, "-m", "otel_forge.cli"],
    "teardown": [sys.executable, "-c", "import sys; from otel_forge.cli import main; sys.exit(main())"],
}


def close_cpu_s(command: list[str], uri: str, run_id: str, experiment_id: str, windows: int, spool: Path) -> float:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    node = f"node_{time.monotonic_ns()}"
    env = {**os.environ, "OTEL_FORGE_SPOOL_DIR": str(spool), "MLFLOW_EXPERIMENT_ID": experiment_id}
    args = [
        "monitor",
        "--run-id",
        run_id,
        "--tracking-uri",
        uri,
        "--interval",
        "1",
        "--no-prometheus",
        "--node-id",
        node,
    ]
    agent = subprocess.Popen([*command, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    key = f"system/{node}/cpu_utilization_percentage"
    try:
        if not wait_until(lambda: len(client.get_metric_history(run_id, key)) >= windows, 120):
            raise RuntimeError(f"the agent delivered fewer than {windows} windows in 120 s")
        before = psutil.Process(agent.pid).cpu_times()
        agent.send_signal(signal.SIGINT)
        _, _, usage = os.wait4(agent.pid, 0)
    finally:
        if agent.poll() is None and agent.returncode is None:
            agent.kill()
    return usage.ru_utime + usage.ru_stime - before.user - before.system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)

    from mlflow import MlflowClient

    from testkit.mlflow_server import MlflowServer

    results: dict[str, list[float]] = {name: [] for name in SUBJECTS}
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        (root / "server").mkdir()
        with MlflowServer(root / "server") as server:
            client = MlflowClient(server.uri)
            experiment_id = client.create_experiment("agent-close")
            run_id = client.create_run(experiment_id).info.run_id
            for _ in range(options.rounds):
                for name, command in SUBJECTS.items():
                    spool = Path(tempfile.mkdtemp(dir=root))
                    results[name].append(
                        close_cpu_s(command, server.uri, run_id, experiment_id, options.windows, spool)
                    )
    if options.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"Close CPU of `otel-forge monitor` (SIGINT to exit), {options.rounds} rounds, {os.cpu_count()} CPUs\n")
    print("| subject | median ms | min-max ms |")
    print("|---|---:|---:|")
    for name, values in results.items():
        ms = [v * 1000 for v in values]
        print(f"| `{name}` | {statistics.median(ms):.0f} | {min(ms):.0f}-{max(ms):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
