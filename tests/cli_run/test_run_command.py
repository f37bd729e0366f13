"""``otel-forge run [options] -- CMD ...`` as a process, against the session's real ``mlflow server``.

Every test launches ``python -m otel_forge.cli run`` (with ``--no-prometheus --interval 0.3``), then
reads what landed in MLflow with a plain ``MlflowClient``: the launched run holds the node's
``system/`` metrics, the git state of the working directory, the launch config (artifact and params)
and MLflow's context tags; the runs CMD starts with MLflow's own API (``mlflow.log_*``, autologging,
``start_run`` per fit) are its children; the run ends FINISHED/FAILED/KILLED from CMD's exit and
otel-forge exits with CMD's code; signals reach CMD; bad input is one line and exit 2; a missing
server costs logging, not the job. CMD scripts live in ``tests/cli_run/scripts``.
"""

from __future__ import annotations

import collections
import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from run_reading import anchor_steps

from testkit.git_repo import commit_all, git
from testkit.hermetic import hermetic_environ
from testkit.servers import free_port
from testkit.thread_signal import send_to_another_thread

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FORGE_RUN = [sys.executable, "-m", "otel_forge.cli", "run"]
INTERVAL = "0.3"
RUN_TIMEOUT_S = 60.0
USAGE_ERROR = 2
# otel-forge run's own lines are on its stderr (its stdout is CMD's): the run, once open, and what it serves.
RUN_LINE = re.compile(r"^otel-forge: run ([0-9a-f]{32}) in experiment (\S+) at (\S+)$", re.MULTILINE)
SERVING_LINE = re.compile(r"^otel-forge: serving \S")

# Bugs found by these tests (see the report that came with them).
BUG_CMD_TRAININGRUN_DROPS_CONFIG = (
    "otel_forge/mlflow/training/training_run.py TrainingRun._open: a TrainingRun inside `otel-forge run` resumes "
    "the run "
    "from MLFLOW_RUN_ID and _record_new_run is only called for a created run, so CMD's config params, "
    "config.json, description and tags never reach the run"
)
BUG_TWO_AGENTS_PER_NODE = (
    "otel_forge/cli/run.py + training_run.py: `otel-forge run` samples the node and CMD's TrainingRun "
    "(system_metrics=True by default) starts a second agent into the same run with the same system/ prefix: "
    "two values at one step"
)
BUG_SIGINT_TWICE = (
    "otel_forge/cli/run.py _forward_signals: CMD shares otel-forge's process group, so a terminal Ctrl-C "
    "(SIGINT to the group) reaches CMD directly AND forwarded: twice, the second one inside CMD's cleanup "
    "(uv run: do not forward SIGINT to a child in our own process group, astral-sh/uv#11009, #13925)"
)
BUG_SIGNAL_BEFORE_HANDLERS = (
    "otel_forge/cli/run.py run(): the forwarding handlers are installed only after Popen and the system-metrics "
    "monitor's start; a SIGTERM in between (hundreds of ms after the run opened) kills otel-forge by the signal: "
    "the run stays RUNNING and CMD is orphaned"
)
BUG_READER_TICKS_BEFORE_REGISTRATION = (
    "otel_forge/pipeline.py Agent.start: the MLflow PeriodicExportingMetricReader is built (its ticker thread "
    "starts in its constructor) before open_collectors/build_resource and MeterProvider(...): a tick in between "
    "logs the SDK's 'Cannot call collect on a MetricReader until it is registered' warning on stderr"
)


# --- helpers -------------------------------------------------------------------------------------


def forge_environ(tmp: Path, **extra: str) -> dict[str, str]:
    """The hermetic environment without any MLflow setting either; spool and temp files under ``tmp``."""
    own = {"OTEL_FORGE_SPOOL_DIR": str(tmp / "spool"), "TMPDIR": str(tmp), "GIT_CONFIG_NOSYSTEM": "1"}
    return hermetic_environ(own, prefixes=("OTEL_", "MLFLOW_"), **extra)


def server_options(uri: str, experiment: str) -> list[str]:
    return ["--tracking-uri", uri, "--no-prometheus", "--interval", INTERVAL, "--experiment", experiment]


