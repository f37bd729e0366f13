"""State directories on a shared machine: the writer locks and the spools live only in directories
of the user's own (created 0700, never a symlink, never another user's), and a planted symlink never
makes us truncate or write its target. Another user is played by uid 65534 (``nobody``): its
directories are made here and chowned to it, and where a real second process is needed (one that
holds a flock), it runs under ``setpriv``. Fast: no MLflow server."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_forge.mlflow.spool_files import default_spool_root
from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
from otel_forge.mlflow.system_metrics.windows import Window
from otel_forge.mlflow.system_metrics.writer_lock import NodeWriterLock
from otel_forge.mlflow.training.run_journal import RunJournal

ATTACKER = 65534  # nobody
RUN = "a" * 32
PREFIX = "system/node_0/"
PRECIOUS = "root's secret\n"
WINDOW = Window(0, 1_700_000_000_000, (("system/node_0/x", 1.0),))

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="chowning to another uid needs root")


@pytest.fixture
def shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory like /tmp (root's, 1777, reachable by every uid) as the temporary directory;
    no XDG_RUNTIME_DIR; umask 022, so a directory made without an explicit mode is 0755.
    (``tmp_path`` is made first: pytest makes it under the temporary directory.)"""
    base = Path(tempfile.mkdtemp(prefix="otel-forge-test-", dir="/tmp"))
    base.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    old_umask = os.umask(0o022)
    try:
        yield base
    finally:
        os.umask(old_umask)
        shutil.rmtree(base, ignore_errors=True)


def _victim_file(directory: Path) -> Path:
    """A root-owned 0600 file the attacker cannot write, but would like us to."""
    victim = directory / "victim"
    victim.write_text(PRECIOUS)
    victim.chmod(0o600)
    return victim


def _attacker_dir(path: Path, mode: int = 0o777) -> Path:
    path.mkdir()
    path.chmod(mode)
    os.chown(path, ATTACKER, ATTACKER)
    return path


def _attacker_symlink(link: Path, target: Path) -> None:
    link.symlink_to(target)
    os.lchown(link, ATTACKER, ATTACKER)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if not p.is_dir()]


# --- the writer lock -------------------------------------------------------------------------


@pytest.mark.parametrize("directory_owner", ["attacker", "user"])
def test_a_symlink_planted_at_the_lock_path_never_truncates_its_target(
    shared_tmp: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, directory_owner: str
) -> None:
    victim = _victim_file(tmp_path)
    lock = NodeWriterLock(RUN, PREFIX)
    if directory_owner == "attacker":  # the attacker got to /tmp/otel-forge-<uid> first
        _attacker_dir(_attacker_dir(lock.path.parent.parent) / "writers")
    else:  # our own directories (an older version left them open), the symlink planted in them
        lock.path.parent.mkdir(parents=True)
    _attacker_symlink(lock.path, victim)

    assert lock.acquire() is True  # the node still writes, without the single-writer check
    lock.release()

    assert victim.read_text() == PRECIOUS
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert lock.path.is_symlink()  # not followed, not replaced
    assert len(_warnings(caplog)) == 1, caplog.text


