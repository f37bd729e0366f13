"""Filesystems (usage per real mount) and disk io (bytes and operations per device)."""

from __future__ import annotations

import os
import time

import psutil

from otel_forge.collectors.base import HardwareCollector, Readings
from otel_forge.config import ForgeConfig

# Filesystems that hold no disk space of their own. psutil's all=False already drops most.
PSEUDO_FILESYSTEMS = frozenset(
    {
        "autofs",
        "binfmt_misc",
        "bpf",
        "cgroup",
        "cgroup2",
        "configfs",
        "debugfs",
        "devpts",
        "devtmpfs",
        "efivarfs",
        "fusectl",
        "hugetlbfs",
        "mqueue",
        "nsfs",
        "overlay",
        "proc",
        "pstore",
        "ramfs",
        "rpc_pipefs",
        "securityfs",
        "squashfs",
        "sysfs",
        "tmpfs",
        "tracefs",
        "fuse.lxcfs",
        "fuse.gvfsd-fuse",
    }
)
_PSEUDO_DISK_PREFIXES = ("loop", "ram", "zram")
_SYS_BLOCK = "/sys/block"


def is_physical_disk(device: str) -> bool:
    """A whole disk with hardware behind it: not a partition (its bytes are the disk's too), not
    device-mapper or md (their bytes are their members'), not loop or ram."""
    if device.startswith(_PSEUDO_DISK_PREFIXES):
        return False
    if not os.path.isdir(_SYS_BLOCK):
        return True  # no sysfs to tell: keep what psutil lists
    return os.path.exists(os.path.join(_SYS_BLOCK, device, "device"))


def is_real_filesystem(fstype: str, mountpoint: str) -> bool:
    # The root filesystem always counts: in a container it is an overlay, and it is where
    # MLflow's monitor measures disk usage.
    if mountpoint == "/":
        return True
    return fstype not in PSEUDO_FILESYSTEMS and not mountpoint.startswith(("/proc", "/sys", "/dev", "/run"))


def filesystems_to_measure() -> list:
    """psutil's real filesystems, with "/" first whatever it is: MLflow's monitor measures
    ``disk_usage("/")``, and psutil's ``all=False`` leaves out a container's overlay root (overlay has
    no device of its own). First, so a bind mount of the root's device listed before it cannot hide it."""
    listed = psutil.disk_partitions(all=False)
    roots = [p for p in listed if p.mountpoint == "/"]
    if not roots:
        # /proc/self/mounts lists what is mounted over "/" after what it hides: the last one is seen.
        roots = [p for p in psutil.disk_partitions(all=True) if p.mountpoint == "/"][-1:]
    return roots[-1:] + [p for p in listed if p.mountpoint != "/"]


# Mounts rarely change; listing them costs half a read.
_MOUNTS_MAX_AGE_S = 60.0


class DiskCollector(HardwareCollector):
    name = "disk"

    def __init__(self) -> None:
        self._partitions: list = []
        self._partitions_at_s = -_MOUNTS_MAX_AGE_S

    @classmethod
    def create(cls, config: ForgeConfig) -> DiskCollector:
        return cls()

    def read(self, readings: Readings) -> None:
        self._read_filesystems(readings)
        self._read_io(readings)

    def _read_filesystems(self, readings: Readings) -> None:
        seen_devices: set[str] = set()
        now = time.monotonic()
        if now - self._partitions_at_s >= _MOUNTS_MAX_AGE_S:
            self._partitions, self._partitions_at_s = filesystems_to_measure(), now
        for partition in self._partitions:
            # Bind mounts repeat a device; report it once, at its first mountpoint.
            if not is_real_filesystem(partition.fstype, partition.mountpoint) or partition.device in seen_devices:
                continue
            try:
                usage = psutil.disk_usage(partition.mountpoint)
            except OSError:
                continue  # unmounted or unreadable between listing and stat
            seen_devices.add(partition.device)
            attributes = {
                "system.device": partition.device,
                "system.filesystem.mountpoint": partition.mountpoint,
                "system.filesystem.type": partition.fstype,
            }
            reserved = max(0, usage.total - usage.used - usage.free)
            for state, value in (("used", usage.used), ("free", usage.free), ("reserved", reserved)):
                readings.add("system.filesystem.usage", value, {**attributes, "system.filesystem.state": state})
            readings.add("system.filesystem.limit", usage.total, attributes)
            readings.add("system.filesystem.utilization", usage.percent / 100.0, attributes)

    def _read_io(self, readings: Readings) -> None:
        counters = psutil.disk_io_counters(perdisk=True, nowrap=True) or {}
        for device, io in counters.items():
            if not is_physical_disk(device):
                continue
            for direction, nbytes, count in (
                ("read", io.read_bytes, io.read_count),
                ("write", io.write_bytes, io.write_count),
            ):
                attributes = {"system.device": device, "disk.io.direction": direction}
                readings.add("system.disk.io", nbytes, attributes)
                readings.add("system.disk.operations", count, attributes)
