"""The spool under bad conditions: a directory that cannot be written, a full spool, a corrupt or
foreign file in a spool being replayed. One warning each, nothing blocked, every drop counted;
spool files readable by their owner only."""

from __future__ import annotations

import json
import logging
import stat
import subprocess
import sys
import threading
from pathlib import Path

import otel_forge
from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
from otel_forge.mlflow.system_metrics.windows import Window
from testkit.hermetic import hermetic_environ
from testkit.servers import free_port, wait_for

NOWHERE = "http://127.0.0.1:{port}"  # a refused port: every delivery fails, windows spill


def _monitor_into_nowhere(spool_dir: Path, **settings):  # type: ignore[no-untyped-def]
    return otel_forge.monitor(
        in_process=True,
        run_id="0" * 32,
        tracking_uri=NOWHERE.format(port=free_port()),
        node_id="node_0",
        sampling_interval=0.05,
        prometheus=False,
        collectors=("memory",),
        spool_dir=str(spool_dir),
        drain_deadline_s=0.2,
        **settings,
    )


def _thread_errors(monkeypatch) -> list[BaseException]:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


def _warnings(caplog, words: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and words in r.getMessage()]


def test_an_unwritable_spool_warns_once_and_counts_what_it_drops(tmp_path, caplog, monkeypatch) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge")
    errors = _thread_errors(monkeypatch)
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monitor = _monitor_into_nowhere(not_a_directory / "spool", queue_size=2)
    try:
        wait_for(lambda: monitor.exporter.delivery_counts()["dropped"] >= 5, 20, 0.05, "windows dropped")
    finally:
        monitor.stop()

    assert errors == []
    warned = _warnings(caplog, "cannot write the spool")
    assert len(warned) == 1 and "OTEL_FORGE_SPOOL_DIR" in warned[0], caplog.text
    assert monitor.exporter.delivery_counts()["dropped"] >= 5


def test_a_full_spool_warns_once_then_counts(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge")
    monitor = _monitor_into_nowhere(tmp_path / "spool", queue_size=2, spool_max_bytes=600)
    try:
        wait_for(lambda: monitor.exporter.delivery_counts()["dropped"] >= 10, 20, 0.05, "windows dropped")
    finally:
        monitor.stop()
    warned = _warnings(caplog, "is full")
    assert len(warned) == 1 and "OTEL_FORGE_SPOOL_MAX_BYTES" in warned[0], caplog.text


def test_spool_files_are_readable_by_their_owner_only(tmp_path) -> None:
    monitor = _monitor_into_nowhere(tmp_path / "spool", queue_size=1)
    try:
        wait_for(lambda: monitor.exporter.delivery_counts()["spooled"] >= 2, 20, 0.05, "windows spooled")
    finally:
        monitor.stop()
    directory = monitor.exporter.spool.path
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = list(directory.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), [
        (f.name, oct(f.stat().st_mode)) for f in files
    ]


def test_replay_sets_a_corrupt_or_foreign_file_aside_and_delivers_the_rest(client, experiment_id, tmp_path) -> None:
    run_id = client.create_run(experiment_id).info.run_id
    spool = WindowSpool(
        tmp_path / "spool",
        1 << 20,
        header={"run_id": run_id, "node_id": "node_0", "prefix": "system/node_0/", "first_step": 0},
    )
    for index in range(4):
        assert spool.append(Window(index, 1_700_000_000_000 + index, (("system/node_0/x", float(index)),)))
    files = sorted((tmp_path / "spool").glob("*.window.json"))
    files[1].write_text("{ not json")
    files[2].write_text(json.dumps({"something": "else"}))

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_forge.cli",
            "replay",
            str(tmp_path / "spool"),
            "--tracking-uri",
            client.tracking_uri,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=hermetic_environ(),
        stdin=subprocess.DEVNULL,
        check=False,
    )

    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "delivered 2 window(s)" in result.stdout
    assert files[1].name in result.stderr and files[2].name in result.stderr
    assert "Traceback" not in result.stderr
    history = client.get_metric_history(run_id, "system/node_0/x")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (3, 3.0)]
    assert sorted(p.name for p in (tmp_path / "spool").glob("*.corrupt")) == [f.name + ".corrupt" for f in files[1:3]]


def test_a_clock_step_does_not_make_a_live_writer_look_gone() -> None:
    """A spool's writer is named by pid and start time. The start time in seconds since the epoch
    moves when the system clock is stepped (psutil adds the boot time as the clock says it now): a
    delivery that took the live writer for dead would end its run KILLED and take its spool."""
    from otel_forge.mlflow.spool_files import writer_alive

    code = (
        "import json, time; from otel_forge.mlflow.spool_files import writer_identity; "
        "print(json.dumps(writer_identity()), flush=True); time.sleep(60)"
    )
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=hermetic_environ())
    try:
        header = json.loads(writer.stdout.readline())  # type: ignore[union-attr]
        assert writer_alive(header)
        stepped = {**header, "started": header["started"] - 1.0}  # as read after a 1 s clock step
        assert writer_alive(stepped)
        assert writer_alive({k: v for k, v in stepped.items() if k != "started_since_boot"})  # an older header
        if "started_since_boot" in header:
            assert not writer_alive({**header, "started_since_boot": header["started_since_boot"] + 0.5})
        assert not writer_alive({**header, "started": header["started"] - 60, "started_since_boot": None})
    finally:
        writer.kill()
        writer.wait()
    assert not writer_alive(header)
