"""The job's cgroup: limits, usage against them, throttling, OOM kills and pressure.

cgroup v2 on fixture trees laid out as the kernel writes them (``/proc/<pid>/cgroup``, the mount
table, the cgroup's files); cgroup v1 for real, in cgroups this test makes where root can (the cpu,
cpuacct and memory controllers of this machine are writable), through ``otel-forge run`` to the
MLflow keys a user reads.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
from collector_helpers import read

from otel_forge.collectors.cgroup import CgroupCollector
from otel_forge.collectors.cgroup_fs import CgroupV1, CgroupV2, find_cgroup, parse_cpu_list, read_pressure
from otel_forge.config import ForgeConfig
from testkit.cgroups import V1Cgroup, v1_writable
from testkit.hermetic import hermetic_environ
from testkit.servers import REPO_ROOT

GiB = 2**30
PSI = "some avg10=1.50 avg60=0.80 avg300=0.20 total={some}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _v2_tree(tmp_path: Path, *, cpu_max: str = "50000 100000", memory_max: str = str(2 * GiB),
             pod_cpu_max: str = "max 100000", usage_usec: int = 1_000_000,
             throttled: tuple[int, int, int] = (10, 4, 250_000), oom_kills: int = 0, current: int = GiB,
             inactive_file: int = GiB // 4) -> tuple[Path, Path]:  # fmt: skip
    """/proc and /sys/fs/cgroup of a process in a Kubernetes pod's container: the pod's cgroup above
    the container's (``pod_cpu_max``), cgroup v2 mounted at /sys/fs/cgroup."""
    proc, mount = tmp_path / "proc", tmp_path / "sys/fs/cgroup"
    container = "kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"
    periods, throttled_periods, throttled_usec = throttled
    _write(proc, {
        "self/cgroup": f"0::/{container}\n",
        "self/mountinfo": "24 1 0:22 / /sys rw - sysfs sysfs rw\n"
                          "30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        "pressure/cpu": PSI.format(some=9_000_000, full=0),
    })  # fmt: skip
    _write(mount, {
        "kubepods.slice/kubepods-pod1.slice/cpu.max": pod_cpu_max,
        f"{container}/cpu.max": cpu_max,
        f"{container}/cpuset.cpus.effective": "0-127\n",
        f"{container}/cpu.stat": f"usage_usec {usage_usec}\nuser_usec 900000\nsystem_usec 100000\n"
                                 f"nr_periods {periods}\nnr_throttled {throttled_periods}\n"
                                 f"throttled_usec {throttled_usec}\n",
        f"{container}/memory.current": f"{current}\n",
        f"{container}/memory.max": f"{memory_max}\n",
        f"{container}/memory.stat": f"anon {current // 2}\nfile {current // 2}\ninactive_file {inactive_file}\n",
        f"{container}/memory.events": f"low 0\nhigh 0\nmax 3\noom {oom_kills}\noom_kill {oom_kills}\n",
        f"{container}/cpu.pressure": PSI.format(some=2_500_000, full=500_000),
        f"{container}/memory.pressure": PSI.format(some=100, full=50),
        f"{container}/io.pressure": PSI.format(some=7, full=3),
    })  # fmt: skip
    return proc, mount / container


def _collector(proc: Path, host_cpus: int = 128, host_memory: int = 512 * GiB) -> CgroupCollector:
    cgroup = find_cgroup("self", proc, root=proc.parent)
    assert cgroup is not None
    return CgroupCollector(cgroup, host_cpus=host_cpus, host_memory=host_memory)


def _one(readings, metric: str, **match) -> float:  # type: ignore[no-untyped-def]
    (value,) = [v for attrs, v in readings.get(metric) if all(attrs.get(k) == x for k, x in match.items())]
    return value


def test_v2_a_container_under_a_quota_reads_usage_against_its_limit(tmp_path):
    proc, container = _v2_tree(tmp_path)
    collector = _collector(proc)
    assert isinstance(collector._cgroup, CgroupV2) and collector._cgroup.directory == container
    # Half a CPU's quota, used whole for 2 s: 1 s of CPU time more, and 6 more throttled periods.
    time.sleep(0.2)
    _write(container, {"cpu.stat": "usage_usec 2000000\nnr_periods 30\nnr_throttled 10\nthrottled_usec 850000\n"})
    readings = read(collector)
    assert _one(readings, "otel_forge.container.cpu.limit") == 0.5
    used = _one(readings, "container.cpu.usage")
    assert 0 < used <= 1.0 / 0.2  # 1 s of CPU time over the time since the collector was made
    assert _one(readings, "otel_forge.container.cpu.utilization") == pytest.approx(used / 0.5)
    assert _one(readings, "container.cpu.time") == 2.0
    assert _one(readings, "otel_forge.container.cpu.throttled_periods") == 10
    assert _one(readings, "otel_forge.container.cpu.periods") == 30
    assert _one(readings, "otel_forge.container.cpu.throttled_time") == pytest.approx(0.85)
    # Memory: the working set (usage minus inactive file pages) against the 2 GiB limit.
    assert _one(readings, "otel_forge.container.memory.limit") == 2 * GiB
    assert _one(readings, "container.memory.usage") == GiB
    assert _one(readings, "container.memory.working_set") == GiB - GiB // 4
    assert _one(readings, "otel_forge.container.memory.utilization") == pytest.approx(0.375)
    assert _one(readings, "otel_forge.container.memory.oom_kills") == 0
    # The cgroup's own pressure, not the machine's.
    stall = "otel_forge.pressure.stall.time"
    assert _one(readings, stall, **{"otel_forge.pressure.resource": "cpu", "otel_forge.pressure.scope": "some"}) == 2.5
    assert _one(readings, stall, **{"otel_forge.pressure.resource": "io", "otel_forge.pressure.scope": "full"}) == 3e-6


