"""A process's control group as the kernel shows it: which cgroup (``/proc/<pid>/cgroup`` and the
mount table), its limits (CPU quota, cpuset, memory), usage, throttling, OOM kills and pressure.

cgroup v2 (the unified hierarchy: one directory) and v1 (a directory per controller) are two
implementations of ``Cgroup``. A limit is the smallest one set on the cgroup or an ancestor visible
here (a Kubernetes pod's limit sits a level above its container's); a limit at least as large as
the machine is no limit. Files are read as the kernel writes them: a file that is absent (an older
kernel, a controller not enabled) gives no value, never an error.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from otel_forge.collectors.kernel_files import read_int, read_text

PRESSURE_RESOURCES = ("cpu", "memory", "io")
_Number = TypeVar("_Number", int, float)
_V1_UNLIMITED = 2**62  # v1 writes PAGE_COUNTER_MAX pages (about 2**63 bytes) for "no limit"


@dataclass(frozen=True)
class CgroupStats:
    """One read of a cgroup. CPU figures in CPUs and seconds; memory in bytes; None where absent."""

    cpu_quota: float | None = None  # CFS quota / period: CPUs' worth of time per period
    cpuset_cpus: int | None = None  # CPUs the cgroup may run on
    cpu_time_s: float | None = None  # CPU time of every process in it, ever
    periods: int | None = None  # CFS periods with runnable tasks
    throttled_periods: int | None = None
    throttled_s: float | None = None
    memory_usage: int | None = None  # page cache included
    memory_inactive_file: int | None = None  # reclaimable cache: usage minus this is the working set
    memory_limit: int | None = None
    oom_kills: int | None = None
    pressure: dict[tuple[str, str], float] = field(default_factory=dict)  # (resource, some|full) -> stall seconds

    @property
    def memory_working_set(self) -> int | None:
        """What the kernel cannot reclaim: usage minus inactive file pages (the kubelet's measure)."""
        if self.memory_usage is None:
            return None
        return max(0, self.memory_usage - (self.memory_inactive_file or 0))


class Cgroup(abc.ABC):
    """A cgroup's files; ``read`` reads them all once."""

    version: int

    def __init__(self, proc_root: Path) -> None:
        # The machine's pressure (/proc/pressure), where the cgroup has none of its own.
        self._machine_pressure = pressure_files(proc_root / "pressure")

    @abc.abstractmethod
    def read(self) -> CgroupStats:
        """Limits, usage, throttling, OOM kills and pressure, now."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where it is, for ``otel-forge doctor``."""


class MachineView(Cgroup):
    """No cgroup's limits: the machine as a node agent beside the jobs sees it (its own pod's
    limits are not a job's); only the machine's pressure."""

    def describe(self) -> str:
        return "the machine (OTEL_FORGE_CGROUP=machine)"

    def read(self) -> CgroupStats:
        return CgroupStats(pressure=_stalls(self._machine_pressure))


class CgroupV2(Cgroup):
    """The unified hierarchy: ``directory`` holds every controller's files; ``mount`` is its root.
    Every path is made once: a read is only the reads of the kernel's files."""

    version = 2

    def __init__(self, directory: Path, mount: Path, proc_root: Path = Path("/proc")) -> None:
        super().__init__(proc_root)
        self.directory = directory
        self._file = {name: str(directory / name) for name in _V2_FILES}
        above = list(_up_to(directory, mount))
        self._cpu_max = [str(d / "cpu.max") for d in above]
        self._memory_max = [str(d / "memory.max") for d in above]
        self._pressure = pressure_files(directory, suffix=".pressure")

    def describe(self) -> str:
        return f"cgroup v2 {self.directory}"

    def read(self) -> CgroupStats:
        cpu = _key_values(self._file["cpu.stat"])
        memory = _key_values(self._file["memory.stat"])
        events = _key_values(self._file["memory.events"])
        return CgroupStats(
            cpu_quota=_smallest(_cpu_max(path) for path in self._cpu_max),
            cpuset_cpus=_cpu_count(self._file["cpuset.cpus.effective"]),
            cpu_time_s=_scaled(cpu.get("usage_usec"), 1e-6),
            periods=cpu.get("nr_periods"),
            throttled_periods=cpu.get("nr_throttled"),
            throttled_s=_scaled(cpu.get("throttled_usec"), 1e-6),
            memory_usage=read_int(self._file["memory.current"]),
            memory_inactive_file=memory.get("inactive_file"),
            memory_limit=_smallest(read_int(path) for path in self._memory_max),
            oom_kills=events.get("oom_kill"),
            pressure=_stalls(self._pressure) or _stalls(self._machine_pressure),
        )


class CgroupV1(Cgroup):
    """One directory per controller (``cpu``, ``cpuacct``, ``cpuset``, ``memory``), each under its
    mount (``directories``: controller -> (directory, mount)); a controller not mounted is absent."""

    version = 1

    def __init__(self, directories: dict[str, tuple[Path, Path]], proc_root: Path = Path("/proc")) -> None:
        super().__init__(proc_root)
        self.directories = directories
        self._file = {
            name: str(directories[controller][0] / name) if controller in directories else None
            for controller, name in _V1_FILES
        }
        self._cfs = (
            [(str(d / "cpu.cfs_quota_us"), str(d / "cpu.cfs_period_us")) for d in _up_to(*directories["cpu"])]
            if "cpu" in directories
            else []
        )

    def describe(self) -> str:
        return "cgroup v1 " + ", ".join(f"{name} {path}" for name, (path, _) in sorted(self.directories.items()))

    def read(self) -> CgroupStats:
        cpu_stat = _key_values(self._file["cpu.stat"])
        memory_stat = _key_values(self._file["memory.stat"])
        limit = memory_stat.get("hierarchical_memory_limit")
        cpuset = _cpu_count(self._file["cpuset.effective_cpus"]) or _cpu_count(self._file["cpuset.cpus"])
        return CgroupStats(
            cpu_quota=_smallest(_cfs_quota(quota, period) for quota, period in self._cfs),
            cpuset_cpus=cpuset,
            cpu_time_s=_scaled(read_int(self._file["cpuacct.usage"]), 1e-9),
            periods=cpu_stat.get("nr_periods"),
            throttled_periods=cpu_stat.get("nr_throttled"),
            throttled_s=_scaled(cpu_stat.get("throttled_time"), 1e-9),
            memory_usage=read_int(self._file["memory.usage_in_bytes"]),
            memory_inactive_file=memory_stat.get("total_inactive_file"),
            memory_limit=limit if limit is not None and limit < _V1_UNLIMITED else None,
            oom_kills=_key_values(self._file["memory.oom_control"]).get("oom_kill"),
            pressure=_stalls(self._machine_pressure),
        )


_V2_FILES = ("cpu.stat", "memory.stat", "memory.events", "cpuset.cpus.effective", "memory.current")
# (controller, file) of what a v1 read takes.
_V1_FILES = (
    ("cpu", "cpu.stat"),
    ("cpuacct", "cpuacct.usage"),
    ("cpuset", "cpuset.effective_cpus"),
    ("cpuset", "cpuset.cpus"),
    ("memory", "memory.stat"),
    ("memory", "memory.usage_in_bytes"),
    ("memory", "memory.oom_control"),
)


def find_cgroup(pid: int | str = "self", proc_root: Path = Path("/proc"), root: Path = Path("/")) -> Cgroup | None:
    """The cgroup of process ``pid``, by its ``/proc/<pid>/cgroup`` and the mount table (whose
    mount points are under ``root``); None where no cgroup filesystem is mounted (or the process
    is gone)."""
    try:
        memberships = (proc_root / str(pid) / "cgroup").read_text().splitlines()
        mountinfo = (proc_root / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    mounts = [(root / str(point).lstrip("/"), within, options) for point, within, options in _cgroup_mounts(mountinfo)]
    v1: dict[str, tuple[Path, Path]] = {}
    unified: str | None = None
    for line in memberships:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            unified = path
            continue
        for controller in controllers.split(","):
            for mount_point, within, options in mounts:
                if options is not None and controller in options:
                    v1[controller] = (_inside(mount_point, within, path), mount_point)
    wanted = {"cpu", "cpuacct", "cpuset", "memory"}
    if v1.keys() & wanted:
        return CgroupV1({name: where for name, where in v1.items() if name in wanted}, proc_root)
    for mount_point, within, options in mounts:
        if options is None and unified is not None:
            return CgroupV2(_inside(mount_point, within, unified), mount_point, proc_root)
    return None


def pressure_files(directory: Path, suffix: str = "") -> list[tuple[str, str]]:
    """(resource, path) of PSI's files: ``<resource><suffix>`` in ``directory``."""
    return [(resource, str(directory / f"{resource}{suffix}")) for resource in PRESSURE_RESOURCES]


def read_pressure(directory: Path, suffix: str = "") -> dict[tuple[str, str], float]:
    """PSI's stall time per (resource, ``some``/``full``), in seconds, from ``<resource><suffix>``
    files (``some avg10=0.00 avg60=0.00 avg300=0.00 total=12345``: ``total`` in microseconds)."""
    return _stalls(pressure_files(directory, suffix))


def _stalls(files: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    stalls: dict[tuple[str, str], float] = {}
    for resource, path in files:
        for line in (read_text(path) or "").splitlines():
            scope, *fields = line.split()
            totals = [f.removeprefix("total=") for f in fields if f.startswith("total=")]
            if scope in ("some", "full") and totals and totals[0].isdigit():
                stalls[(resource, scope)] = int(totals[0]) / 1e6
    return stalls


def parse_cpu_list(text: str) -> int | None:
    """The number of CPUs in a kernel CPU list (``0-3,8,10-11`` -> 7); None for an empty one."""
    count = 0
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            count += int(last or first) - int(first) + 1
        except ValueError:
            return None
    return count or None


# --- the mount table -------------------------------------------------------------------------


def _cgroup_mounts(mountinfo: list[str]) -> Iterator[tuple[Path, str, set[str] | None]]:
    """(mount point, root within the hierarchy, v1 controllers or None for v2) of each cgroup mount."""
    for line in mountinfo:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, super_options = tail[0], tail[2].split(",")
        mount_point = Path(_unescape(fields[4]))
        if fstype == "cgroup2":
            yield mount_point, _unescape(fields[3]), None
        elif fstype == "cgroup":
            yield mount_point, _unescape(fields[3]), set(super_options)


def _unescape(text: str) -> str:
    """The mount table writes a space as ``\\040`` (and tab, newline, backslash likewise)."""
    return text.encode().decode("unicode_escape") if "\\" in text else text


def _inside(mount_point: Path, root: str, path: str) -> Path:
    """The directory of cgroup ``path`` under a mount of the hierarchy's ``root`` (a container sees
    its own cgroup as ``/``, or the host's path under a mount rooted at it)."""
    relative = path[len(root) :] if root != "/" and (path == root or path.startswith(root + "/")) else path
    return mount_point / relative.lstrip("/")


def _up_to(directory: Path, mount: Path) -> Iterator[Path]:
    """``directory`` and its ancestors up to ``mount``, the root of what this process can see."""
    current = directory
    while True:
        yield current
        if current == mount or mount not in current.parents:
            return
        current = current.parent


# --- the kernel's file formats ---------------------------------------------------------------


def _key_values(path: str | None) -> dict[str, int]:
    """A flat-keyed file (``cpu.stat``, ``memory.stat``, ``memory.events``): ``key value`` lines."""
    values: dict[str, int] = {}
    for line in (read_text(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            values[key] = int(value)
    return values


def _cpu_max(path: str) -> float | None:
    """v2's ``cpu.max``: ``$MAX $PERIOD`` (``max 100000``: no quota)."""
    quota, _, period = (read_text(path) or "").strip().partition(" ")
    if not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


def _cfs_quota(quota_path: str, period_path: str) -> float | None:
    """v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (a quota of -1: none)."""
    quota, period = read_int(quota_path), read_int(period_path)
    if quota is None or quota <= 0 or not period:
        return None
    return quota / period


def _cpu_count(path: str | None) -> int | None:
    text = read_text(path)
    return parse_cpu_list(text) if text is not None else None


def _smallest(values: Iterable[_Number | None]) -> _Number | None:
    present = [value for value in values if value is not None]
    return min(present) if present else None


def _scaled(value: int | None, scale: float) -> float | None:
    return value * scale if value is not None else None