def run_forge(
    args: list[str], cwd: Path, env: dict[str, str], timeout_s: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FORGE_RUN, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def run_id_of(stderr: str) -> str:
    found = RUN_LINE.search(stderr)
    assert found, f"no 'otel-forge: run ...' line in stderr:\n{stderr}"
    return found.group(1)


def beyond_announcements(stderr: str) -> list[str]:
    """``stderr``'s lines but otel-forge's run line and serving lines: what else it (or CMD) said."""
    return [line for line in stderr.splitlines() if not (RUN_LINE.match(line) or SERVING_LINE.match(line))]


def unique(name: str) -> str:
    return f"cli-run-{name}-{uuid.uuid4().hex[:8]}"


def steps_of(client, run_id: str, key: str) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def children_of(client, run_id: str) -> list:  # type: ignore[no-untyped-def]
    """The runs of ``run_id``'s experiment whose ``mlflow.parentRunId`` is ``run_id``."""
    experiment_id = client.get_run(run_id).info.experiment_id
    return client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")


@dataclass
class Launched:
    result: subprocess.CompletedProcess[str]
    run_id: str
    cwd: Path
    experiment: str


# --- a script that only knows mlflow.log_metric ------------------------------------------------

LAUNCH_TOML = """\
[model]
dim = 8
layers = [16, 32]

[optim]
lr = 0.1
"""


@pytest.fixture(scope="module")
def git_repo(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A committed repository holding examples/train_plain_mlflow.py, its launcher and a launch TOML."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path_factory.mktemp("repo")
    shutil.copy(EXAMPLES / "train_plain_mlflow.py", repo)
    shutil.copy(SCRIPTS / "train_with_launch_config.py", repo / "train.py")
    (repo / "cfg.toml").write_text(LAUNCH_TOML)
    (repo / ".gitignore").write_text("__pycache__/\n")
    commit_all(repo, "the training script")
    return repo


@pytest.fixture(scope="module")
def plain_run(mlflow_server, git_repo, tmp_path_factory) -> Launched:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("plain")
    experiment = unique("plain")
    result = run_forge(
        [
            *server_options(mlflow_server.uri, experiment),
            "--tag",
            "team=forge",
            "--",
            sys.executable,
            "train.py",
            "--steps",
            "20",
            "cfg.toml",
        ],
        cwd=git_repo,
        env=forge_environ(tmp),
    )
    return Launched(result, run_id_of(result.stderr), git_repo, experiment)


def test_plain_mlflow_script_exits_0_and_the_run_is_finished(plain_run, client) -> None:
    result = plain_run.result
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    # otel-forge's own lines are on its stderr: CMD's stdout is the job's output, nothing of ours in it.
    assert [line for line in result.stdout.splitlines() if line.startswith("otel-forge:")] == [], result.stdout
    run = client.get_run(plain_run.run_id)
    assert run.info.status == "FINISHED"
    assert "mlflow.parentRunId" not in run.data.tags
    assert client.get_experiment(run.info.experiment_id).name == plain_run.experiment
    # One run: the one CMD's mlflow.log_* calls opened is the launched run.
    runs = client.search_runs([run.info.experiment_id])
    assert [r.info.run_id for r in runs] == [plain_run.run_id], [r.data.tags for r in runs]


def test_plain_mlflow_script_metrics_land_beside_the_system_metrics(plain_run, client) -> None:
    run = client.get_run(plain_run.run_id)
    assert steps_of(client, plain_run.run_id, "loss") == list(range(20))
    assert run.data.params["steps"] == "20"  # CMD's own mlflow.log_param
    system = [key for key in run.data.metrics if key.startswith("system/")]
    assert "system/cpu_utilization_percentage" in system, sorted(run.data.metrics)
    assert "system/system_memory_usage_megabytes" in system
    assert len(system) >= 5, system
    windows = anchor_steps(client, plain_run.run_id)
    assert len(windows) >= 2 and windows == list(range(len(windows))), windows


def test_plain_mlflow_script_run_has_git_state_command_and_tags(plain_run, client) -> None:
    tags = client.get_run(plain_run.run_id).data.tags
    assert tags["mlflow.source.git.commit"] == git(plain_run.cwd, "rev-parse", "HEAD")
    assert tags["mlflow.source.git.dirty"] == "false"
    assert tags["mlflow.source.git.branch"] == git(plain_run.cwd, "symbolic-ref", "--short", "HEAD")
    # The working directory's repository alone says it (it has no origin): never otel-forge's own.
    assert "mlflow.source.git.repoURL" not in tags
    assert tags["otel_forge.command"] == f"{sys.executable} train.py --steps 20 cfg.toml"
    assert tags["team"] == "forge"
    assert tags["host"] == socket.gethostname()


def test_plain_mlflow_script_run_has_mlflows_context_tags(plain_run, client) -> None:
    tags = client.get_run(plain_run.run_id).data.tags
    assert tags["mlflow.user"] == getpass.getuser()
    assert tags["mlflow.source.type"] == "LOCAL"
    # The script CMD runs, as typed, not otel-forge's own entry point.
    assert tags["mlflow.source.name"] == "train.py"
    # Named after what ran, not a random pair of words.
    assert client.get_run(plain_run.run_id).info.run_name == "train"


def test_plain_mlflow_script_run_has_the_launch_config_as_artifact_and_params(plain_run, client, tmp_path) -> None:
    run = client.get_run(plain_run.run_id)
    artifacts = {a.path for a in client.list_artifacts(plain_run.run_id)}
    assert {"cfg.toml", "config.json"} <= artifacts, artifacts
    uploaded = Path(client.download_artifacts(plain_run.run_id, "cfg.toml", str(tmp_path)))
    assert uploaded.read_text() == LAUNCH_TOML
    resolved = json.loads(Path(client.download_artifacts(plain_run.run_id, "config.json", str(tmp_path))).read_text())
    assert resolved == {"model": {"dim": 8, "layers": [16, 32]}, "optim": {"lr": 0.1}}
    params = run.data.params
    assert {k: params.get(k) for k in ("model.dim", "model.layers.0", "model.layers.1", "optim.lr")} == {
        "model.dim": "8",
        "model.layers.0": "16",
        "model.layers.1": "32",
        "optim.lr": "0.1",
    }


def test_exit_code_3_fails_the_run_and_otel_forge_exits_3(mlflow_server, git_repo, client, tmp_path) -> None:
    result = run_forge(
        [
            *server_options(mlflow_server.uri, unique("exit3")),
            "--",
            sys.executable,
            "train.py",
            "--steps",
            "2",
            "--exit-code",
            "3",
        ],
        cwd=git_repo,
        env=forge_environ(tmp_path),
    )

    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    run_id = run_id_of(result.stderr)
    # MLflow ends the run CMD resumed FINISHED at CMD's exit; the job's exit code decides after it.
    assert client.get_run(run_id).info.status == "FAILED"
    assert steps_of(client, run_id, "loss") == [0, 1]


def test_a_healthy_run_writes_nothing_to_stderr_but_its_own_lines(mlflow_server, tmp_path) -> None:
    # A short interval makes the race certain; at 0.3 s on 2 busy cores it shows about one run in three.
    options = [
        "--tracking-uri",
        mlflow_server.uri,
        "--no-prometheus",
        "--interval",
        "0.02",
        "--experiment",
        unique("quiet"),
    ]
    result = run_forge(
        [*options, "--", sys.executable, "-c", "import time; time.sleep(0.5)"],
        cwd=tmp_path,
        env=forge_environ(tmp_path),
    )

    assert result.returncode == 0, result.stderr
    assert RUN_LINE.search(result.stderr), result.stderr
    assert beyond_announcements(result.stderr) == [], result.stderr


# A rank CMD started that ends a moment after CMD, as Lightning's rank 1 does after rank 0's `fit`.
LATE_RANK = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep({seconds}); open(sys.argv[1], 'w').write('done')",
                  {marker!r}])