def test_v2_the_pod_limit_above_the_container_counts_and_the_cpuset_too(tmp_path):
    proc, container = _v2_tree(tmp_path, cpu_max="max 100000", pod_cpu_max="400000 100000")
    readings = read(_collector(proc))
    assert _one(readings, "otel_forge.container.cpu.limit") == 4.0  # the pod's quota: 4 CPUs
    _write(container, {"cpuset.cpus.effective": "0-1,64\n"})
    readings = read(_collector(proc))
    assert _one(readings, "otel_forge.container.cpu.limit") == 3.0  # a cpuset of 3 CPUs is smaller


def test_v2_an_oom_kill_is_counted(tmp_path):
    proc, _ = _v2_tree(tmp_path, oom_kills=2)
    assert _one(read(_collector(proc)), "otel_forge.container.memory.oom_kills") == 2


def test_v2_no_limit_reads_as_the_machine_does_only_pressure(tmp_path):
    proc, container = _v2_tree(tmp_path, cpu_max="max 100000", memory_max="max")
    readings = read(_collector(proc))
    assert set(readings.metrics()) == {"otel_forge.pressure.stall.time"}
    # A "limit" at least as large as the machine is none either.
    proc, _ = _v2_tree(tmp_path / "big", cpu_max="25600000 100000", memory_max=str(1024 * GiB))
    assert set(read(_collector(proc)).metrics()) == {"otel_forge.pressure.stall.time"}


def test_v2_the_machine_pressure_where_the_cgroup_has_none(tmp_path):
    proc, container = _v2_tree(tmp_path)
    for resource in ("cpu", "memory", "io"):
        (container / f"{resource}.pressure").unlink()
    readings = read(_collector(proc))
    stall = "otel_forge.pressure.stall.time"
    assert _one(readings, stall, **{"otel_forge.pressure.resource": "cpu", "otel_forge.pressure.scope": "some"}) == 9.0
    assert [a["otel_forge.pressure.resource"] for a, _ in readings.get(stall)] == ["cpu", "cpu"]


def test_v1_membership_and_mount_roots_as_a_container_sees_them(tmp_path):
    """Docker on cgroup v1: the container's mounts are rooted at its own cgroup, so its path is ``/``."""
    proc = tmp_path / "proc"
    _write(proc, {
        "self/cgroup": "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n1:name=systemd:/x\n",
        "self/mountinfo": "40 30 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
                          "41 30 0:36 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
                          "42 30 0:37 /docker/abc /sys/fs/cgroup/cpuset ro - cgroup cgroup rw,cpuset\n",
    })  # fmt: skip
    cgroup = find_cgroup("self", proc, root=tmp_path)
    assert isinstance(cgroup, CgroupV1)
    assert {name: str(path) for name, (path, _) in cgroup.directories.items()} == {
        "cpu": f"{tmp_path}/sys/fs/cgroup/cpu,cpuacct",
        "cpuacct": f"{tmp_path}/sys/fs/cgroup/cpu,cpuacct",
        "cpuset": f"{tmp_path}/sys/fs/cgroup/cpuset",
        "memory": f"{tmp_path}/sys/fs/cgroup/memory",
    }


def test_kernel_formats():
    assert parse_cpu_list("0-3,8,10-11\n") == 7
    assert parse_cpu_list("5") == 1
    assert parse_cpu_list("\n") is None
    assert find_cgroup(999_999_999) is None  # no such process


def test_pressure_files_as_the_kernel_writes_them(tmp_path):
    _write(tmp_path, {"cpu": PSI.format(some=1_500_000, full=0), "io": "some avg10=0.00 total=abc\n"})
    assert read_pressure(tmp_path) == {("cpu", "some"): 1.5, ("cpu", "full"): 0.0}


# --- real cgroups (v1), made by root ------------------------------------------------------------


@pytest.fixture
def v1_cgroup(request):
    """A fresh cgroup in each v1 controller named, removed after the test (its processes gone)."""
    if not v1_writable(*request.param):
        pytest.skip(f"root cannot make v1 cgroups in {request.param} on this machine")
    cgroup = V1Cgroup(request.param)
    yield cgroup
    cgroup.remove()


