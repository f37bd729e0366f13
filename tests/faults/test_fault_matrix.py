"""More rows of the fault matrix (docs/reliability.md), each against a real ``mlflow server`` and a real
training process in a process group of its own (testkit/training_job.py): a read-only spool, a journal
damaged in the middle or cut, SIGKILL of the training process or its companion at random moments,
a server down at the job's start. What each asserts is what a user sees: no exception in the script,
every value whose ``log()`` reported no drop in MLflow once, the run's status, a line that is true."""

from __future__ import annotations

import os
import random
import textwrap
import time
from pathlib import Path

import pytest
from faultkit import WIDTH, steps_logged, the_run
from trun_helpers import unique

from testkit.mlflow_server import MlflowServer
from testkit.servers import free_port, wait_for
from testkit.training_job import TrainingJob, otel_forge_command

pytestmark = pytest.mark.slow


# Logs STEPS steps of WIDTH values, RATE steps a second, printing "step N REJECTED" once each log()
# returned; at step HOOK_AT prints "hook" and waits for the file GO. LEAVE runs last in the block.
LOOP = """
import os, sys, time
from otel_forge import TrainingRun
values = lambda step: {{f"v{{i}}": step + i / 1000 for i in range({width})}}
with TrainingRun(config={{"lr": 0.25}}, tracking_uri={uri!r}, experiment={experiment!r},
                 system_metrics=False) as run:
    for step in range({steps}):
        if step == {hook_at}:
            print("hook", flush=True)
            while not os.path.exists({go!r}):
                time.sleep(0.02)
        run.log(values(step), step=step)
        print("step", step, run.rejected, flush=True)
        if {rate}:
            time.sleep(1 / {rate})
    print("logged", run.rejected, flush=True)
    {leave}
print("exited", run.rejected, flush=True)
"""


def _loop(
    directory: Path, uri: str, experiment: str, spool: Path, *, steps: int, rate: float = 0, hook_at: int = -1,
    leave: str = "pass", env: dict[str, str] | None = None,
) -> TrainingJob:  # fmt: skip
    code = LOOP.format(
        uri=uri, experiment=experiment, width=WIDTH, steps=steps, rate=rate, hook_at=hook_at,
        go=str(directory / "go"), leave=leave,
    )  # fmt: skip
    return TrainingJob(textwrap.dedent(code), directory, {"OTEL_FORGE_SPOOL_DIR": str(spool), **(env or {})})


def _go(job: TrainingJob) -> None:
    (job.directory / "go").touch()


def _kept_steps(logged: dict[int, int]) -> list[int]:
    """The steps whose log() dropped nothing (the count did not move)."""
    return [step for step, so_far in sorted(logged.items()) if so_far == logged.get(step - 1, 0)]


