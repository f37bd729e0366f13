"""promtool's lint of a live ``/metrics`` (every collector, both GPU vendors through the fakes):
only the four ``*.count`` names OpenTelemetry users query by, nothing else."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

from testkit.servers import fake_gpu_env, free_port, start_agent

# Counts named the semconv way; Prometheus reserves _count for histograms and summaries (README, Metrics).
SEMCONV_STYLE_COUNTS = {
    "process_thread_count",
    "process_unix_file_descriptor_count",
    "system_cpu_logical_count",
    "otel_forge_process_count",
}


def test_promtool_warns_only_about_the_semconv_count_names() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `apt-get install -y prometheus` (what .ci/run does)"
    agent = start_agent(
        [
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--interval",
            "1",
            "--collectors",
            "cpu,memory,disk,network,process,nvidia,amd",
        ],
        env={**fake_gpu_env({"count": 2}), "OTEL_FORGE_PER_CPU": "true"},
    )
    try:
        # promtool lints the text format (it cannot parse OpenMetrics).
        request = urllib.request.Request(agent.metrics_url or "", headers={"Accept": "text/plain;version=0.0.4"})
        body = urllib.request.urlopen(request, timeout=10).read()
        assert b"hw_gpu_io_bytes_total" in body and b"cpu_logical_number" in body  # GPUs and per-CPU are in
        lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
        output = lint.stdout.decode() + lint.stderr.decode()
        warned = {line.split()[0] for line in output.splitlines() if line.strip()}
        assert warned == SEMCONV_STYLE_COUNTS, output
        assert all('should not have "_count" suffix' in line for line in output.splitlines() if line.strip())
    finally:
        agent.kill()