"""


def test_a_rank_still_exiting_after_cmd_is_waited_for_not_warned_about(mlflow_server, tmp_path) -> None:
    marker = tmp_path / "rank-1-done"
    options = ["--tracking-uri", mlflow_server.uri, "--no-prometheus", "--experiment", unique("late-rank")]
    result = run_forge(
        [*options, "--", sys.executable, "-c", LATE_RANK.format(seconds=1.5, marker=str(marker))],
        cwd=tmp_path,
        env=forge_environ(tmp_path),
    )

    assert result.returncode == 0, result.stderr
    assert beyond_announcements(result.stderr) == [], result.stderr  # no warning: it was exiting, not left over
    assert marker.read_text() == "done"  # and it was not stopped: it finished on its own


def test_a_process_alive_after_the_exit_grace_is_named_and_stopped(mlflow_server, tmp_path) -> None:
    marker = tmp_path / "never"
    options = ["--tracking-uri", mlflow_server.uri, "--no-prometheus", "--experiment", unique("left-over")]
    started = time.monotonic()
    result = run_forge(
        [*options, "--", sys.executable, "-c", LATE_RANK.format(seconds=120, marker=str(marker))],
        cwd=tmp_path,
        env=forge_environ(tmp_path, OTEL_FORGE_EXIT_GRACE="1"),
    )

    assert result.returncode == 0, result.stderr
    (line,) = beyond_announcements(result.stderr)
    assert "CMD left 1 process(es) running 1 s after it exited" in line and "time.sleep(120)" in line, line
    assert not marker.exists() and time.monotonic() - started < 60


# --- signals -----------------------------------------------------------------------------------


class Background:
    """``otel-forge run`` in its own session (its group = otel-forge + CMD), output in files."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.out, self.err = cwd / "stdout.txt", cwd / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [*FORGE_RUN, *args],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, predicate, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.process.poll() is not None:
                pytest.fail(
                    f"otel-forge exited {self.process.returncode} before {what}:\n{self.stdout()}\n{self.stderr()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout_s} s:\n{self.stdout()}\n{self.stderr()}")
            time.sleep(0.05)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


@pytest.fixture
def background() -> Iterator[list[Background]]:
    started: list[Background] = []
    yield started
    for process in started:
        process.kill()


