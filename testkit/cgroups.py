"""Real cgroup v1 groups for tests, made by root where the machine lets it (``v1_writable``).

``V1Cgroup(controllers)`` makes a fresh group in each controller's hierarchy (``/sys/fs/cgroup/<c>/
otel-forge-test-<id>``); ``limit_cpu`` and ``limit_memory`` set its CFS quota and memory limit;
``joining(command)`` is ``command`` started inside it (a shell joins, then execs it); ``remove``
takes the groups away once their processes are gone. ``limited_job`` is a busy process holding memory
in such a group (a training job in its container); ``oom_kill_in`` gets one of its processes
OOM-killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup")


def v1_writable(*controllers: str) -> bool:
    return os.geteuid() == 0 and all(os.access(V1_ROOT / c, os.W_OK) for c in controllers)


class V1Cgroup:
    def __init__(self, controllers: Sequence[str]) -> None:
        name = f"otel-forge-test-{uuid.uuid4().hex[:8]}"
        self.directories = {c: V1_ROOT / c / name for c in controllers}
        for directory in self.directories.values():
            directory.mkdir()

    def limit_cpu(self, cpus: float, period_us: int = 100_000) -> None:
        (self.directories["cpu"] / "cpu.cfs_period_us").write_text(str(period_us))
        (self.directories["cpu"] / "cpu.cfs_quota_us").write_text(str(int(cpus * period_us)))

    def limit_memory(self, limit_bytes: int) -> None:
        (self.directories["memory"] / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def joining(self, command: Sequence[str]) -> list[str]:
        joins = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in self.directories.values())
        return ["sh", "-c", f'{joins}; exec "$@"', "sh", *command]

    def remove(self) -> None:
        for directory in self.directories.values():
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # its last process is still exiting


# A job in its cgroup: it holds HOLD bytes of memory, says so, then keeps a CPU busy.
_JOB = """
import sys, time
block = bytearray({hold})
for i in range(0, len(block), 4096):
    block[i] = 1
print("holding", flush=True)
while True:
    pass
"""
# A process the OOM killer takes first (oom_score_adj 1000) once it grows past the cgroup's limit.
_HOG = """
with open("/proc/self/oom_score_adj", "w") as adj:
    adj.write("1000")
blocks = []
while True:
    blocks.append(bytearray(16 * 2**20))
"""

CONTROLLERS = ("cpu", "cpuacct", "memory")


@contextlib.contextmanager
def limited_job(cpus: float, memory_bytes: int, hold_bytes: int) -> Iterator[tuple[V1Cgroup, subprocess.Popen[str]]]:
    """A busy process holding ``hold_bytes`` in a cgroup limited to ``cpus`` and ``memory_bytes``."""
    cgroup = V1Cgroup(CONTROLLERS)
    try:
        cgroup.limit_cpu(cpus)
        cgroup.limit_memory(memory_bytes)
        job = subprocess.Popen(
            cgroup.joining([sys.executable, "-c", _JOB.format(hold=hold_bytes)]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert job.stdout is not None and job.stdout.readline().strip() == "holding", "the job did not start"
            yield cgroup, job
        finally:
            job.kill()
            job.wait()
    finally:
        cgroup.remove()


def oom_kill_in(cgroup: V1Cgroup, timeout_s: float = 60.0) -> None:
    """Start a process in ``cgroup`` that grows until the OOM killer ends it (SIGKILL)."""
    hog = subprocess.run(cgroup.joining([sys.executable, "-c", _HOG]), timeout=timeout_s, check=False)
    assert hog.returncode == -signal.SIGKILL, f"the hog was not OOM-killed (exit {hog.returncode})"
