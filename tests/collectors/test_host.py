"""The host collectors on this machine: plausible values, filters, monotonic counters."""

import os
import subprocess
import sys
import time

import psutil
import pytest
from collector_helpers import read
from loopback import loopback_transfer

from otel_forge.collectors.cpu import CpuCollector
from otel_forge.collectors.disk import DiskCollector, filesystems_to_measure, is_real_filesystem
from otel_forge.collectors.memory import MemoryCollector
from otel_forge.collectors.network import NetworkCollector, is_physical_interface
from otel_forge.collectors.process import ProcessCollector, ProcessTree
from otel_forge.config import ForgeConfig


def values(readings, metric, **match):
    return [v for attrs, v in readings.get(metric) if all(attrs.get(k) == x for k, x in match.items())]


def burn_cpu(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_cpu_utilization_is_a_fraction_by_mode_and_never_a_fake_zero():
    collector = CpuCollector(per_cpu=True)
    burn_cpu(0.3)
    first = read(collector)
    busy = values(first, "otel_forge.cpu.utilization")
    # Primed at construction: the very first read covers the burn, not 0.
    assert len(busy) == 1 and 0 < busy[0] <= 1
    points = first.get("system.cpu.utilization")
    by_mode = {a["cpu.mode"]: v for a, v in points if "cpu.logical_number" not in a}
    # semconv's modes: psutil's irq and softirq are one "interrupt".
    assert set(by_mode) == {"user", "nice", "system", "idle", "iowait", "interrupt", "steal"}
    assert all(0 <= v <= 1 for v in by_mode.values())
    assert sum(by_mode.values()) == pytest.approx(1.0, abs=1e-6)
    per_cpu: dict[int, dict[str, float]] = {}
    for attributes, value in points:
        if "cpu.logical_number" in attributes:
            per_cpu.setdefault(attributes["cpu.logical_number"], {})[attributes["cpu.mode"]] = value
    assert sorted(per_cpu) == list(range(psutil.cpu_count()))
    for modes in per_cpu.values():
        assert set(modes) == set(by_mode) and sum(modes.values()) == pytest.approx(1.0, abs=1e-6)
    assert values(first, "system.cpu.logical.count") == [psutil.cpu_count()]
    assert len(values(first, "system.cpu.load_average.1m")) == 1


def test_cpu_without_per_cpu_reports_no_per_cpu_series():
    collector = CpuCollector()
    time.sleep(0.05)
    assert all("cpu.logical_number" not in a for a, _ in read(collector).get("system.cpu.utilization"))


def test_memory_usage_within_limit():
    readings = read(MemoryCollector())
    limit = values(readings, "system.memory.limit")[0]
    used = values(readings, "system.memory.usage", **{"system.memory.state": "used"})[0]
    assert 0 < used <= limit == psutil.virtual_memory().total
    for _, fraction in readings.get("system.memory.utilization"):
        assert 0 <= fraction <= 1
    assert values(readings, "system.memory.utilization", **{"system.memory.state": "used"})[0] == pytest.approx(
        used / limit
    )


def test_filesystems_are_real_mounts_within_limits():
    readings = read(DiskCollector())
    limits = readings.get("system.filesystem.limit")
    assert limits, "at least the root filesystem"
    for attrs, limit in limits:
        assert is_real_filesystem(attrs["system.filesystem.type"], attrs["system.filesystem.mountpoint"])
        used = values(readings, "system.filesystem.usage", **{**attrs, "system.filesystem.state": "used"})[0]
        assert 0 <= used <= limit
    for _, fraction in readings.get("system.filesystem.utilization"):
        assert 0 <= fraction <= 1
    mounts = {a["system.filesystem.mountpoint"] for a, _ in limits}
    assert not mounts & {"/proc", "/sys", "/dev", "/dev/shm", "/run"}


def test_pseudo_filesystems_are_filtered():
    assert not is_real_filesystem("tmpfs", "/tmp")
    assert not is_real_filesystem("proc", "/proc")
    assert not is_real_filesystem("overlay", "/var/lib/docker/overlay2/x/merged")
    assert is_real_filesystem("overlay", "/")  # a container's root: where MLflow measures disk usage
    assert is_real_filesystem("ext4", "/")
    assert is_real_filesystem("xfs", "/data")


# A Docker container's mount table: the root is an overlay, which psutil's all=False leaves out
# ("nodev overlay"), and the host's disk is bind-mounted over a few files before it would come.
_CONTAINER_FILESYSTEMS = "nodev\tsysfs\nnodev\ttmpfs\nnodev\tproc\nnodev\toverlay\n\text4\n"
_CONTAINER_MOUNTS = """\
overlay / overlay rw,relatime,lowerdir=/l,upperdir=/u,workdir=/w 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /dev tmpfs rw,nosuid,size=65536k,mode=755 0 0
/dev/sda1 /etc/resolv.conf ext4 rw,relatime 0 0
/dev/sda1 /etc/hostname ext4 rw,relatime 0 0
"""


def test_the_root_filesystem_is_measured_when_it_is_a_container_overlay(tmp_path, monkeypatch):
    """MLflow's disk_* keys are psutil.disk_usage("/"); ours must be there when "/" is an overlay too."""
    (tmp_path / "self").mkdir()
    (tmp_path / "filesystems").write_text(_CONTAINER_FILESYSTEMS)
    (tmp_path / "self" / "mounts").write_text(_CONTAINER_MOUNTS)
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    assert "/" not in {p.mountpoint for p in psutil.disk_partitions(all=False)}  # what psutil alone gives

    measured = filesystems_to_measure()
    assert [(p.mountpoint, p.fstype) for p in measured][:1] == [("/", "overlay")]
    assert [p.mountpoint for p in measured[1:]] == ["/etc/resolv.conf", "/etc/hostname"]
    readings = read(DiskCollector())
    used = values(readings, "system.filesystem.usage", **{"system.filesystem.mountpoint": "/"})
    assert used and used[0] > 0


def test_disk_io_counters_are_monotonic(tmp_path):
    collector = DiskCollector()
    before = read(collector)
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    os.sync()
    after = read(collector)
    assert before.get("system.disk.io"), "this machine has a disk"
    before_by_key = {tuple(sorted(a.items())): v for a, v in before.get("system.disk.io")}
    for attrs, value in after.get("system.disk.io"):
        assert value >= before_by_key.get(tuple(sorted(attrs.items())), 0)


def test_network_filters_loopback_and_counts_monotonically():
    collector = NetworkCollector()
    first = read(collector)
    second = read(collector)
    names = {a["network.interface.name"] for a, _ in first.get("system.network.io")}
    assert "lo" not in names
    assert all(is_physical_interface(n) for n in names)
    before = {tuple(sorted(a.items())): v for a, v in first.get("system.network.io")}
    for attrs, value in second.get("system.network.io"):
        assert value >= before[tuple(sorted(attrs.items()))]
    assert {a["network.io.direction"] for a, _ in first.get("system.network.io")} <= {"receive", "transmit"}


def test_the_all_interface_sum_is_psutils_total_and_sees_loopback_traffic():
    """MLflow's network_*_megabytes are psutil.net_io_counters()'s totals: every interface, lo included."""
    collector = NetworkCollector()
    before_total = psutil.net_io_counters()
    before = read(collector)
    sent = loopback_transfer(8 << 20)
    after = read(collector)
    after_total = psutil.net_io_counters()
    assert sent == 8 << 20
    for direction, field in (("receive", "bytes_recv"), ("transmit", "bytes_sent")):
        (first,) = values(before, "otel_forge.network.io.all_interfaces", **{"network.io.direction": direction})
        (second,) = values(after, "otel_forge.network.io.all_interfaces", **{"network.io.direction": direction})
        # Between psutil's own totals read just outside ours, and grown by at least the transfer.
        assert getattr(before_total, field) <= first <= second <= getattr(after_total, field)
        assert second - first >= sent
    # The per-interface series still leave lo out.
    assert "lo" not in {a["network.interface.name"] for a, _ in after.get("system.network.io")}


def test_loopback_is_included_only_when_asked():
    names = {
        a["network.interface.name"] for a, _ in read(NetworkCollector(include_virtual=True)).get("system.network.io")
    }
    assert "lo" in names
    assert not is_physical_interface("lo") and not is_physical_interface("docker0")
    assert not is_physical_interface("veth1234")


def test_process_tree_includes_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        collector = ProcessCollector.create(ForgeConfig.resolve(environ={}))
        burn_cpu(0.2)
        readings = read(collector)
        assert child.pid in ProcessTree(os.getpid()).pids()
        assert values(readings, "otel_forge.process.count")[0] >= 2
        rss = values(readings, "process.memory.usage")[0]
        assert rss >= psutil.Process().memory_info().rss
        assert values(readings, "process.memory.virtual")[0] >= rss
        assert values(readings, "process.thread.count")[0] >= 2
        assert values(readings, "process.unix.file_descriptor.count")[0] >= 3
        utilization = values(readings, "process.cpu.utilization")[0]
        assert 0 < utilization <= 1
        assert readings.get("process.cpu.utilization")[0][0] == {"process.pid": os.getpid()}
    finally:
        child.kill()
        child.wait()


def test_process_of_another_pid_and_a_missing_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        readings = read(ProcessCollector.create(ForgeConfig.resolve(environ={}, pid=child.pid)))
        assert values(readings, "otel_forge.process.count") == [1]
    finally:
        child.kill()
        child.wait()
    from otel_forge.collectors.base import CollectorUnavailable

    with pytest.raises(CollectorUnavailable, match=str(child.pid)):
        ProcessCollector.create(ForgeConfig.resolve(environ={}, pid=child.pid))
