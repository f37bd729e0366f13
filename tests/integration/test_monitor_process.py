"""``otel-forge monitor`` as a process: bad input is one line and exit 2, a taken port is named,
signals stop it promptly and free the port, ``--duration`` ends it by itself."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable

import pytest

from testkit.servers import AgentProcess, agent_environment, free_port, monitor_command, start_agent
from testkit.thread_signal import send_to_another_thread

USAGE_ERROR = 2
RUN_TIMEOUT_S = 20.0
# How long a test waits for the monitor to exit after a signal before it fails: a wait, not a
# measure (it takes well under a second on 2 cores; -s prints it).
STOP_WAIT_S = 30.0


def _safe_args() -> list[str]:
    """Options that keep a run harmless should a bad value slip through: a free local port, a short
    life. The bad option comes after them (argparse: the last one wins)."""
    return [
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--duration",
        "3",
        "--collectors",
        "cpu",
    ]


def _run_monitor(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        monitor_command(args),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=agent_environment(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    ("bad_args", "named"),
    [
        (["--interval", "0"], "--interval"),
        (["--interval", "abc"], "--interval"),
        (["--collectors", "cpu,nope"], "nope"),
        (["--prometheus-port", "70000"], "--prometheus-port"),
        (["--otlp-protocol", "carrier-pigeon"], "--otlp-protocol"),
        (["--otlp-endpoint", "ftp://x"], "--otlp-endpoint"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
    ids=[
        "interval-zero",
        "interval-text",
        "unknown-collector",
        "port-range",
        "protocol",
        "endpoint-scheme",
        "unknown-flag",
    ],
)
def test_bad_value_is_one_line_and_exit_2(bad_args: list[str], named: str) -> None:
    result = _run_monitor(_safe_args() + bad_args)

    assert result.returncode == USAGE_ERROR, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    if bad_args[0] == "--no-such-flag":  # a flag argparse does not know: the command's usage first
        assert lines[0].startswith("usage: otel-forge monitor "), result.stderr
        lines = [line for line in lines if "error" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("otel-forge"), lines[0]
    assert "error" in lines[0]
    assert named in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert "serving" not in result.stdout


def test_port_in_use_is_one_line_naming_the_port_and_the_fix() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = _safe_args() + ["--prometheus-port", str(port)]
        result = _run_monitor(args)

    assert result.returncode == USAGE_ERROR, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert str(port) in lines[0], lines[0]
    assert "--prometheus-port 0" in lines[0] and "--no-prometheus" in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert "serving" not in result.stdout


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the agent itself (prometheus_client's server) binds: SO_REUSEADDR, so a closed
        # listener's TIME_WAIT connections do not count as "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
        return True


@pytest.fixture
def running_agent(request: pytest.FixtureRequest) -> Callable[[], tuple[AgentProcess, int]]:
    def start() -> tuple[AgentProcess, int]:
        port = free_port()
        agent = start_agent(["--prometheus-host", "127.0.0.1", "--prometheus-port", str(port), "--interval", "1"])
        request.addfinalizer(agent.kill)
        assert agent.metrics_url == f"http://127.0.0.1:{port}/metrics"
        assert "system_cpu_utilization" in agent.scrape()  # serving, and a scrape left a connection behind
        return agent, port

    return start


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_the_monitor_and_frees_the_port(
    sig: signal.Signals, running_agent: Callable[[], tuple[AgentProcess, int]]
) -> None:
    agent, port = running_agent()
    assert not _can_bind(port)

    sent = time.monotonic()
    agent.send_signal(sig)
    code = agent.wait(timeout_s=STOP_WAIT_S)  # the signal alone ends it: no --duration, nothing else
    print(f"{sig.name}: monitor exited {code} after {time.monotonic() - sent:.3f} s")

    # Handled, not killed by the signal: a clean exit.
    assert code == 0, (code, agent.stderr)
    assert "Traceback" not in agent.stderr
    assert _can_bind(port), f"port {port} still taken after the monitor exited"


def test_a_sigterm_handed_to_another_thread_stops_the_monitor(
    running_agent: Callable[[], tuple[AgentProcess, int]],
) -> None:
    agent, port = running_agent()

    tid = send_to_another_thread(agent.pid, signal.SIGTERM)
    code = agent.wait(timeout_s=STOP_WAIT_S)  # CPython runs the handler in the main thread, once it wakes

    assert code == 0, (tid, code, agent.stderr)
    assert _can_bind(port), f"port {port} still taken after the monitor exited"


def test_duration_exits_0_by_itself() -> None:
    port = free_port()
    started = time.monotonic()
    result = _run_monitor(
        ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(port), "--interval", "1", "--duration", "1"]
    )
    elapsed_s = time.monotonic() - started

    assert result.returncode == 0, result.stderr
    assert f"otel-forge: serving prometheus http://127.0.0.1:{port}/metrics" in result.stdout.splitlines()
    assert "Traceback" not in result.stderr
    assert elapsed_s >= 1.0
    assert _can_bind(port)


def test_the_agent_delivers_to_mlflow_without_importing_pandas_or_ipython(client, tmp_path) -> None:
    # MLflow's client runs without them (mlflow-skinny has neither): where they are installed, they cost
    # every agent 1.3 CPU-seconds at its first call, on every node of a job at once.
    run_id = client.create_run(client.create_experiment(f"no-pandas-{tmp_path.name}")).info.run_id
    args = ["--run-id", run_id, "--tracking-uri", client.tracking_uri, "--no-prometheus", "--collectors", "cpu,memory",
            "--interval", "0.3", "--duration", "3"]  # fmt: skip
    done = subprocess.run(
        [monitor_command(args)[0], "-X", "importtime", *monitor_command(args)[1:]],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S * 3,
        env=agent_environment({"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}),
        stdin=subprocess.DEVNULL,
    )

    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    # A refused import is logged too (in microseconds): a real one brings the package's own modules.
    assert "mlflow.tracking.client" in imported and not {"pandas.core.api", "IPython.core"} & imported
    assert any(key.startswith("system/") for key in client.get_run(run_id).data.metrics)
