"""The job's control group: CPU and memory against the limits the job runs under (a container's,
a Kubernetes pod's, a SLURM job's cpuset), throttling, OOM kills, and pressure (PSI).

The cgroup is the monitored process's (``--pid``, ``otel-forge run``'s command), else this
process's. Where the cgroup has a CPU or memory limit smaller than the machine, ``container.*``
series report usage against it, and MLflow's ``cpu_utilization_percentage`` and
``system_memory_*`` keys mean what the job can use (the host's keep names of their own:
``names.METRICS``). Where it has none, nothing but pressure is reported: the machine reads as it
does without containers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from otel_forge.collectors.base import CollectorUnavailable, HardwareCollector, Readings
from otel_forge.collectors.cgroup_fs import Cgroup, CgroupStats, MachineView, find_cgroup
from otel_forge.config import PID_NOT_STARTED, ForgeConfig

_PROC = Path("/proc")


class CgroupCollector(HardwareCollector):
    """One read of the cgroup's files per read; CPU usage is the delta of its CPU time."""

    name = "cgroup"

    def __init__(self, cgroup: Cgroup, host_cpus: int | None = None, host_memory: int | None = None) -> None:
        self._cgroup = cgroup
        self._host_cpus = host_cpus or os.cpu_count() or 1
        self._host_memory = host_memory or psutil.virtual_memory().total
        # (monotonic s, CPU time s) of the last read; primed so the first usage covers real time.
        self._previous = self._cpu_time()

    @classmethod
    def create(cls, config: ForgeConfig) -> CgroupCollector:
        if config.cgroup == "machine":
            return cls(MachineView(_PROC))
        pid = None if config.pid == PID_NOT_STARTED else config.pid
        return cls(_cgroup_of(pid or "self"))

    def follow_process(self, pid: int) -> None:
        if isinstance(self._cgroup, MachineView):
            return
        try:
            self._cgroup = _cgroup_of(pid)
            self._previous = self._cpu_time()
        except CollectorUnavailable:
            pass  # gone already: its cgroup is ours (CMD inherits it), read on

    def describe(self) -> list[str]:
        stats = self._cgroup.read()
        cpus, memory = self._cpu_limit(stats), self._memory_limit(stats)
        return [
            f"{self._cgroup.describe()}: CPU limit {f'{cpus:g} CPUs' if cpus else 'none'}, memory limit "
            f"{f'{memory / 2**30:.1f} GiB' if memory else 'none'}, pressure {'yes' if stats.pressure else 'no'}"
        ]

    def _cpu_time(self) -> tuple[float, float] | None:
        cpu_time_s = self._cgroup.read().cpu_time_s
        return (time.monotonic(), cpu_time_s) if cpu_time_s is not None else None

    def read(self, readings: Readings) -> None:
        stats, now = self._cgroup.read(), time.monotonic()
        self._read_cpu(readings, stats, now)
        self._read_memory(readings, stats)
        for (resource, scope), seconds in stats.pressure.items():
            readings.add(
                "otel_forge.pressure.stall.time",
                seconds,
                {"otel_forge.pressure.resource": resource, "otel_forge.pressure.scope": scope},
            )

    def _cpu_limit(self, stats: CgroupStats) -> float | None:
        limits = [limit for limit in (stats.cpu_quota, stats.cpuset_cpus) if limit is not None]
        limit = min(limits) if limits else None
        return limit if limit is not None and limit < self._host_cpus else None

    def _memory_limit(self, stats: CgroupStats) -> int | None:
        limit = stats.memory_limit
        return limit if limit is not None and limit < self._host_memory else None

    def _read_cpu(self, readings: Readings, stats: CgroupStats, now: float) -> None:
        limit = self._cpu_limit(stats)
        previous = self._previous
        self._previous = (now, stats.cpu_time_s) if stats.cpu_time_s is not None else None
        if limit is None or stats.cpu_time_s is None:
            return
        readings.add("otel_forge.container.cpu.limit", limit)
        readings.add("container.cpu.time", stats.cpu_time_s)
        if previous is not None and now > previous[0]:
            used = max(0.0, stats.cpu_time_s - previous[1]) / (now - previous[0])
            readings.add("container.cpu.usage", used)
            readings.add("otel_forge.container.cpu.utilization", used / limit)
        readings.add("otel_forge.container.cpu.periods", stats.periods)
        readings.add("otel_forge.container.cpu.throttled_periods", stats.throttled_periods)
        readings.add("otel_forge.container.cpu.throttled_time", stats.throttled_s)

    def _read_memory(self, readings: Readings, stats: CgroupStats) -> None:
        limit = self._memory_limit(stats)
        if limit is None or stats.memory_working_set is None:
            return
        readings.add("otel_forge.container.memory.limit", limit)
        readings.add("container.memory.usage", stats.memory_usage)
        readings.add("container.memory.working_set", stats.memory_working_set)
        readings.add("otel_forge.container.memory.utilization", stats.memory_working_set / limit)
        readings.add("otel_forge.container.memory.oom_kills", stats.oom_kills)


def _cgroup_of(pid: int | str, proc_root: Path = _PROC) -> Cgroup:
    cgroup = find_cgroup(pid, proc_root)
    if cgroup is None:
        raise CollectorUnavailable(f"no cgroup filesystem for process {pid} ({proc_root}/{pid}/cgroup)")
    return cgroup
