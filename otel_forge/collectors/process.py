"""The monitored process trees (each a root pid and its descendants): CPU, memory, threads, fds."""

from __future__ import annotations

import os
import time

import psutil

from otel_forge.collectors.base import CollectorUnavailable, HardwareCollector, Readings
from otel_forge.config import PID_NOT_STARTED, ForgeConfig
from otel_forge.names import PROCESS_PID


class ProcessTree:
    """A root process and its descendants, found anew at each ``processes()`` call.

    Descendants come from ``/proc/<pid>/task/<tid>/children``, which touches only this tree
    (psutil's ``children()`` reads every process of the machine). ``psutil.Process`` objects are
    kept by pid across calls; a process that exits between listing and reading is skipped.
    """

    def __init__(self, pid: int) -> None:
        try:
            self.root = psutil.Process(pid)
        except psutil.Error as error:
            raise CollectorUnavailable(f"process {pid}: {error}") from None
        self.pid = pid
        self._known = {pid: self.root}
        self._has_children_files = os.path.exists(f"/proc/{pid}/task/{pid}/children")

    def pids(self) -> set[int]:
        if not self.root.is_running():
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


class MonitoredProcesses:
    """The monitored process trees, by root pid: one (``otel-forge run``'s CMD, the training process),
    none until it runs, or one per training process the node's companion samples for. Each tree is
    read and reported apart (``process.pid``: its root). Replaced whole on each change: a read on the
    agent's thread sees one set or the other."""

    def __init__(self, pid: int | None) -> None:
        """``pid`` None: the process is not started yet, and no tree is read until ``follow``."""
        self.trees: dict[int, ProcessTree] = {}
        if pid is not None:
            self.follow(pid)

    @classmethod
    def for_config(cls, config: ForgeConfig) -> MonitoredProcesses:
        return cls(None if config.pid == PID_NOT_STARTED else config.pid or os.getpid())

    def follow(self, pid: int) -> None:
        """The one tree rooted at ``pid`` from now on."""
        self.trees = {pid: ProcessTree(pid)}

    def add(self, pid: int) -> None:
        """The tree rooted at ``pid`` besides the others."""
        self.trees = {**self.trees, pid: ProcessTree(pid)}

    def remove(self, pid: int) -> None:
        self.trees = {root: tree for root, tree in self.trees.items() if root != pid}

    def pids(self) -> dict[int, set[int]]:
        """Each tree's pids, by its root."""
        return {root: tree.pids() for root, tree in self.trees.items()}


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
    """Sums over each tree; CPU utilization is the CPU-time delta over real elapsed time."""

    name = "process"

    def __init__(self, processes: MonitoredProcesses) -> None:
        self._processes = processes
        self._logical_cpus = psutil.cpu_count() or 1
        self._previous: dict[int, tuple[float, float]] = {}  # root: (CPU s, monotonic s) at its last read
        for root, tree in processes.trees.items():
            self._prime(root, tree)

    @classmethod
    def create(cls, config: ForgeConfig) -> ProcessCollector:
        return cls(MonitoredProcesses.for_config(config))

    def _prime(self, root: int, tree: ProcessTree) -> None:
        # The first utilization then covers real time since the tree was first followed.
        self._previous[root] = (self._cpu_seconds(tree.processes()), time.monotonic())

    def follow_process(self, pid: int) -> None:
        self._processes.follow(pid)
        self._previous = {}
        self._prime(pid, self._processes.trees[pid])

    def add_process(self, pid: int) -> None:
        self._processes.add(pid)
        self._prime(pid, self._processes.trees[pid])

    def remove_process(self, pid: int) -> None:
        self._processes.remove(pid)
        self._previous.pop(pid, None)

    def read(self, readings: Readings) -> None:
        for root, tree in self._processes.trees.items():
            self._read_tree(root, tree.processes(), readings)

    def _read_tree(self, root: int, processes: list[psutil.Process], readings: Readings) -> None:
        if not processes:
            return  # exited (e.g. `otel-forge run`'s command ended)
        attributes = {PROCESS_PID: root}
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
        previous_cpu_s, previous_at_s = self._previous.get(root, (cpu_s, now))
        elapsed = now - previous_at_s
        if elapsed > 0 and cpu_s >= previous_cpu_s:
            readings.add("process.cpu.utilization", (cpu_s - previous_cpu_s) / elapsed / self._logical_cpus, attributes)
        self._previous[root] = (cpu_s, now)
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