def test_another_users_0777_directory_at_the_lock_path_is_refused_once_and_never_used(
    shared_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    planted = _attacker_dir(shared_tmp / f"otel-forge-{os.getuid()}")
    locks = [NodeWriterLock(RUN, PREFIX), NodeWriterLock("b" * 32, PREFIX)]

    assert [lock.acquire() for lock in locks] == [True, True]  # neither stands down

    assert list(planted.iterdir()) == []
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert str(planted) in warned[0] and f"owned by uid {ATTACKER}" in warned[0]
    assert "without the one-writer-per-node check" in warned[0]


def test_a_symlinked_lock_directory_is_refused(
    shared_tmp: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    _attacker_symlink(shared_tmp / f"otel-forge-{os.getuid()}", elsewhere)

    assert NodeWriterLock(RUN, PREFIX).acquire() is True

    assert list(elsewhere.iterdir()) == []
    warned = _warnings(caplog)
    assert len(warned) == 1 and "symlink" in warned[0], warned


def test_the_lock_directories_are_created_0700_and_still_keep_one_writer(
    shared_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = NodeWriterLock(RUN, PREFIX), NodeWriterLock(RUN, PREFIX)

    assert first.acquire() is True
    assert second.acquire() is False  # the same node's second agent stands down
    writers = first.path.parent
    assert writers == shared_tmp / f"otel-forge-{os.getuid()}" / "writers"
    assert [oct(stat.S_IMODE(d.lstat().st_mode)) for d in (writers.parent, writers)] == ["0o700", "0o700"]
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
    assert first.path.read_text() == str(os.getpid())
    first.release()
    assert second.acquire() is True
    second.release()
    assert _warnings(caplog) == []


def test_xdg_runtime_dir_is_preferred_for_the_locks_when_it_is_private(
    shared_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    lock = NodeWriterLock(RUN, PREFIX)
    assert lock.acquire() is True
    assert lock.path.parent == runtime / "otel-forge" / "writers"
    lock.release()

    runtime.chmod(0o777)  # not as its spec says: not used, the temporary directory is
    assert NodeWriterLock(RUN, PREFIX).path.parent == shared_tmp / f"otel-forge-{os.getuid()}" / "writers"


def test_another_user_holding_the_flock_on_a_planted_lock_file_does_not_make_us_stand_down(
    shared_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if not (shutil.which("setpriv") and shutil.which("flock")):
        pytest.skip("setpriv and flock (util-linux) run the second user's process")
    lock = NodeWriterLock(RUN, PREFIX)
    script = f'umask 0; mkdir -p "{lock.path.parent}" && exec flock -x "{lock.path}" sh -c "echo locked; exec sleep 30"'
    attacker = subprocess.Popen(
        ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: flock's child holds the lock too, and is ended with it
    )
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "locked"
        assert lock.path.stat().st_uid == ATTACKER

        assert lock.acquire() is True
    finally:
        os.killpg(attacker.pid, signal.SIGKILL)
        attacker.wait(10)
    warned = _warnings(caplog)
    assert len(warned) == 1 and f"owned by uid {ATTACKER}" in warned[0], warned


# --- the spools -------------------------------------------------------------------------------


def test_a_spool_root_of_another_user_is_refused_and_a_planted_symlink_not_written_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    victim = _victim_file(tmp_path)
    root = _attacker_dir(tmp_path / "shared-spool")
    spool_dir = _attacker_dir(root / "run-node_0-1")
    planted = ["100000000000.window.json.tmp", "spool.json.tmp"]  # the temporary names a spool writes
    for name in planted:
        _attacker_symlink(spool_dir / name, victim)
    spool = WindowSpool(spool_dir, 1 << 20, header={"run_id": RUN})

    assert spool.append(WINDOW) is False
    assert spool.append(WINDOW) is False

    assert victim.read_text() == PRECIOUS
    assert sorted(p.name for p in spool_dir.iterdir()) == planted
    warned = _warnings(caplog)
    assert len(warned) == 1 and f"owned by uid {ATTACKER}" in warned[0] and "OTEL_FORGE_SPOOL_DIR" in warned[0], warned


def test_a_symlinked_spool_root_is_refused_for_windows_and_training_spools(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    root = tmp_path / "spool"
    _attacker_symlink(root, elsewhere)

    assert WindowSpool(root / "run-node_0-1", 1 << 20).append(WINDOW) is False
    with pytest.raises(OSError, match="symlink"):
        RunJournal(root / "run-journal-1", "http://127.0.0.1:5000")

    assert _files_under(elsewhere) == []
    assert list(elsewhere.iterdir()) in ([], [elsewhere / "run-journal-1"])  # see the report: an empty dir at most
    warned = _warnings(caplog)
    assert len(warned) == 1 and all("symlink" in line for line in warned), warned


def test_a_world_writable_spool_root_needs_the_sticky_bit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)  # anyone could rename our spool away and put theirs in its place
    sticky_root = tmp_path / "sticky"
    sticky_root.mkdir()
    sticky_root.chmod(0o1777)  # as /tmp: what we create there stays ours

    assert WindowSpool(open_root / "run-node_0-1", 1 << 20).append(WINDOW) is False
    assert WindowSpool(sticky_root / "run-node_0-1", 1 << 20).append(WINDOW) is True

    assert list(open_root.iterdir()) == []
    warned = _warnings(caplog)
    assert len(warned) == 1 and "world-writable without the sticky bit" in warned[0], warned
    assert stat.S_IMODE((sticky_root / "run-node_0-1").stat().st_mode) == 0o700


def test_the_default_spool_root_and_spools_are_created_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old_umask = os.umask(0o022)
    try:
        root = default_spool_root()
        spool = WindowSpool(root / "run-node_0-1", 1 << 20, header={"run_id": RUN})
        assert spool.append(WINDOW) is True
    finally:
        os.umask(old_umask)

    assert [oct(stat.S_IMODE(d.stat().st_mode)) for d in (root, spool.path)] == ["0o700", "0o700"]
    files = list(spool.path.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert json.loads((spool.path / "spool.json").read_text())["run_id"] == RUN
    assert _warnings(caplog) == []