def _start_signal_child(
    mlflow_server, tmp_path: Path, background: list[Background], mode: str, experiment: str
) -> tuple[Background, Path]:  # type: ignore[no-untyped-def]
    record = tmp_path / "signals.txt"
    forge = Background(
        [
            *server_options(mlflow_server.uri, experiment),
            "--",
            sys.executable,
            str(SCRIPTS / "signal_child.py"),
            str(record),
            mode,
        ],
        tmp_path,
        forge_environ(tmp_path),
    )
    background.append(forge)
    ready = Path(f"{record}.ready")
    forge.wait_for(ready.exists, "CMD ready")
    # otel-forge installs its forwarding handlers right after printing the serving line.
    forge.wait_for(lambda: "otel-forge: serving" in forge.stderr(), "the serving line")
    time.sleep(0.5)
    return forge, record


def _child_pid(forge: Background) -> int:
    children = [
        child
        for child in psutil.Process(forge.process.pid).children()
        if "signal_child.py" in " ".join(child.cmdline())
    ]
    assert len(children) == 1, children
    return children[0].pid


@pytest.mark.parametrize(
    ("mode", "cmd_exit", "forge_exit", "to_a_thread"),
    [
        ("exit:7", 7, 7, False),  # CMD handles SIGTERM, cleans up, exits 7: otel-forge exits 7
        ("default", -signal.SIGTERM, 128 + signal.SIGTERM, False),  # CMD dies by SIGTERM: otel-forge exits 143
        ("exit:7", 7, 7, True),  # the kernel hands otel-forge's SIGTERM to a thread other than the main one
    ],
    ids=["cmd-handles-it", "cmd-dies-by-it", "handed-to-another-thread"],
)
def test_sigterm_is_forwarded_to_cmd_run_killed_and_exit_mirrored(
    mode, cmd_exit, forge_exit, to_a_thread, mlflow_server, client, tmp_path, background
) -> None:
    forge, record = _start_signal_child(mlflow_server, tmp_path, background, mode, unique("sigterm"))
    cmd = psutil.Process(_child_pid(forge))

    if to_a_thread:
        send_to_another_thread(forge.process.pid, signal.SIGTERM)
    else:
        forge.process.send_signal(signal.SIGTERM)  # to otel-forge only, as `kill PID` or a scheduler does
    code = forge.wait()

    # otel-forge did not die by the signal: it exited with CMD's code (a Popen of a process killed by
    # SIGTERM reads -15, not 143).
    assert code == forge_exit, forge.stderr()
    assert not cmd.is_running() or cmd.status() == psutil.STATUS_ZOMBIE
    if cmd_exit >= 0:
        assert record.read_text().split() == [str(int(signal.SIGTERM))]  # CMD got it, once
    assert "Traceback" not in forge.stderr()
    assert client.get_run(run_id_of(forge.stderr())).info.status == "KILLED"


def test_terminal_ctrl_c_reaches_cmd_once(mlflow_server, client, tmp_path, background) -> None:
    forge, record = _start_signal_child(mlflow_server, tmp_path, background, "exit:7", unique("sigint"))

    # Ctrl-C: the terminal sends SIGINT to every process of the foreground group, CMD included. Here
    # CMD first, then otel-forge, so the outcome does not hang on whose handler runs first (at the same
    # instant the two deliveries to CMD sometimes merge into one).
    os.kill(_child_pid(forge), signal.SIGINT)
    time.sleep(0.2)
    os.kill(forge.process.pid, signal.SIGINT)
    code = forge.wait()

    assert code == 7, forge.stderr()
    assert client.get_run(run_id_of(forge.stderr())).info.status == "KILLED"
    assert record.read_text().split() == [str(int(signal.SIGINT))]


def test_sigterm_right_after_the_run_opened_still_ends_run_and_cmd(mlflow_server, client, tmp_path) -> None:
    marker = f"otel-forge-test-{uuid.uuid4().hex}"
    forge = subprocess.Popen(
        [
            *FORGE_RUN,
            *server_options(mlflow_server.uri, unique("early-sigterm")),
            "--",
            sys.executable,
            "-c",
            f"import time; time.sleep(30)  # {marker}",
        ],
        cwd=tmp_path,
        env=forge_environ(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )

    def survivors() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            if marker in " ".join(process.info["cmdline"] or ()):
                found.append(process)
        return found

    try:
        # The run line, on stderr: printed once the run is open, before CMD starts.
        run_line = ""
        while not RUN_LINE.search(run_line) and (line := forge.stderr.readline()):
            run_line = line
        forge.send_signal(signal.SIGTERM)
        code = forge.wait(timeout=RUN_TIMEOUT_S)
        time.sleep(0.5)
        orphans = survivors()

        run_id = run_id_of(run_line)
        assert code >= 0, f"otel-forge was killed by signal {-code}"
        assert client.get_run(run_id).info.status == "KILLED"
        assert orphans == []
    finally:
        for process in survivors():
            process.kill()
        if forge.poll() is None:
            os.killpg(forge.pid, signal.SIGKILL)
            forge.wait()


# --- what CMD is told ----------------------------------------------------------------------------


def test_cmd_sees_the_launched_run_tracking_uri_and_experiment_id(mlflow_server, client, tmp_path) -> None:
    seen = tmp_path / "env.json"
    experiment = unique("env")
    result = run_forge(
        [
            *server_options(mlflow_server.uri, experiment),
            "--",
            sys.executable,
            str(SCRIPTS / "write_env.py"),
            str(seen),
        ],
        cwd=tmp_path,
        env=forge_environ(tmp_path),
    )

    assert result.returncode == 0, result.stderr
    env = json.loads(seen.read_text())
    run_id = run_id_of(result.stderr)
    run = client.get_run(run_id)
    assert env["OTEL_FORGE_LAUNCHED_RUN_ID"] == run_id
    # MLflow resumes it at CMD's first start_run(): the first run CMD opens is the launched run.
    assert env["MLFLOW_RUN_ID"] == run_id
    assert env["MLFLOW_TRACKING_URI"] == mlflow_server.uri
    assert env["MLFLOW_EXPERIMENT_ID"] == run.info.experiment_id
    assert client.get_experiment(run.info.experiment_id).name == experiment
    # otel-forge's own HTTP settings (one attempt per call) are not imposed on CMD.
    assert env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] is None
    assert env["MLFLOW_HTTP_REQUEST_TIMEOUT"] is None


