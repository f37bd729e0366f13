"""A real Prometheus scrapes a real ``otel-forge monitor``: the series arrive under the names and
labels that the OTel Prometheus exporter makes of our metric table, and PromQL reads them."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from testkit.servers import (
    AgentProcess,
    PrometheusServer,
    fake_gpu_env,
    free_port,
    start_agent,
    start_prometheus,
    wait_for,
)

SCRAPE_TIMEOUT_S = 15.0


def _monitor_args(port: int) -> list[str]:
    return ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(port), "--interval", "1"]


@pytest.fixture
def scraped_agent(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[..., tuple[AgentProcess, PrometheusServer]]:
    """Start an agent (with ``env``) and a Prometheus scraping it every second; both stop after the test."""

    def start(env: dict[str, str] | None = None) -> tuple[AgentProcess, PrometheusServer]:
        agent = start_agent(_monitor_args(free_port()), env=env)
        request.addfinalizer(agent.kill)
        prometheus = start_prometheus(tmp_path, [agent.scrape_target], scrape_interval_s=1)
        request.addfinalizer(prometheus.kill)
        return agent, prometheus

    return start


def _values(result: list[dict]) -> list[float]:
    return [float(series["value"][1]) for series in result]


def test_prometheus_reads_cpu_memory_and_target_info(scraped_agent: Callable[..., tuple]) -> None:
    agent, prometheus = scraped_agent()

    # First the agent's own /metrics: the exporter's names that the queries below rely on.
    text = agent.scrape()
    for line in (
        "# TYPE system_cpu_utilization gauge",
        "# TYPE system_memory_usage_bytes gauge",
        "# TYPE system_memory_limit_bytes gauge",
        "# TYPE target_info gauge",
    ):
        assert line in text, f"{line!r} not in the agent's /metrics"
    assert 'cpu_mode="idle"' in text and 'system_memory_state="used"' in text

    up = prometheus.wait_for_series('up{job="otel-forge"} == 1', SCRAPE_TIMEOUT_S)
    assert up[0]["metric"]["instance"] == agent.scrape_target

    cpu = prometheus.wait_for_series('system_cpu_utilization{job="otel-forge"}', SCRAPE_TIMEOUT_S, min_series=3)
    modes = {series["metric"].get("cpu_mode") for series in cpu}
    assert {"user", "system", "idle"} <= modes, modes
    assert all(0.0 <= value <= 1.0 for value in _values(cpu)), cpu
    # One series per mode: a mode is never reported twice.
    assert len(modes) == len(cpu)

    used = prometheus.wait_for_series('system_memory_usage_bytes{system_memory_state="used"}', SCRAPE_TIMEOUT_S)
    limit = prometheus.wait_for_series("system_memory_limit_bytes", SCRAPE_TIMEOUT_S)
    assert len(used) == 1 and len(limit) == 1
    assert 0 < _values(used)[0] <= _values(limit)[0]
    # The same comparison in PromQL, label sets matched the way a dashboard matches them.
    assert prometheus.query(
        'system_memory_usage_bytes{system_memory_state="used"} '
        "<= ignoring(system_memory_state) system_memory_limit_bytes"
    )

    target = prometheus.wait_for_series('target_info{job="otel-forge"}', SCRAPE_TIMEOUT_S)
    labels = target[0]["metric"]
    assert labels["service_name"] == "otel-forge"
    assert labels["host_name"] == socket.gethostname()
    assert labels["telemetry_sdk_language"] == "python"


def test_prometheus_reads_fake_gpus(scraped_agent: Callable[..., tuple]) -> None:
    """Two fake NVIDIA GPUs (tests/fakes/pynvml.py, through the nvidia collector) reach Prometheus.

    ``"amd": false``: the fake amdsmi beside it (same scenario variable) plays a host without ROCm.
    """
    agent, prometheus = scraped_agent(fake_gpu_env({"count": 2, "amd": False}))

    def gpu_series() -> list[dict]:
        if "collector nvidia absent" in agent.stderr:
            pytest.fail(f"the agent found no fake GPU:\n{agent.stderr}")  # not retried: Failed is no Exception
        result = prometheus.query("hw_gpu_utilization")
        return result if len(result) >= 2 else []

    utilization = wait_for(gpu_series, SCRAPE_TIMEOUT_S, 0.2, message=lambda: f"2 GPUs; agent stderr:\n{agent.stderr}")
    # The exporter's names for W gauges and J counters, as the agent serves them.
    text = agent.scrape()
    for line in (
        "# TYPE hw_gpu_utilization gauge",
        "# TYPE hw_power_watts gauge",
        "# TYPE hw_energy_joules_total counter",
    ):
        assert line in text, f"{line!r} not in the agent's /metrics"
    assert {series["metric"]["hw_id"] for series in utilization} == {"0", "1"}
    assert {series["metric"]["hw_vendor"] for series in utilization} == {"NVIDIA"}
    assert all(0.0 <= value <= 1.0 for value in _values(utilization))

    power = prometheus.wait_for_series("hw_power_watts", SCRAPE_TIMEOUT_S, min_series=2)
    assert {series["metric"]["hw_id"] for series in power} == {"0", "1"}
    assert all(value > 0 for value in _values(power))

    prometheus.wait_for_series("hw_energy_joules_total", SCRAPE_TIMEOUT_S, min_series=2)
    # Increasing: across the last scrapes (1 s apart), each GPU's energy counter grew.
    grew = prometheus.wait_for_series("increase(hw_energy_joules_total[10s]) > 0", SCRAPE_TIMEOUT_S, min_series=2)
    assert {series["metric"]["hw_id"] for series in grew} == {"0", "1"}
    # A counter that grows without a reset: no resets seen by Prometheus.
    assert all(value == 0 for value in _values(prometheus.query("resets(hw_energy_joules_total[1m])")))