def _steps_in(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _assert_once(client, run_id: str, steps: list[int], keys: tuple[str, ...] = ("v0", f"v{WIDTH - 1}")) -> None:
    for key in keys:
        found = _steps_in(client, run_id, key)
        repeated = sorted({step for step in found if found.count(step) > 1})
        missing, extra = sorted(set(steps) - set(found)), sorted(set(found) - set(steps))
        assert found == steps, f"{key}: missing steps {missing[:20]}, repeated {repeated[:20]}, extra {extra[:20]}"


# --- a read-only spool ------------------------------------------------------------------------


@pytest.fixture
def read_only_spool(tmp_path):
    from testkit.small_disk import can_mount, read_only_disk

    if not can_mount():
        pytest.skip("mounting a read-only tmpfs needs root (a mode of 0500 does not stop root)")
    with read_only_disk(tmp_path / "readonly") as disk:
        yield disk / "spool"


@pytest.mark.parametrize(("leave", "status", "code"), [("pass", "FINISHED", 0), ("sys.exit(3)", "FAILED", 3)])
def test_a_read_only_spool_raises_nothing_and_the_run_holds_the_count_of_what_was_lost(
    leave, status, code, read_only_spool, tmp_path, mlflow_server, client
):
    """The spool is on a read-only file system from the start (EROFS, root included): the journal
    cannot be made, so nothing can be logged. Nothing reaches the script; every value is counted lost,
    with the reason, in the last line and in the run's ``otel_forge.log.rejected`` tag; the run ends
    as the job did. Before: the run ended without the tag the last line named (``end_here``)."""
    experiment = unique("readonly")
    job = _loop(tmp_path / "job", mlflow_server.uri, experiment, read_only_spool, steps=30, leave=leave)
    with job:
        assert job.wait() == code
    stderr = job.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    lost = 30 * WIDTH
    assert job.wait_line("logged") == f"logged {lost}"
    assert f"the run's journal cannot be written in {read_only_spool} (Read-only file system)" in stderr
    assert (
        f"{lost} metric value(s) were dropped in all: {lost} lost (the run's journal could not be written: "
        f"{read_only_spool}: Read-only file system); tag otel_forge.log.rejected of the run holds the count"
    ) in stderr, stderr[-3000:]
    run = the_run(client, experiment)
    assert run.info.status == status
    assert run.data.tags.get("otel_forge.log.rejected") == str(lost), "the last line names a tag the run lacks"
    assert not run.data.metrics


@pytest.fixture
def failing_spool(tmp_path):
    from testkit.small_disk import can_fail_a_disk, failing_disk

    if not can_fail_a_disk():
        pytest.skip("an ext4 file system on a loop device needs root, /dev/loop-control and ext4")
    with failing_disk(tmp_path / "disk", tmp_path / "disk.img") as disk:
        yield disk


def test_a_spool_disk_that_turns_read_only_mid_job_raises_nothing_and_every_kept_value_arrives(
    failing_spool, tmp_path, mlflow_server, client
):
    """The spool's disk fails mid-job and the kernel remounts it read-only (ext4,
    ``errors=remount-ro``) under the open journal: every append after is EROFS. Nothing reaches the
    script; every value journaled before is in the run once; the rest are counted lost with the
    reason, in the last line and in the run's tag; the run ends FINISHED (its end, which the journal
    cannot keep, handed to the companion)."""
    experiment = unique("erofs")
    job = _loop(tmp_path / "job", mlflow_server.uri, experiment, failing_spool.where / "spool", steps=90,
                rate=50, hook_at=40)  # fmt: skip
    with job:
        job.wait_line("hook")
        failing_spool.fail()
        assert failing_spool.read_only()
        _go(job)
        assert job.wait() == 0
    stderr = job.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    logged = steps_logged(job.lines())
    kept = _kept_steps(logged)
    lost = int(job.wait_line("exited").split()[1])
    assert kept == list(range(40)) and lost == WIDTH * (90 - 40), f"{lost} lost; kept {kept[-3:]}"
    assert (
        f"{lost} metric value(s) were dropped in all: {lost} lost (the run's journal could not be written: "
        "Read-only file system)"
    ) in stderr, stderr[-3000:]
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED"
    assert run.data.tags.get("otel_forge.log.rejected") == str(lost)
    _assert_once(client, run.info.run_id, kept)


# --- a journal damaged in the middle, or cut --------------------------------------------------


def _records(journal: Path) -> list[tuple[int, int, list]]:
    """(start, end, entry) of each record of the journal, read whole."""
    from otel_forge.journal.framing import HEADER_SIZE, room_in_block
    from otel_forge.journal.reader import JournalReader
    from otel_forge.mlflow.training.run_journal import decode

    records, start = [], 0
    with JournalReader(journal) as reader:
        for payload, end in reader.read(final=True):
            begins = start + room_in_block(start) if room_in_block(start) < HEADER_SIZE else start  # after a trailer
            records.append((begins, end, decode(payload)))
            start = end
    return records


def _overwrite(journal: Path, records: list[tuple[int, int, list]]) -> tuple[list[list], str]:
    """3,000 bytes of garbage from 40 % of the file: the entries of the records it spares, and what
    the replay must say."""
    size = journal.stat().st_size
    begin, end = int(size * 0.4), int(size * 0.4) + 3000
    with open(journal, "r+b") as file:
        file.seek(begin)
        file.write(random.Random(41).randbytes(end - begin))
    touched = [(start, stop) for start, stop, _ in records if start < end and stop > begin]
    after = next(start for start, _, _ in records if start >= touched[-1][1])
    first = touched[0][0]
    said = f"{after - first} byte(s) in 1 place(s) in the middle of the journal (the first at offset {first})"
    return [entry for start, stop, entry in records if stop <= begin or start >= end], said


def _cut(journal: Path, records: list[tuple[int, int, list]]) -> tuple[list[list], str]:
    """The file cut near its half, inside a record: the entries of the records wholly before the cut."""
    middle = records[len(records) // 2]
    cut = middle[0] + 37
    os.truncate(journal, cut)
    return [entry for _, stop, entry in records if stop <= cut], "the journal ends in an incomplete record (37 byte(s))"


@pytest.mark.parametrize(("damage", "status"), [(_overwrite, "FINISHED"), (_cut, "KILLED")], ids=["overwritten", "cut"])
def test_a_journal_damaged_in_the_middle_or_cut_delivers_every_intact_record_once_and_says_which(
    damage, status, tmp_path, mlflow_server, client
):
    """A job logs 300 steps while nothing listens at its tracking URI, so its journal keeps them all;
    then the journal is damaged (3,000 bytes of garbage in its middle, or the file cut at its half)
    and ``otel-forge replay --all`` delivers it: nothing raises, every record the damage spared is in
    the run once, and the line says what was skipped and where: damage in the middle is not a record
    torn by a writer's death. A cut file lost its end entry with its tail: the run ends KILLED, as
    for a job whose end never reached the journal. Before: the rest of the damaged 32 KiB block was
    lost with it, and the line blamed "a record torn by the writer's death" whatever it was."""
    experiment, spool = unique("damaged"), tmp_path / "spool"
    refused = f"http://127.0.0.1:{free_port()}"
    with _loop(tmp_path / "job", refused, experiment, spool, steps=300) as job:
        assert job.wait() == 0
    assert "Traceback" not in job.stderr() and "otel-forge replay" in job.stderr(), job.stderr()[-3000:]
    (journal_dir,) = spool.glob("journal-*")
    journal = journal_dir / "journal.log"
    records = _records(journal)
    assert sum(1 for *_, entry in records if entry[0] == "m") == 300 and records[-1][2][0] == "end"
    spared, said = damage(journal, records)
    steps = [entry[1] for entry in spared if entry[0] == "m"]
    assert 0 < len(steps) < 300

    code, output = otel_forge_command(
        ["replay", "--all", "--tracking-uri", mlflow_server.uri], tmp_path / "replay",
        {"OTEL_FORGE_SPOOL_DIR": str(spool)},
    )  # fmt: skip
    assert code == 0 and "Traceback" not in output, output[-3000:]
    assert said in output, output[-3000:]
    middle = damage is _overwrite
    assert ("in the middle of the journal" in output) == middle and ("incomplete record" in output) != middle
    assert "the file was changed after it was written" in output or not middle
    assert "by its writer's death or the node's crash, or the file was cut there" in output or middle
    run = the_run(client, experiment)
    assert run.info.status == status
    # The description is journaled once the opener has imported MLflow: after the values, here, so
    # a cut at the half loses it with them.
    assert (run.data.params.get("lr") == "0.25") == any(entry[0] == "describe" for entry in spared)
    _assert_once(client, run.info.run_id, steps)


# --- SIGKILL at random moments ----------------------------------------------------------------

KILL_WIDTH, KILL_STEPS, KILL_RATE = 20, 200, 100  # 2,000 values a second for 2 s
SEEDS = 12  # 5 training, 4 companion, 3 both: every victim, each more than once
AT_ONCE = 3  # jobs alive together (each a training process, a companion, a replay): the other tests run beside

# Logs KILL_STEPS steps of KILL_WIDTH values, KILL_RATE steps a second, printing "step N REJECTED"
# once each log() returned: the line is written (a syscall) before the next step, so a SIGKILL
# leaves every step that returned in the file, and perhaps one more in the journal.
KILLED = """
import time
from otel_forge import TrainingRun
with TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, system_metrics=False) as run:
    print("entered", run.run_id, flush=True)
    began = time.monotonic()
    for step in range({steps}):
        run.log({{f"k{{i}}": step + i / 1000 for i in range({width})}}, step=step)
        print("step", step, run.rejected, flush=True)
        time.sleep(max(began + (step + 1) / {rate} - time.monotonic(), 0))
print("exited", run.rejected, flush=True)
"""


def _kill_one_seed(seed: int, uri: str, directory: Path) -> dict:
    """One job killed as the seed draws: ``training`` (SIGKILL the training process; its companion
    delivers and ends the run), ``companion`` (SIGKILL its companion; a new one takes over and the
    job completes), ``both`` (SIGKILL the job's process group; ``otel-forge replay --all`` delivers
    what is left, as a user would). What happened, for the test to check."""
    rng = random.Random(seed)
    victim = rng.choice(["training", "companion", "both"])
    kill_after_s = rng.uniform(0.0, KILL_STEPS / KILL_RATE)
    experiment, spool = unique(f"kill{seed}-{victim}"), directory / "spool"
    code = KILLED.format(uri=uri, experiment=experiment, width=KILL_WIDTH, steps=KILL_STEPS, rate=KILL_RATE)
    began = time.monotonic()
    replay: tuple[int, str] | None = None
    with TrainingJob(textwrap.dedent(code), directory / "job", {"OTEL_FORGE_SPOOL_DIR": str(spool)}) as job:
        job.wait_line("entered", 60)
        time.sleep(kill_after_s)
        if victim == "companion":
            for pid in job.companions():
                os.kill(pid, 9)
            exit_code = job.wait(120)
        elif victim == "training":
            os.kill(job.pid, 9)
            exit_code = job.wait(10)
        else:
            job.kill_group()
            exit_code = job.process.returncode if job.process is not None else None
        # The companion (the one left, or a new one) delivers and exits; nothing of the job is left after.
        wait_for(lambda: not job.group_alive(), 90, 0.2, message=f"seed {seed}: the job's companion done")
        if victim == "both":
            replay = otel_forge_command(
                ["replay", "--all"], directory / "replay", {"OTEL_FORGE_SPOOL_DIR": str(spool)}, timeout_s=120
            )
    return {
        "seed": seed, "victim": victim, "kill_after_s": round(kill_after_s, 2), "experiment": experiment,
        "exit_code": exit_code, "lines": job.lines(), "stderr": job.stderr(), "replay": replay,
        "left": sorted(p.name for p in spool.glob("journal-*")) if spool.exists() else [],
        "seconds": round(time.monotonic() - began, 1),
    }  # fmt: skip


def _check_killed_seed(client, outcome: dict) -> list[str]:
    """What is wrong with one seed's run, as lines (none: all is well)."""
    seed, victim = outcome["seed"], outcome["victim"]
    where = f"seed {seed} ({victim} killed after {outcome['kill_after_s']} s, {outcome['seconds']} s in all)"
    problems = []
    if "Traceback" in outcome["stderr"]:
        problems.append(f"{where}: a traceback: {outcome['stderr'][-1500:]}")
    if outcome["replay"] is not None and (outcome["replay"][0] != 0 or "Traceback" in outcome["replay"][1]):
        problems.append(f"{where}: replay: {outcome['replay']}")
    if outcome["left"]:
        problems.append(f"{where}: journals left undelivered: {outcome['left']}")
    logged = steps_logged(outcome["lines"])
    kept = _kept_steps(logged)
    if victim == "companion" and (outcome["exit_code"] != 0 or kept != list(range(KILL_STEPS))):
        problems.append(f"{where}: the job did not complete: exit {outcome['exit_code']}, {len(kept)} steps")
    try:
        run = the_run(client, outcome["experiment"], 30)
    except TimeoutError as error:
        return [*problems, f"{where}: {error}"]
    status = "FINISHED" if victim == "companion" else "KILLED"
    if run.info.status != status:
        problems.append(f"{where}: the run is {run.info.status}, not {status}")
    # The step whose log() the kill interrupted may be in the journal, whole, or not at all.
    may_add = {max(logged, default=-1) + 1} if victim != "companion" else set()
    for key in ("k0", f"k{KILL_WIDTH - 1}"):
        history = client.get_metric_history(run.info.run_id, key)
        found = sorted(m.step for m in history)
        repeated = sorted({step for step in found if found.count(step) > 1})
        missing = sorted(set(kept) - set(found))
        extra = sorted(set(found) - set(kept) - may_add)
        wrong = [m.step for m in history if m.value != m.step + int(key[1:]) / 1000]
        if repeated or missing or extra or wrong:
            problems.append(
                f"{where}: {key}: {len(found)} steps of {len(kept)} logged; missing {missing[:10]}, "
                f"repeated {repeated[:10]}, extra {extra[:10]}, wrong values at {wrong[:10]}"
            )
    return problems


@pytest.fixture
def own_server(tmp_path_factory):
    """A tracking server of the test's own: what its killed jobs leave delivering loads no other test."""
    server = MlflowServer(tmp_path_factory.mktemp("kill-server")).start()
    try:
        yield server
    finally:
        server.kill()  # SIGKILL of its process group: a SIGTERM'd server takes seconds to go


def test_sigkill_at_random_moments_of_the_training_process_or_its_companion_loses_nothing(own_server, tmp_path):
    """12 jobs logging 2,000 values a second, each killed (SIGKILL) at a moment its seed draws: the
    training process (its companion delivers and ends the run KILLED), its companion (a new one takes
    over; the job completes, FINISHED), or both at once (``otel-forge replay --all`` delivers the
    journal, KILLED). Every value whose ``log()`` returned without a drop is in its run once, with
    its value; no other but the one the kill interrupted; nothing of any job is left running."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow import MlflowClient

    with ThreadPoolExecutor(AT_ONCE) as pool:
        outcomes = list(
            pool.map(lambda seed: _kill_one_seed(seed, own_server.uri, tmp_path / f"seed-{seed}"), range(SEEDS))
        )
    client = MlflowClient(own_server.uri)
    problems = [problem for outcome in outcomes for problem in _check_killed_seed(client, outcome)]
    victims = sorted({outcome["victim"] for outcome in outcomes})
    assert victims == ["both", "companion", "training"], victims
    assert not problems, "\n".join(problems)


# --- a server down at the job's start ---------------------------------------------------------


def test_a_server_down_for_the_first_8_s_of_a_job_logging_1000_values_a_second_gets_every_value_once(tmp_path):
    """``bench.outage_start`` scaled down (its 180 s outage at 5,000 values/s is in docs/reliability.md):
    the server refuses connections for the first 8 s of a job logging 1,000 values a second (plus its
    own start: its port opens once it answers), then answers; the job logs on until its run has caught
    up with it (lags it by 2 s at most), and 3 s more. Nothing reaches the script, nothing is dropped,
    every value is in the run once, and the run ends FINISHED. The rate is well under what a one-worker
    sqlite server takes on a loaded 2-core machine (5,300 values/s at its slowest, measured), so the
    test runs beside the others: the catch-up is the server's pace less the job's, and the test is
    about what arrives, not how fast (``bench.outage_start`` measures that). The server is the
    scenario's own (killed with its group after)."""
    from testkit.outage import WIDTH as OUTAGE_WIDTH
    from testkit.outage import run_outage

    result = run_outage(tmp_path, down_s=8.0, rate=1000.0, after_s=3.0, catch_up=True, catch_up_wait_s=180.0)
    assert result.exit_code == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.dropped == 0 and result.backlog >= 8 * 1000 * 0.9, result
    assert result.backlog_in_s is not None, f"the backlog of {result.backlog} values never reached the run"
    assert result.caught_up_s is not None, "the run never caught up with the job"
    assert result.last_in_s is not None, f"{result.in_mlflow} of {result.logged} values in the run"
    assert result.in_mlflow == result.logged and result.repeated == 0, result
    assert result.status == "FINISHED"
    assert result.kept_steps == list(range(result.logged // OUTAGE_WIDTH))
