"""A small disk for the tests of a full one: a tmpfs of its own, mounted for the test and removed after;
a read-only one (``read_only_disk``); one that turns read-only under the writers it has, as ext4 does
on an error with ``errors=remount-ro`` (``failing_disk``).

Mounting needs root (as on CI); elsewhere the test is skipped with that reason.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_disk(where: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (made if missing), unmounted on the way out."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def read_only_disk(where: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs at ``where``, remounted read-only before anything is written: every write is EROFS,
    root's too (a mode of 0500 does not stop root)."""
    with small_disk(where, size) as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        yield disk


class FailingDisk:
    """An ext4 file system on a loop device (``errors=remount-ro``) mounted at ``where``; ``fail()``
    raises an error in it (``/sys/fs/ext4/<dev>/trigger_fs_error``), as a failing disk would: the
    kernel remounts it read-only under the files open on it, and every write after is EROFS. A tmpfs
    cannot do this: ``mount -o remount,ro`` refuses while a file is open for writing (EBUSY)."""

    def __init__(self, where: Path, device: str) -> None:
        self.where = where
        self.device = device

    def fail(self) -> None:
        trigger = Path("/sys/fs/ext4") / Path(self.device).name / "trigger_fs_error"
        trigger.write_text("otel-forge test: the disk failed\n")

    def read_only(self) -> bool:
        with open("/proc/mounts") as mounts:
            options = [line.split()[3] for line in mounts if line.split()[1] == str(self.where)]
        # Newer kernels keep "rw" and add "emergency_ro" (ext4's shutdown state); older ones say "ro".
        return bool(options) and bool({"ro", "emergency_ro"} & set(options[-1].split(",")))


@contextlib.contextmanager
def failing_disk(where: Path, image: Path, size_mib: int = 16) -> Iterator[FailingDisk]:
    """A ``FailingDisk`` of ``size_mib`` MiB at ``where``, its image in the file ``image``; unmounted
    (and its loop device freed) on the way out."""
    where.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as file:
        file.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(where)], check=True)
    try:
        with open("/proc/mounts") as mounts:
            device = next(line.split()[0] for line in mounts if line.split()[1] == str(where))
        os.chmod(where, 0o700)
        yield FailingDisk(where, device)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)  # the loop device goes with it (autoclear)
        image.unlink(missing_ok=True)


def can_fail_a_disk() -> bool:
    """Root, a loop device and ext4's error trigger: what ``failing_disk`` needs."""
    return can_mount() and Path("/dev/loop-control").exists() and Path("/sys/fs/ext4").is_dir()


def can_mount() -> bool:
    return os.geteuid() == 0


def fill(disk: Path) -> Path:
    """A file that takes every free byte of ``disk``; removing it frees them."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return filler