# A Python CMD as it starts, and once it imported MLflow; then its first run (a plain log_metric).
STARTS_AT_ONCE = """
import json, os, sys
names = ("OTEL_FORGE_LAUNCHED_RUN_ID", "MLFLOW_RUN_ID")
at_start = {name: os.environ.get(name) for name in names}
import mlflow
after_import = {name: os.environ.get(name) for name in names}
mlflow.log_metric("loss", 0.5, step=3)
json.dump({"at_start": at_start, "after_import": after_import, "run": mlflow.active_run().info.run_id},
          open(sys.argv[1], "w"))
"""


def test_a_python_cmd_starts_as_the_run_opens_and_its_first_mlflow_run_is_the_job_run(
    mlflow_server, client, tmp_path
) -> None:
    script, seen = tmp_path / "starts.py", tmp_path / "seen.json"
    script.write_text(STARTS_AT_ONCE)
    experiment = unique("at-once")
    result = run_forge(
        [*server_options(mlflow_server.uri, experiment), "--", sys.executable, str(script), str(seen)],
        cwd=tmp_path,
        env=forge_environ(tmp_path),
    )

    assert result.returncode == 0, result.stderr
    run_id = run_id_of(result.stderr)
    told = json.loads(seen.read_text())
    # CMD did not wait for the run: it began while the run was still opening ...
    assert told["at_start"] == {"OTEL_FORGE_LAUNCHED_RUN_ID": "pending", "MLFLOW_RUN_ID": None}
    # ... and its MLflow import waited for it: the run CMD's first MLflow call opens is the job's.
    assert told["after_import"] == {"OTEL_FORGE_LAUNCHED_RUN_ID": run_id, "MLFLOW_RUN_ID": run_id}
    assert told["run"] == run_id
    assert steps_of(client, run_id, "loss") == [3]
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert beyond_announcements(result.stderr) == [], result.stderr
    assert not any(path.name == "run.json" for path in (tmp_path / "spool").rglob("*"))  # the notice is gone


def test_a_prometheus_port_in_use_is_said_before_a_python_cmd_that_would_start_at_once(mlflow_server, tmp_path) -> None:
    ran = tmp_path / "cmd-ran"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_forge(
            [
                "--tracking-uri", mlflow_server.uri, "--experiment", unique("port"), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(port), "--", sys.executable, "-c", f"open({str(ran)!r}, 'w')",
            ],
            cwd=tmp_path,
            env=forge_environ(tmp_path),
        )  # fmt: skip

    assert result.returncode == USAGE_ERROR, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"otel-forge: error: cannot serve Prometheus on 127.0.0.1:{port}"), line
    assert not ran.exists()  # CMD never started


def test_a_cmd_that_is_not_python_has_the_run_in_its_environment_from_its_start(
    mlflow_server, client, tmp_path
) -> None:
    seen = tmp_path / "run_id.txt"
    result = run_forge(
        [*server_options(mlflow_server.uri, unique("shell")), "--", "sh", "-c", f'printf %s "$MLFLOW_RUN_ID" > {seen}'],
        cwd=tmp_path,
        env=forge_environ(tmp_path),
    )

    assert result.returncode == 0, result.stderr
    assert seen.read_text() == run_id_of(result.stderr)  # a shell reads its environment once: the run is open


