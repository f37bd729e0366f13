"""``otel-forge run -- torchrun --nproc-per-node 2 ...``: a real two-rank job (gloo, CPU, a tiny model,
tests/progress/scripts/ddp_job.py, which knows nothing of otel-forge) watched through the rank hook
otel-forge hands its Python processes, against the session's real ``mlflow server``.

A rank that blocks in a function of its own is named as the stall's cause (stderr, tags, its stacks
as an artifact, the Prometheus series on otel-forge's own /metrics); a long checkpoint is no stall and
goodput counts it as checkpointing, and the productive time as the job's own clock measured it; a
rank 30 % slower than its peer is named the slow rank. The floors are small (``OTEL_FORGE_STALL_FLOOR``)
to keep each launch well under two minutes."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import the_run, unique
from prometheus_client.parser import text_string_to_metric_families

from testkit.hermetic import apply_hermetic, hermetic_environ
from testkit.servers import free_port

FORGE = [sys.executable, "-m", "otel_forge.cli"]
JOB = Path(__file__).resolve().parent / "scripts" / "ddp_job.py"
RANK_LABEL = "otel_forge_training_rank"
STALL_LINE = "otel-forge: training stalled"
SERVING = re.compile(r"otel-forge: serving prometheus (http://\S+/metrics)")
LAUNCH_TIMEOUT_S = 150.0


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch: pytest.MonkeyPatch) -> None:
    apply_hermetic(monkeypatch)


class Stream:
    """A pipe drained on a thread, each line with the monotonic time it arrived."""

    def __init__(self, pipe: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self._thread.start()

    def _drain(self, pipe: Any) -> None:
        for line in pipe:
            with self._condition:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._condition.notify_all()
        pipe.close()

    def first(self, wanted: Callable[[str], bool], timeout_s: float) -> tuple[float, str] | None:
        """The first line ``wanted`` picks, with its arrival time; None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while True:
                found = next(((at, line) for at, line in self.lines if wanted(line)), None)
                if found is not None or time.monotonic() >= deadline or not self._thread.is_alive():
                    return found
                self._condition.wait(min(1.0, deadline - time.monotonic()))

    def join(self) -> None:
        self._thread.join(10)

    @property
    def text(self) -> str:
        with self._condition:
            return "\n".join(line for _, line in self.lines)


