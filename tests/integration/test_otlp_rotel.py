"""A third-party OTLP receiver gets the agent's metrics for each form of the endpoint: rotel, an
OpenTelemetry collector in Rust shipped as a Python wheel (the dev extra has it where a wheel
exists; elsewhere these tests skip). Its debug exporter prints each ResourceMetrics it receives.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.hermetic import hermetic_environ
from testkit.servers import AgentProcess, free_port, listening, spawn_agent, wait_for

rotel = pytest.importorskip("rotel")

ROTEL_AGENT = Path(rotel.__file__).parent / "rotel-agent"
TIMEOUT_S = 15.0


@dataclass
class Rotel:
    process: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    output: Path  # stdout: the debug exporter's dump, then its log lines

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def resource_metrics(self) -> list[str]:
        """The dump of each ResourceMetrics received so far."""
        return self.text().split("ResourceMetrics #")[1:]


@pytest.fixture(scope="module")
def rotel_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rotel]:
    """One rotel process on 127.0.0.1 (free ports), dumping the metrics it receives; stopped at the end."""
    directory = tmp_path_factory.mktemp("rotel")
    grpc_port, http_port = free_port(), free_port()
    command = [
        str(ROTEL_AGENT),
        "start",
        "--otlp-grpc-endpoint",
        f"127.0.0.1:{grpc_port}",
        "--otlp-http-endpoint",
        f"127.0.0.1:{http_port}",
        "--exporter",
        "blackhole",
        "--debug-log",
        "metrics",
        "--debug-log-verbosity",
        "detailed",
        "--pid-file",
        str(directory / "rotel.pid"),
        "--log-file",
        str(directory / "rotel.log"),
    ]
    output = directory / "rotel.out"
    with output.open("wb") as stdout:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=hermetic_environ(),
            start_new_session=True,
        )
    collector = Rotel(process, grpc_port, http_port, output)
    try:
        wait_for(
            lambda: process.poll() is None and listening(grpc_port) and listening(http_port),
            TIMEOUT_S,
            message=lambda: f"rotel to listen (exit {process.poll()}): {collector.text()}",
        )
        yield collector
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# Each form: the monitor's flags and variables, ``{http}``/``{grpc}`` being rotel's ports.
ENDPOINT_FORMS = {
    "http-full-url": (["--otlp-endpoint", "http://127.0.0.1:{http}/v1/metrics"], {}),
    "http-base-url": (["--otlp-endpoint", "http://127.0.0.1:{http}"], {}),
    "grpc-host-port": (
        ["--otlp-protocol", "grpc", "--otlp-endpoint", "127.0.0.1:{grpc}"],
        {"OTEL_EXPORTER_OTLP_INSECURE": "true"},
    ),
}


@pytest.mark.parametrize("form", ENDPOINT_FORMS)
def test_rotel_receives_each_endpoint_form(form: str, rotel_collector: Rotel, request: pytest.FixtureRequest) -> None:
    args, env = ENDPOINT_FORMS[form]
    ports = {"http": rotel_collector.http_port, "grpc": rotel_collector.grpc_port}
    service = f"otel-forge-{form}"  # tells this agent's metrics from the other forms' in rotel's dump
    agent: AgentProcess = spawn_agent(
        ["--no-prometheus", "--collectors", "cpu", "--interval", "0.2", *(arg.format(**ports) for arg in args)],
        {**env, "OTEL_SERVICE_NAME": service},
    )
    request.addfinalizer(agent.kill)

    def delivered() -> bool:
        return any(
            f"service.name: Str({service})" in dump and "Name: system.cpu.utilization" in dump
            for dump in rotel_collector.resource_metrics()
        )

    wait_for(
        delivered,
        TIMEOUT_S,
        0.1,
        message=lambda: (
            f"{service}'s metrics in rotel's dump\n{agent.describe()}\nrotel:\n{rotel_collector.text()[-3000:]}"
        ),
    )
    assert agent.stop() == 0, agent.describe()
    assert "Traceback" not in agent.stderr and "404" not in agent.stderr