def test_cmd_inherits_the_users_mlflow_run_id_as_the_resumed_run(mlflow_server, client, tmp_path) -> None:
    seen = tmp_path / "env.json"
    experiment_id = client.create_experiment(unique("user-run-id"))
    given = client.create_run(experiment_id).info.run_id
    result = run_forge(
        [
            "--tracking-uri",
            mlflow_server.uri,
            "--no-prometheus",
            "--interval",
            INTERVAL,
            "--",
            sys.executable,
            str(SCRIPTS / "write_env.py"),
            str(seen),
        ],
        cwd=tmp_path,
        env=forge_environ(tmp_path, MLFLOW_RUN_ID=given),
    )

    assert result.returncode == 0, result.stderr
    assert run_id_of(result.stderr) == given  # otel-forge resumed it
    env = json.loads(seen.read_text())
    assert env["MLFLOW_RUN_ID"] == given
    assert env["OTEL_FORGE_LAUNCHED_RUN_ID"] == given
    assert env["MLFLOW_EXPERIMENT_ID"] == experiment_id


# --- the runs CMD starts itself: the first is the launched run, the others its children -----------

ALPHAS = {"0.1", "1.0", "10.0"}


def _sklearn_job(mlflow_server, tmp_path_factory, mode: str, *options: str) -> Launched:  # type: ignore[no-untyped-def]
    pytest.importorskip("sklearn")
    tmp = tmp_path_factory.mktemp(f"sklearn-{mode}")
    experiment = unique(f"sklearn-{mode}")
    result = run_forge(
        [
            *server_options(mlflow_server.uri, experiment),
            *options,
            "--",
            sys.executable,
            str(SCRIPTS / "sklearn_fits.py"),
            mode,
        ],
        cwd=tmp,
        env=forge_environ(tmp),
    )
    return Launched(result, run_id_of(result.stderr), tmp, experiment)


@pytest.fixture(scope="module")
def autolog_job(mlflow_server, tmp_path_factory) -> Launched:  # type: ignore[no-untyped-def]
    return _sklearn_job(mlflow_server, tmp_path_factory, "autolog")


@pytest.fixture(scope="module")
def start_run_job(mlflow_server, tmp_path_factory) -> Launched:  # type: ignore[no-untyped-def]
    return _sklearn_job(mlflow_server, tmp_path_factory, "start_run", "--tag", "mlflow.source.name=ridge-sweep")


def _assert_one_job_with_its_fits(client, job: Launched) -> list:  # type: ignore[no-untyped-def]
    """One run without a parent (the launched one, FINISHED, sampled, holding the first fit) and
    the two other fits inside it."""
    assert job.result.returncode == 0, job.result.stderr
    assert "Traceback" not in job.result.stderr
    experiment_id = client.get_experiment_by_name(job.experiment).experiment_id
    runs = client.search_runs([experiment_id])
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_id for r in top] == [job.run_id], [r.data.tags for r in runs]
    [launched] = top
    assert launched.info.status == "FINISHED"
    assert "system/cpu_utilization_percentage" in launched.data.metrics
    assert launched.data.params["alpha"] == "0.1"  # the first fit, beside the system metrics
    fits = [fit for fit in children_of(client, job.run_id) if "alpha" in fit.data.params]
    assert len(fits) == 2, [r.data.tags for r in runs]
    assert {fit.data.params["alpha"] for fit in fits} == ALPHAS - {"0.1"}
    assert {fit.info.status for fit in fits} == {"FINISHED"}
    return runs


def test_sklearn_autolog_first_fit_is_the_launched_run_the_next_two_its_children(autolog_job, client) -> None:
    runs = _assert_one_job_with_its_fits(client, autolog_job)
    assert len(runs) == 3
    for fit in runs:
        assert fit.data.params["fit_intercept"] == "True"  # autolog's, from the estimator
        assert fit.data.tags["estimator_name"] == "Ridge"


def test_start_run_per_fit_first_fit_is_the_launched_run_and_a_nested_run_keeps_its_parent(
    start_run_job, client
) -> None:
    runs = _assert_one_job_with_its_fits(client, start_run_job)
    [nested] = [r for r in runs if r.info.run_name == "nested-in-first-fit"]
    assert nested.data.tags["mlflow.parentRunId"] == start_run_job.run_id
    assert len(runs) == 4


def test_a_tag_given_to_otel_forge_wins_over_mlflows_context_tag(start_run_job, client) -> None:
    tags = client.get_run(start_run_job.run_id).data.tags
    assert tags["mlflow.source.name"] == "ridge-sweep"  # --tag, over ours and MLflow's
    assert tags["mlflow.user"] == getpass.getuser()  # MLflow's, where nothing of ours says otherwise
    assert tags["mlflow.source.type"] == "LOCAL"


def test_autolog_fits_name_the_script_as_their_launched_run_does(autolog_job, client) -> None:
    script = str(SCRIPTS / "sklearn_fits.py")
    assert client.get_run(autolog_job.run_id).data.tags["mlflow.source.name"] == script
    assert {fit.data.tags["mlflow.source.name"] for fit in children_of(client, autolog_job.run_id)} == {script}


# --- examples/train_with_trainingrun.py ------------------------------------------------------------


def _trainingrun_models(client, run):  # type: ignore[no-untyped-def]
    models = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    return {m.name: m for m in models if m.source_run_id == run.info.run_id}