# A busy loop that says, at its end, the share of its CPU limit its cgroup got meanwhile (the cgroup's
# CPU time / elapsed / limit): the loop's, and otel-forge run's beside it (it opens the run as CMD starts).
BUSY = """
import time
def used_s():
    with open({usage!r}) as usage:
        return int(usage.read()) / 1e9
start, used = time.monotonic(), used_s()
while time.monotonic() < start + {seconds}:
    pass
print("share of limit", 100 * (used_s() - used) / (time.monotonic() - start) / {limit})
"""


@pytest.mark.parametrize("v1_cgroup", [("cpu", "cpuacct", "memory")], indirect=True)
def test_v1_a_busy_loop_under_half_a_cpu_reads_its_limit_full_in_mlflow(v1_cgroup, mlflow_server, client, tmp_path):
    """``otel-forge run`` in a cgroup with a 0.5-CPU quota and a 1 GiB memory limit: MLflow's
    cpu_utilization_percentage is the job's, about 100 % of its limit, throttled; the host's (2 CPUs
    here) stays below 50 %. The memory keys are the job's too, the host's beside them."""
    v1_cgroup.limit_cpu(0.5)
    v1_cgroup.limit_memory(GiB)
    experiment = f"cgroup-{uuid.uuid4().hex[:8]}"
    env = hermetic_environ(
        {"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"), "PYTHONPATH": str(REPO_ROOT)}, prefixes=("OTEL_", "MLFLOW_")
    )
    busy = BUSY.format(seconds=8, limit=0.5, usage=str(v1_cgroup.directories["cpuacct"] / "cpuacct.usage"))
    forge = [sys.executable, "-m", "otel_forge.cli", "run", "--tracking-uri", mlflow_server.uri, "--experiment",
             experiment, "--no-prometheus", "--interval", "1", "--samples-per-window", "1", "--collectors",
             "cpu,memory,cgroup", "--", sys.executable, "-c", busy]  # fmt: skip
    result = subprocess.run(v1_cgroup.joining(forge), env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = {key: [m.value for m in client.get_metric_history(run.info.run_id, f"system/{key}")] for key in (
        "cpu_utilization_percentage", "host_cpu_utilization_percentage", "container_cpu_limit_cpus",
        "container_cpu_throttled_seconds_per_second")}  # fmt: skip
    # The loop runs through the windows but the first and the last, the job at its quota: about 100 % on a
    # quiet machine; a machine busy with other work (other tests, servers) gives it less, which the
    # cgroup's own CPU time says. The host view holds that other work too; the job's share is a quarter here.
    got = float(result.stdout.split("share of limit")[-1])
    steady = history["cpu_utilization_percentage"][1:-1]
    assert steady and abs(statistics.mean(steady) - got) <= 15 and max(steady) <= 130, (got, history)
    assert statistics.mean(steady) * 0.5 / (os.cpu_count() or 1) < 50
    assert history["host_cpu_utilization_percentage"], history  # the machine's view, moved aside
    assert set(history["container_cpu_limit_cpus"]) == {0.5}
    assert max(history["container_cpu_throttled_seconds_per_second"]) > 0, history
    metrics = client.get_run(run.info.run_id).data.metrics
    assert metrics["system/system_memory_total_megabytes"] == GiB / 1e6
    assert 0 < metrics["system/system_memory_usage_megabytes"] < GiB / 1e6
    assert metrics["system/host_memory_total_megabytes"] == pytest.approx(psutil.virtual_memory().total / 1e6)
    assert 0 < metrics["system/system_memory_usage_percentage"] < 100
    assert "system/host_memory_usage_percentage" in metrics and metrics["system/container_oom_kills"] == 0


@pytest.mark.parametrize("v1_cgroup", [("memory",)], indirect=True)
def test_v1_a_memory_limit_is_the_denominator_of_memory_utilization(v1_cgroup):
    """256 MiB held in a cgroup limited to 512 MiB: utilization about 50 %, of the limit, not the host."""
    v1_cgroup.limit_memory(512 * 2**20)
    hold = textwrap.dedent("""
        import sys, time
        block = bytearray(256 * 2**20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        print("held", flush=True)
        time.sleep(60)
    """)
    process = subprocess.Popen(v1_cgroup.joining([sys.executable, "-c", hold]), stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        collector = CgroupCollector.create(ForgeConfig.resolve(pid=process.pid))
        readings = read(collector)
    finally:
        process.kill()
        process.wait()
    assert _one(readings, "otel_forge.container.memory.limit") == 512 * 2**20
    assert 0.45 <= _one(readings, "otel_forge.container.memory.utilization") <= 0.65
    assert _one(readings, "otel_forge.container.memory.oom_kills") == 0


def test_a_node_agent_beside_the_jobs_reads_the_machine_not_its_own_pod(tmp_path, monkeypatch):
    """``OTEL_FORGE_CGROUP=machine`` (the DaemonSet's): no limits, however the agent's own pod is limited."""
    monkeypatch.setenv("OTEL_FORGE_CGROUP", "machine")
    collector = CgroupCollector.create(ForgeConfig.resolve())
    readings = read(collector)
    assert not [name for name in readings.metrics() if "container" in name]
    assert "the machine" in collector.describe()[0]
    if Path("/proc/pressure/cpu").exists():
        assert readings.get("otel_forge.pressure.stall.time")
