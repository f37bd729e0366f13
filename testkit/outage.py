"""A tracking server down at a job's start, as the fault test and ``bench.outage_start`` both run it.

A training job (``TrainingJob``: a process group of its own, output in files) logs ``rate`` values a
second, 100 a ``log()`` call, into a server whose port refuses connections; ``down_s`` after its
first value the server starts (an ``MlflowServer``, sqlite, one worker, on that port), and the job
logs on ``after_s`` more once it answers (``catch_up``: once the run has caught up with it, holding
all but the last ``LIVE_LAG_S`` of its values), then leaves its ``with`` block. Measured: what was logged
(and dropped), the journal's size when the server came up (its largest), when the backlog (what was
logged before the server answered) was in the run, when the last value was, what the run holds at
the end (from the server's database: each (key, step) once?) and its status.

Progress is read from the server's sqlite database, read-only: the latest step of the last key of a
``log()`` call (``latest_metrics``, one row) says how many calls' values are in, since the delivery
sends them in order; a REST read of a growing history, every poll, would load the server measured.
"""

from __future__ import annotations

import contextlib
import sqlite3
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from testkit.mlflow_server import MlflowServer
from testkit.training_job import TrainingJob

WIDTH = 100  # values a log() call
LIVE_LAG_S = 2.0  # a run that lags its job by no more than this much logging has caught up with it

# Logs RATE values a second, WIDTH a call, from its first value until the file STOP exists, printing
# "step N REJECTED" once each log() returned; "logged" after the last, "exited" after the block.
JOB = """
import os, time
from otel_forge import TrainingRun
values = lambda step: {{f"v{{i}}": step + i / 1000 for i in range({width})}}
with TrainingRun(config={{"lr": 0.25}}, tracking_uri={uri!r}, experiment={experiment!r},
                 system_metrics=False) as run:
    print("entered", flush=True)
    began, step = time.monotonic(), 0
    while not os.path.exists({stop!r}):
        run.log(values(step), step=step)
        print("step", step, run.rejected, flush=True)
        step += 1
        time.sleep(max(began + step * {width} / {rate} - time.monotonic(), 0))
    print("logged", step, run.rejected, flush=True)
print("exited", run.rejected, flush=True)
"""


@dataclass
class OutageResult:
    rate: float  # values a second the job logged
    down_s: float  # from the job's first value to the server's first answer
    after_s: float  # the job logged on this long once the server answered (catch_up: once the run caught up)
    logged: int  # values whose log() reported no drop
    dropped: int  # values log() reported dropped
    backlog: int  # values logged before the server answered
    journal_bytes: int  # the journal's size when the server answered
    journal_max_bytes: int  # its largest (it keeps every value until the run's end is delivered)
    backlog_in_s: float | None  # from the server's answer to the backlog in the run (None: never)
    caught_up_s: float | None  # from the server's answer to the run lagging the job by LIVE_LAG_S at most
    last_in_s: float | None  # from the job's last log() to its last value in the run (None: never)
    close_s: float  # from the job's last log() to its leaving the block
    in_mlflow: int  # metric values the run holds
    repeated: int  # (key, step) pairs the run holds more than once
    status: str | None  # the run's, at the end
    exit_code: int | None
    stderr: str
    kept_steps: list[int]  # the steps whose log() dropped nothing