EXAMPLE_PARAMS = {
    "steps": "50",
    "batch_size": "32",
    "optimizer.lr": "0.05",
    "optimizer.momentum": "0.9",
    "layers.0": "16",
    "layers.1": "16",
    "checkpoint_every": "25",
}


def _assert_trainingrun_example_logged(client, run) -> None:  # type: ignore[no-untyped-def]
    from mlflow.entities import LoggedModelStatus

    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/weight", "train/lr"):
        assert steps_of(client, run.info.run_id, key) == list(range(50)), key
    models = _trainingrun_models(client, run)
    base = run.info.run_name
    assert set(models) == {f"{base}-step-24", f"{base}-step-49"}, set(models)
    for step in (24, 49):
        model = models[f"{base}-step-{step}"]
        assert model.status == LoggedModelStatus.READY
        assert model.tags["mlflow.model.isExternal"] == "true"
        assert model.tags["otel_forge.checkpoint.step"] == str(step)
        assert Path(model.tags["otel_forge.checkpoint.path"], "weight.txt").is_file()


def test_trainingrun_example_run_directly(mlflow_server, client, tmp_path) -> None:
    experiment = unique("direct")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_with_trainingrun.py"), "--steps", "50"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=forge_environ(tmp_path, MLFLOW_TRACKING_URI=mlflow_server.uri, MLFLOW_EXPERIMENT_NAME=experiment),
    )

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "example-trainingrun"
    _assert_trainingrun_example_logged(client, run)
    assert run.data.params == EXAMPLE_PARAMS
    assert run.data.tags["mlflow.note.content"] == "otel_forge example"
    assert run.data.tags["example"] == "trainingrun"
    assert "config.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.fixture(scope="module")
def trainingrun_under_forge(mlflow_server, tmp_path_factory) -> Launched:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("trainingrun")
    experiment = unique("forge-trainingrun")
    # The interval also in the environment, which CMD inherits: its TrainingRun samples as often.
    env = forge_environ(tmp, MLFLOW_TRACKING_URI=mlflow_server.uri, OTEL_FORGE_SAMPLING_INTERVAL=INTERVAL)
    result = run_forge(
        [
            "--no-prometheus",
            "--interval",
            INTERVAL,
            "--experiment",
            experiment,
            "--",
            sys.executable,
            str(EXAMPLES / "train_with_trainingrun.py"),
            "--steps",
            "50",
        ],
        cwd=tmp,
        env=env,
    )
    return Launched(result, run_id_of(result.stderr), tmp, experiment)


def test_trainingrun_example_under_otel_forge_run_logs_into_its_run(trainingrun_under_forge, client) -> None:
    result = trainingrun_under_forge.result
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    run = client.get_run(trainingrun_under_forge.run_id)
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
    _assert_trainingrun_example_logged(client, run)
    assert any(key.startswith("system/") for key in run.data.metrics)


def test_trainingrun_example_under_otel_forge_run_records_its_config(trainingrun_under_forge, client) -> None:
    run = client.get_run(trainingrun_under_forge.run_id)
    assert run.data.params == EXAMPLE_PARAMS
    assert run.data.tags.get("mlflow.note.content") == "otel_forge example"
    assert "config.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_trainingrun_example_under_otel_forge_run_has_one_agent(trainingrun_under_forge, client) -> None:
    history = client.get_metric_history(trainingrun_under_forge.run_id, "system/cpu_utilization_percentage")
    per_step = collections.Counter(m.step for m in history)
    assert [step for step, n in sorted(per_step.items()) if n > 1] == []


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--"], "nothing to run"),
        ([], "nothing to run"),
        (["--interval", "0", "--", sys.executable, "-c", "pass"], "--interval"),
        (["--tag", "novalue", "--", sys.executable, "-c", "pass"], "--tag"),
        (["--", "/nonexistent/otel-forge-test-binary"], "/nonexistent/otel-forge-test-binary"),
    ],
    ids=["missing-command", "no-separator-no-command", "interval-zero", "tag-without-value", "no-such-executable"],
)
def test_bad_input_is_one_line_and_exit_2(args, named, mlflow_server, tmp_path) -> None:
    options = ["--tracking-uri", mlflow_server.uri, "--no-prometheus", "--experiment", unique("bad")]
    result = run_forge([*options, *args], cwd=tmp_path, env=forge_environ(tmp_path))

    assert result.returncode == USAGE_ERROR, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("otel-forge: error: "), lines[0]
    assert named in lines[0]
    assert "Traceback" not in result.stderr


