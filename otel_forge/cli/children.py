"""CMD's processes under ``otel-forge run``: none outlives the run, whatever happens to us.

Linux process controls, each a no-op elsewhere: we are CMD's *child subreaper* (its orphans become
our children, so we can stop them before the run ends); CMD gets SIGTERM when we die (a parent
death signal), even by SIGKILL; and a small watchdog process ends the run KILLED if we die before
ending it ourselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Collection

import psutil

from otel_forge.config import env_name
from otel_forge.node import NodeIdentity
from otel_forge.scrub import scrub

_logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE_S = 3.0  # then SIGKILL: part of the 20 s a SIGTERM leaves us


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


def become_subreaper() -> None:
    """Orphans of CMD become our children, so none outlives the run unnoticed."""
    if (prctl := _prctl()) is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def dies_with_us() -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child SIGTERM when this process dies, however it dies."""
    if (prctl := _prctl()) is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # we died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def stop_leftovers(keep: Collection[int] = (), grace_s: float = 0.0) -> None:
    """What CMD left running ``grace_s`` after it exited (a rank still exiting is not left over):
    named, SIGTERMed, SIGKILLed after a grace period of its own, and reaped."""
    # git is ours: the run's metadata is read on the delivery worker.
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in keep and _name(p) != "git"]
    _, left = psutil.wait_procs(left, timeout=grace_s) if left and grace_s > 0 else ([], left)
    if not left:
        return
    _logger.warning(
        "CMD left %d process(es) running %g s after it exited, stopping them before the run ends: %s",
        len(left),
        grace_s,
        "; ".join(f"pid {p.pid} ({_command_line(p)})" for p in left),
    )
    for process in left:
        _signal(process, signal.SIGTERM)
    _, alive = psutil.wait_procs(left, timeout=LEFTOVER_GRACE_S)
    for process in alive:
        _signal(process, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=1.0)


def _command_line(process: psutil.Process, most: int = 160) -> str:
    try:
        line = shlex.join(process.cmdline()) or _name(process)
    except psutil.Error:
        return "exited"
    return scrub(line if len(line) <= most else line[: most - 3] + "...")


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def _signal(process: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        process.send_signal(sig)


class Watchdog:
    """A small process (stdlib only until needed) that ends the run if we cannot.

    It waits on a pipe whose write end only we hold. ``disarm()``: we ended the run, it exits.
    ``hand_over(status)``: we could not (the server did not answer in time), it ends the run with
    ``status`` once the server answers. End of file with neither: we died (SIGKILL, OOM), it ends
    the run KILLED. In a session of its own, so a signal to our process group does not reach it.
    """

    def __init__(
        self, run_id: str, tracking_uri: str, experiment_id: str | None, node: NodeIdentity, environ: dict[str, str]
    ) -> None:
        read_end, self._write_end = os.pipe()
        command = [
            sys.executable,
            "-m",
            "otel_forge.cli.watchdog",
            str(read_end),
            run_id,
            experiment_id or "",
            json.dumps(dataclasses.asdict(node)),
        ]
        # The tracking URI may hold credentials: in the environment, never on a command line.
        self.process = subprocess.Popen(
            command,
            pass_fds=(read_end,),
            start_new_session=True,
            env={**environ, env_name("tracking_uri"): tracking_uri},
            stdin=subprocess.DEVNULL,
        )
        os.close(read_end)

    @property
    def pid(self) -> int:
        return self.process.pid

    def disarm(self) -> None:
        """We ended the run ourselves: the watchdog exits without touching it."""
        self._say(b"ended\n")
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def hand_over(self, status: str, worker: str | None = None) -> None:
        """We could not end the run: the watchdog ends it with ``status`` when the server answers
        (``worker``: CMD was a launcher, and that worker ended the job)."""
        self._say(f"end {status}{' ' + worker if worker else ''}\n".encode())
        _logger.info(
            "the run could not be ended now; a watchdog (pid %d) ends it %s once the tracking server answers",
            self.pid,
            status,
        )

    def _say(self, message: bytes) -> None:
        try:
            os.write(self._write_end, message)
            os.close(self._write_end)
        except OSError:
            pass