class Launch:
    """``otel-forge run --prometheus-port 0 -- torchrun --nproc-per-node 2 ddp_job.py ARGS`` in its own
    process group, its stdout and stderr drained as they come."""

    def __init__(self, tmp: Path, tracking_uri: str, name: str, job_args: list[str], settings: dict[str, str]) -> None:
        self.experiment = unique(name)
        self.out = tmp / "accounts"
        torchrun = shutil.which("torchrun")
        assert torchrun, "torchrun (pip install torch) is the launcher under test"
        argv = [
            *FORGE, "run", "--prometheus-host", "127.0.0.1", "--prometheus-port", "0", "--",
            torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-id", unique("rdzv"),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(JOB), "--out", str(self.out), *job_args,
        ]  # fmt: skip
        env = hermetic_environ(
            {
                "MLFLOW_TRACKING_URI": tracking_uri,
                "MLFLOW_EXPERIMENT_NAME": self.experiment,
                "OTEL_FORGE_SAMPLING_INTERVAL": "0.5",
                "OTEL_FORGE_COLLECTORS": "cpu,memory",
                "OTEL_FORGE_SPOOL_DIR": str(tmp / "spool"),
                "TMPDIR": str(tmp),
                "GIT_CONFIG_NOSYSTEM": "1",
                **settings,
            }
        )
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            argv,
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.stdout = Stream(self.process.stdout)
        self.stderr = Stream(self.process.stderr)
        self._metrics_url: str | None = None

    def metrics_url(self) -> str:
        if self._metrics_url is None:
            found = self.stderr.first(lambda line: SERVING.match(line) is not None, 30)
            assert found is not None, f"no 'serving prometheus' line:\n{self.stderr.text}"
            self._metrics_url = SERVING.match(found[1])[1]  # type: ignore[index]
        return self._metrics_url

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Each series of gauge ``name`` on otel-forge run's /metrics now: (labels, value)."""
        with urllib.request.urlopen(self.metrics_url(), timeout=5) as response:
            text = response.read().decode()
        return [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]

    def wait_for_series(
        self, name: str, wanted: Callable[[list[tuple[dict[str, str], float]]], bool], timeout_s: float
    ) -> list[tuple[dict[str, str], float]]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                found = self.series(name)
            except OSError as error:
                raise AssertionError(f"{name} not scraped ({error})\n{self.stderr.text[-4000:]}") from None
            if wanted(found):
                return found
            assert time.monotonic() < deadline and self.process.poll() is None, (
                f"{name} never as wanted: {found}\n{self.stderr.text[-4000:]}"
            )
            time.sleep(0.5)

    def finish(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> int:
        try:
            code = self.process.wait(timeout=max(1.0, self.started + timeout_s - time.monotonic()))
        finally:
            self.kill()
        self.stdout.join()
        self.stderr.join()
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def accounts(self) -> list[dict[str, Any]]:
        """Each rank's own account of its steps (rank order)."""
        return [json.loads((self.out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture
def launch(mlflow_server: Any, tmp_path: Path) -> Iterator[Callable[..., Launch]]:
    started: list[Launch] = []

    def start(name: str, job_args: str, **settings: str) -> Launch:
        """``job_args``: ddp_job.py's arguments, as a shell would split them."""
        started.append(Launch(tmp_path, mlflow_server.uri, name, shlex.split(job_args), settings))
        return started[-1]

    yield start
    for each in started:
        each.kill()


def by_rank(found: list[tuple[dict[str, str], float]]) -> dict[str, float]:
    return {labels[RANK_LABEL]: value for labels, value in found}


def both_ranks_stepped(found: list[tuple[dict[str, str], float]]) -> bool:
    return {labels[RANK_LABEL] for labels, value in found if value > 0} >= {"0", "1"}


def tags_under(run: Any, prefix: str) -> dict[str, str]:
    return {key: value for key, value in run.data.tags.items() if key.startswith(prefix)}


def artifact_text(client: Any, run: Any, path: str, tmp: Path) -> str:
    return Path(client.download_artifacts(run.info.run_id, path, str(tmp))).read_text()


def line_of(needle: str, after: str) -> int:
    """The script's line number of the first line holding ``needle`` after the line holding ``after``."""
    lines = JOB.read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if after in line)
    return next(index for index in range(start, len(lines)) if needle in lines[index]) + 1


def test_a_rank_blocked_in_its_own_function_is_named_as_the_stall(launch, client, tmp_path) -> None:
    floor_s = 10
    release = tmp_path / "the-disk-answers"
    job = launch(
        "stall",
        f"--steps 180 --step-seconds 0.05 --stall-rank 1 --stall-at 40 --release {release}",
        OTEL_FORGE_STALL_FLOOR=str(floor_s),
    )
    try:
        seen = job.stderr.first(lambda line: line.startswith(STALL_LINE), floor_s + 90)
        assert seen is not None, job.stderr.text
        stalled = job.wait_for_series("otel_forge_training_stalled", lambda found: by_rank(found).get("1") == 1, 10)
    finally:
        release.touch()  # the disk answers: rank 1 goes on, and the job trains 140 more steps
    # Once it moves again, no series says it is stalled (rank 1's is not left at 1).
    moving = job.wait_for_series("otel_forge_training_stalled", lambda found: by_rank(found) == {"none": 0}, 15)
    code = job.finish()
    waited = job.accounts()[1]["stall"]

    assert code == 0, job.stderr.text
    # The line came within 60 s past the floor from rank 1's block (the job's own clock, as ours).
    assert seen[0] - waited[0] < floor_s + 60, (seen, waited)
    where = f"wait_for_the_disk (ddp_job.py:{line_of('time.sleep', 'def wait_for_the_disk')})"
    assert f"rank 1 on host {socket.gethostname()} at step 40 is not in a collective: in {where}" in seen[1], seen
    assert "stalls/stall-1.txt" in seen[1]
    [labels] = [labels for labels, value in stalled if value == 1]
    assert labels[RANK_LABEL] == "1" and labels["host_name"] == socket.gethostname(), stalled
    assert [labels["host_name"] for labels, _ in moving] == [socket.gethostname()]
    assert "otel-forge: the training moves again" in job.stderr.text

    run = the_run(client, job.experiment)
    assert run.info.status == "FINISHED"
    stall = tags_under(run, "otel_forge.stall")
    assert stall["otel_forge.stall"] == seen[1].removeprefix("otel-forge: ").split("; every rank's stacks")[0]
    assert stall["otel_forge.stall.rank"] == "1", stall
    assert stall["otel_forge.stall.host"] == socket.gethostname()
    assert stall["otel_forge.stall.step"] == "40"
    assert stall["otel_forge.stall.where"] == where
    assert {"otel_forge.stall.started", "otel_forge.stall.ended", "otel_forge.stall.seconds"} <= stall.keys()
    # The stall lasted from the job's last step to rank 1's release, as the job itself measured it.
    assert abs(float(stall["otel_forge.stall.seconds"]) - (waited[1] - waited[0])) < 3, (stall, waited)

    report = artifact_text(client, run, "stalls/stall-1.txt", tmp_path / "artifacts")
    rank_0, rank_1 = report.split("=== rank 0 ")[1].split("=== rank 1 ")
    assert "waiting in a collective" in rank_0.splitlines()[0] and "all_reduce" in rank_0, report
    assert "not in a collective" in rank_1.splitlines()[0], report
    assert f'ddp_job.py", line {where.split(":")[1][:-1]} in wait_for_the_disk' in rank_1, report


def test_a_long_checkpoint_is_no_stall_and_goodput_counts_what_the_job_did(launch, client, tmp_path) -> None:
    # The case is a checkpoint of 100 s against the default floor; a 5 s floor and a 15 s
    # checkpoint are the same case (three floors long), a minute and a half shorter.
    floor_s, checkpoint_s = 5, 15
    job = launch(
        "checkpoint",
        f"--ddp --steps 200 --step-seconds 0.05 --checkpoint-at 100 --checkpoint-seconds {checkpoint_s}",
        OTEL_FORGE_STALL_FLOOR=str(floor_s),
    )
    steps = job.wait_for_series("otel_forge_training_step", both_ranks_stepped, 60)
    code = job.finish()
    accounts = job.accounts()

    assert code == 0, job.stderr.text
    assert {labels[RANK_LABEL] for labels, _ in steps} == {"0", "1"}, steps
    assert STALL_LINE not in job.stderr.text
    run = the_run(client, job.experiment)
    assert run.info.status == "FINISHED"
    assert tags_under(run, "otel_forge.stall") == {}
    for rank in (0, 1):
        assert run.data.metrics[f"system/training_rank_{rank}_step"] == 200
        for key in ("step_p50_seconds", "step_p95_seconds", "work_seconds", "work_ratio"):
            assert f"system/training_rank_{rank}_{key}" in run.data.metrics, sorted(run.data.metrics)
        assert 0.05 <= run.data.metrics[f"system/training_rank_{rank}_step_p50_seconds"] < 0.5

    goodput = json.loads(artifact_text(client, run, "goodput.json", tmp_path / "artifacts"))
    assert goodput["columns"] == ["activity", "seconds", "percent"]
    table = {activity: (seconds, percent) for activity, seconds, percent in goodput["data"]}
    assert list(table) == [
        "startup", "productive", "checkpointing", "evaluating", "stalled", "restart_lost", "other", "total"
    ]  # fmt: skip
    total = table["total"][0]
    checkpointed = max(end - begin for account in accounts for begin, end in account["checkpoints"])
    assert checkpointed >= checkpoint_s
    assert abs(table["checkpointing"][0] - checkpointed) < 2, (table, accounts)
    assert table["stalled"][0] == 0
    # Productive: from the job's first step to its last, less the checkpoint, by the job's own clock.
    first = min(account["first_step"] for account in accounts)
    last = max(account["last_step"] for account in accounts)
    productive = last - first - checkpointed
    assert abs(table["productive"][1] - 100 * productive / total) < 2, (table, productive)
    assert abs(sum(seconds for activity, (seconds, _) in table.items() if activity != "total") - total) < 0.01
    # The run's last window came a moment before goodput.json's final look: the same productive time.
    assert run.data.metrics["system/training_time_productive_seconds"] == pytest.approx(table["productive"][0], abs=1)
    assert run.data.metrics["system/training_goodput_percentage"] == pytest.approx(table["productive"][1], abs=3)
    assert run.data.metrics["system/training_time_checkpointing_seconds"] == pytest.approx(checkpointed, abs=2)


def test_a_rank_thirty_percent_slower_is_named_the_slow_rank(launch, client, tmp_path) -> None:
    enough = tmp_path / "named"
    job = launch(
        "slow-rank",
        f"--ddp --steps 2000 --step-seconds 0.1 --slow-rank 1 --slow-by 0.3 --until {enough}",
        OTEL_FORGE_SLOW_RANK_AFTER="5",  # the default 30 s: the same case, 25 s shorter
    )
    try:
        named = job.stderr.first(lambda line: "is the slow rank" in line, 120)
        slow = job.wait_for_series("otel_forge_training_slow_rank", lambda found: by_rank(found).get("1") == 1, 10)
    finally:
        enough.touch()
    code = job.finish()

    assert code == 0, job.stderr.text
    assert named is not None, job.stderr.text
    assert named[0] - job.started < 120
    assert f"rank 1 on host {socket.gethostname()} is the slow rank" in named[1]
    assert by_rank(slow) == {"0": 0, "1": 1}, slow
    run = the_run(client, job.experiment)
    assert run.info.status == "FINISHED"
    assert tags_under(run, "otel_forge.slow_rank") == {
        "otel_forge.slow_rank": named[1].removeprefix("otel-forge: "),
        "otel_forge.slow_rank.rank": "1",
        "otel_forge.slow_rank.host": socket.gethostname(),
    }
    assert tags_under(run, "otel_forge.stall") == {}
    assert run.data.metrics["system/training_rank_1_work_ratio"] > 1.2