# --- the embedded default: the README quick start --------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy's, from MLflow's sqlite store
def test_without_a_tracking_uri_the_run_lands_in_mlflow_db_of_the_working_directory(tmp_path) -> None:
    from mlflow import MlflowClient

    work = tmp_path / "work"
    work.mkdir()
    # README: `otel-forge run -- python examples/train_with_trainingrun.py --steps 200`, no server.
    result = run_forge(
        [
            "--no-prometheus",
            "--interval",
            INTERVAL,
            "--",
            sys.executable,
            str(EXAMPLES / "train_with_trainingrun.py"),
            "--steps",
            "200",
        ],
        cwd=work,
        env=forge_environ(tmp_path),
    )

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    database = work / "mlflow.db"
    assert database.is_file()
    assert RUN_LINE.search(result.stderr).group(3) == f"sqlite:///{database}"
    local = MlflowClient(f"sqlite:///{database}")
    run = local.get_run(run_id_of(result.stderr))
    assert run.info.status == "FINISHED"
    assert steps_of(local, run.info.run_id, "train/loss") == list(range(200))
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert len(_trainingrun_models(local, run)) == 8  # a checkpoint every 25 steps


# --- no server ---------------------------------------------------------------------------------------


def test_a_job_whose_server_never_answered_says_so_last_and_its_replay_keeps_the_scripts_run_name(
    mlflow_server, client, tmp_path
) -> None:
    experiment = unique("never-answered")
    down = f"http://127.0.0.1:{free_port()}"
    env = forge_environ(
        tmp_path,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
        OTEL_FORGE_CALL_DEADLINE="1",
        OTEL_FORGE_START_WAIT="2",
        OTEL_FORGE_DRAIN_DEADLINE="2",
    )
    example = [sys.executable, str(EXAMPLES / "train_with_trainingrun.py"), "--steps", "20"]
    result = run_forge(
        ["--tracking-uri", down, "--no-prometheus", "--interval", INTERVAL, "--experiment", experiment, "--", *example],
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    # The script says where its run will be, not None; the job's last line says nothing was delivered.
    assert f"MLflow run 'example-trainingrun' in experiment {experiment}, once otel-forge replay" in result.stdout
    last = result.stderr.splitlines()[-1]
    found = re.fullmatch(
        rf"otel-forge: nothing reached MLflow at {down}: (\d+) value\(s\) and (\d+) system-metrics window\(s\) "
        r"are kept in (\S+); otel-forge replay (\S+) delivers them",
        last,
    )
    assert found and found.group(3) == found.group(4), last
    assert int(found.group(1)) == 20 * 3  # the example logs 3 values a step
    assert int(found.group(2)) >= 1
    replayed = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "replay", found.group(3), "--tracking-uri", mlflow_server.uri],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.run_name == "example-trainingrun"  # the name the script gave, as online
    assert run.info.status == "FINISHED"
    assert steps_of(client, run.info.run_id, "train/loss") == list(range(20))


def test_server_down_at_start_cmd_still_runs_and_its_exit_code_is_returned(tmp_path) -> None:
    seen = tmp_path / "env.json"
    # Credentials in the URI: they must not reach a message.
    uri = f"http://forge-user:s3cr3t-token@127.0.0.1:{free_port()}"
    result = run_forge(
        [
            "--tracking-uri",
            uri,
            "--no-prometheus",
            "--interval",
            INTERVAL,
            "--",
            sys.executable,
            str(SCRIPTS / "write_env.py"),
            str(seen),
            "5",
        ],
        cwd=tmp_path,
        env=forge_environ(
            tmp_path,
            MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
            # The refusal is seen once the opener has imported MLflow: on a loaded machine, past a 2 s
            # start wait (the line then said the wait ran out). It costs nothing here: CMD starts at once.
            OTEL_FORGE_CALL_DEADLINE="5",
            OTEL_FORGE_START_WAIT="5",
            OTEL_FORGE_DRAIN_DEADLINE="2",
        ),
    )

    assert result.returncode == 5, result.stderr
    assert "cmd ran" in result.stdout
    assert "Traceback" not in result.stderr
    assert "MLflow logging disabled" not in result.stderr  # an outage, waited for, not a reason to give up
    # A line at the start: what the run would have held is kept for `otel-forge replay`; one at the end:
    # nothing reached the server, what waits where, the command that delivers it.
    said, ended = result.stderr.splitlines()
    assert said.startswith("otel-forge: MLflow at http://127.0.0.1:") and "does not answer: connection refused" in said
    job_dir = Path(said.rsplit("otel-forge replay ", 1)[1].removesuffix(" delivers it"))
    assert ended.startswith("otel-forge: nothing reached MLflow at http://127.0.0.1:"), ended
    assert ended.endswith(f"are kept in {job_dir}; otel-forge replay {job_dir} delivers them"), ended
    kept = sorted(path.name.split("-")[0] for path in job_dir.iterdir())
    assert kept == ["journal", "pending"], kept  # the run's journal (its description and end); the node's windows
    assert "s3cr3t-token" not in result.stderr + result.stdout
    cmd_env = json.loads(seen.read_text())
    assert cmd_env["MLFLOW_RUN_ID"] is None  # no experiment named: the first run CMD opens is the job's
    assert cmd_env["OTEL_FORGE_LAUNCHED_RUN_ID"] == "script"