def run_outage(
    root: Path, *, down_s: float, rate: float, after_s: float, catch_up: bool = False, end_wait_s: float = 120.0,
    catch_up_wait_s: float = 3600.0,
) -> OutageResult:  # fmt: skip
    """The scenario in the module's docstring, in ``root`` (the server's database, the job's spool
    and output); its own server and job, both killed (their process groups) on the way out.
    ``catch_up``: the job logs on until the run has caught up with it (``catch_up_wait_s`` at most),
    then ``after_s`` more."""
    (root / "server").mkdir(parents=True, exist_ok=True)
    server = MlflowServer(root / "server")
    experiment, spool, stop = f"outage-{uuid.uuid4().hex[:10]}", root / "spool", root / "stop"
    code = JOB.format(uri=server.uri, experiment=experiment, width=WIDTH, rate=rate, stop=str(stop))
    job = TrainingJob(textwrap.dedent(code), root / "job", {"OTEL_FORGE_SPOOL_DIR": str(spool)})
    try:
        job.start()
        job.wait_line("entered", 120)
        first_value_at = time.monotonic()
        while time.monotonic() < first_value_at + down_s:
            time.sleep(0.2)
        server.start()
        up_at = time.monotonic()
        backlog = _steps(job) * WIDTH
        journal_bytes = journal_max_bytes = _journal_bytes(spool)
        progress = _Progress(server.db, experiment)
        backlog_in_at = caught_up_at = None
        stop_at = up_at + (catch_up_wait_s if catch_up else after_s)
        while time.monotonic() < stop_at:
            logged, delivered, now = _steps(job) * WIDTH, progress.values(), time.monotonic()
            journal_max_bytes = max(journal_max_bytes, _journal_bytes(spool))
            if backlog_in_at is None and delivered >= backlog:
                backlog_in_at = now
            if caught_up_at is None and logged - delivered <= LIVE_LAG_S * rate:
                caught_up_at = now
                stop_at = min(stop_at, caught_up_at + after_s) if catch_up else stop_at
            time.sleep(0.25)
        stop.touch()
        last_step = int(job.wait_line("logged", 60).split()[1]) - 1
        journal_max_bytes = max(journal_max_bytes, _journal_bytes(spool))
        stopped_at = time.monotonic()
        exit_code = job.wait(end_wait_s)
        close_s = time.monotonic() - stopped_at
        last_in_at = None
        deadline = time.monotonic() + end_wait_s
        while time.monotonic() < deadline:
            if backlog_in_at is None and progress.values() >= backlog:
                backlog_in_at = time.monotonic()
            if progress.values() >= (last_step + 1) * WIDTH:
                last_in_at = time.monotonic()
                break
            time.sleep(0.25)
        status = progress.wait_ended(deadline)
        in_mlflow, repeated = progress.counts()
    finally:
        job.kill_group()
        server.kill()
    logged_steps = _logged(job)
    kept = [step for step, so_far in sorted(logged_steps.items()) if so_far == logged_steps.get(step - 1, 0)]
    dropped = max(logged_steps.values(), default=0)
    return OutageResult(
        rate=rate, down_s=up_at - first_value_at, after_s=after_s, logged=len(kept) * WIDTH, dropped=dropped,
        backlog=backlog, journal_bytes=journal_bytes, journal_max_bytes=journal_max_bytes,
        backlog_in_s=None if backlog_in_at is None else max(backlog_in_at - up_at, 0.0),
        caught_up_s=None if caught_up_at is None else max(caught_up_at - up_at, 0.0),
        last_in_s=None if last_in_at is None else max(last_in_at - stopped_at, 0.0), close_s=close_s,
        in_mlflow=in_mlflow, repeated=repeated, status=status, exit_code=exit_code, stderr=job.stderr(),
        kept_steps=kept,
    )  # fmt: skip


def _journal_bytes(spool: Path) -> int:
    total = 0
    for path in spool.glob("journal-*/journal.log"):
        with contextlib.suppress(OSError):  # delivered whole, and removed, meanwhile
            total += path.stat().st_size
    return total


def _steps(job: TrainingJob) -> int:
    return sum(1 for line in job.lines() if line.startswith("step "))


def _logged(job: TrainingJob) -> dict[int, int]:
    """step -> values dropped so far."""
    return {int(p[1]): int(p[2]) for p in (line.split() for line in job.lines()) if p and p[0] == "step"}


class _Progress:
    """What the run holds, read from the server's database (read-only, one short query a poll)."""

    def __init__(self, db: Path, experiment: str) -> None:
        self._db = db
        self._experiment = experiment
        self._run: str | None = None

    def _query(self, sql: str, *args: object) -> list[tuple]:
        with contextlib.closing(sqlite3.connect(f"file:{self._db}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute(sql, args).fetchall()

    def _run_uuid(self) -> str | None:
        if self._run is None:
            with contextlib.suppress(sqlite3.Error):
                found = self._query(
                    "SELECT r.run_uuid FROM runs r JOIN experiments e ON r.experiment_id = e.experiment_id "
                    "WHERE e.name = ?",
                    self._experiment,
                )
                self._run = found[0][0] if len(found) == 1 else None
        return self._run

    def values(self) -> int:
        """Values in the run, counted by whole ``log()`` calls (delivered in order)."""
        run = self._run_uuid()
        if run is None:
            return 0
        try:
            found = self._query("SELECT step FROM latest_metrics WHERE run_uuid = ? AND key = ?", run, f"v{WIDTH - 1}")
        except sqlite3.Error:
            return 0
        return (found[0][0] + 1) * WIDTH if found else 0

    def wait_ended(self, deadline: float) -> str | None:
        status = None
        while time.monotonic() < deadline:
            run = self._run_uuid()
            with contextlib.suppress(sqlite3.Error):
                status = self._query("SELECT status FROM runs WHERE run_uuid = ?", run)[0][0] if run else None
            if status not in (None, "RUNNING"):
                return status
            time.sleep(0.25)
        return status

    def counts(self) -> tuple[int, int]:
        """The values the run holds, and the (key, step) pairs it holds more than once."""
        run = self._run_uuid()
        if run is None:
            return 0, 0
        total = self._query("SELECT count(*) FROM metrics WHERE run_uuid = ?", run)[0][0]
        repeated = self._query(
            "SELECT count(*) FROM (SELECT 1 FROM metrics WHERE run_uuid = ? GROUP BY key, step HAVING count(*) > 1)",
            run,
        )[0][0]
        return total, repeated
