"""The monitored process tree (a root pid and its descendants): CPU, memory, threads, fds."""

from __future__ import annotations

import os
import time

import psutil

from otel_forge.collectors.base import CollectorUnavailable, HardwareCollector, Readings
from otel_forge.config import PID_NOT_STARTED, ForgeConfig


class ProcessTree:
    """A root process and its descendants, found anew at each ``processes()`` call.

    Descendants come from ``/proc/<pid>/task/<tid>/children``, which touches only this tree
    (psutil's ``children()`` reads every process of the machine). ``psutil.Process`` objects are
    kept by pid across calls; a process that exits between listing and reading is skipped.
    """

    def __init__(self, pid: int | None) -> None:
        """``pid`` None: the process is not started yet, and the tree is empty until ``follow``."""
        self.pid: int | None = None
        self._known: dict[int, psutil.Process] = {}
        if pid is not None:
            self.follow(pid)

    @classmethod
    def for_config(cls, config: ForgeConfig) -> ProcessTree:
        return cls(None if config.pid == PID_NOT_STARTED else config.pid or os.getpid())

    def follow(self, pid: int) -> None:
        """Root the tree at ``pid`` from now on."""
        try:
            root = psutil.Process(pid)
        except psutil.Error as error:
            raise CollectorUnavailable(f"process {pid}: {error}") from None
        self._has_children_files = os.path.exists(f"/proc/{pid}/task/{pid}/children")
        self.root, self._known = root, {pid: root}
        self.pid = pid  # last: a read on the agent's thread sees a whole tree or none

    def pids(self) -> set[int]:
        if self.pid is None or not self.root.is_running():
            return set()
        if not self._has_children_files:
            try:
                return {self.pid, *(child.pid for child in self.root.children(recursive=True))}
            except psutil.Error:
                return {self.pid}
        found, pending = set(), [self.pid]
        while pending:
            pid = pending.pop()
            if pid not in found:
                found.add(pid)
                pending.extend(_children_of(pid))
        return found

    def processes(self) -> list[psutil.Process]:
        pids = self.pids()
        for gone in self._known.keys() - pids:
            del self._known[gone]
        for pid in pids - self._known.keys():
            try:
                self._known[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
        return list(self._known.values()) if pids else []


def _children_of(pid: int) -> list[int]:
    children: list[int] = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task.name}/children") as file:
                children.extend(int(child) for child in file.read().split())
    except OSError:
        pass  # the process exited while we looked
    return children


class ProcessCollector(HardwareCollector):
    """Sums over the tree; CPU utilization is the CPU-time delta over real elapsed time."""

    name = "process"

    def __init__(self, tree: ProcessTree) -> None:
        self._tree = tree
        self._logical_cpus = psutil.cpu_count() or 1
        # Primed so the first utilization covers real time since start.
        self._previous_cpu_s, self._previous_at_s = self._cpu_seconds(self._tree.processes()), time.monotonic()

    @classmethod
    def create(cls, config: ForgeConfig) -> ProcessCollector:
        return cls(ProcessTree.for_config(config))

    def follow_process(self, pid: int) -> None:
        self._tree.follow(pid)
        self._previous_cpu_s, self._previous_at_s = self._cpu_seconds(self._tree.processes()), time.monotonic()

    def read(self, readings: Readings) -> None:
        pid, processes = self._tree.pid, self._tree.processes()
        if pid is None or not processes:
            return  # not started yet, or exited (e.g. `otel-forge run`'s command ended)
        attributes = {"process.pid": pid}
        totals = {"rss": 0, "vms": 0, "threads": 0, "fds": 0, "user": 0.0, "system": 0.0}
        counted = 0
        for process in processes:
            try:
                with process.oneshot():
                    memory = process.memory_info()
                    cpu = process.cpu_times()
                    totals["rss"] += memory.rss
                    totals["vms"] += memory.vms
                    totals["threads"] += process.num_threads()
                    totals["fds"] += process.num_fds()
                    totals["user"] += cpu.user + cpu.children_user
                    totals["system"] += cpu.system + cpu.children_system
                counted += 1
            except psutil.Error:
                continue  # exited or became unreadable during the read
        now = time.monotonic()
        cpu_s = totals["user"] + totals["system"]
        elapsed = now - self._previous_at_s
        if elapsed > 0 and cpu_s >= self._previous_cpu_s:
            readings.add(
                "process.cpu.utilization", (cpu_s - self._previous_cpu_s) / elapsed / self._logical_cpus, attributes
            )
        self._previous_cpu_s, self._previous_at_s = cpu_s, now
        readings.add("process.cpu.time", totals["user"], {**attributes, "cpu.mode": "user"})
        readings.add("process.cpu.time", totals["system"], {**attributes, "cpu.mode": "system"})
        readings.add("process.memory.usage", totals["rss"], attributes)
        readings.add("process.memory.virtual", totals["vms"], attributes)
        readings.add("process.thread.count", totals["threads"], attributes)
        readings.add("process.unix.file_descriptor.count", totals["fds"], attributes)
        readings.add("otel_forge.process.count", counted, attributes)

    @staticmethod
    def _cpu_seconds(processes: list[psutil.Process]) -> float:
        total = 0.0
        for process in processes:
            try:
                cpu = process.cpu_times()
            except psutil.Error:
                continue
            total += cpu.user + cpu.system + cpu.children_user + cpu.children_system
        return total
