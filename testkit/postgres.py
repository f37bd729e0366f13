"""A throwaway PostgreSQL cluster on 127.0.0.1 behind ``mlflow server`` (the fleet test and bench): the
Debian package's ``initdb`` and ``pg_ctl`` (from PATH or ``/usr/lib/postgresql/<version>/bin``), a
cluster in a temp dir on a free port, run as user ``postgres`` when the caller is root."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from testkit.servers import free_port

_DEBIAN_BIN = Path("/usr/lib/postgresql")


def _tool(name: str) -> str | None:
    """PostgreSQL's ``name`` (Debian keeps it off PATH, under its version's directory)."""
    found = shutil.which(name)
    if found is None:
        versions = sorted(
            _DEBIAN_BIN.glob(f"*/bin/{name}"), key=lambda path: int(path.parts[-3]) if path.parts[-3].isdigit() else 0
        )
        found = str(versions[-1]) if versions else None
    return found


class Postgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (as user ``postgres`` when the bench runs as root)."""

    def __init__(self, driver: str | None = None) -> None:
        self.driver_name = driver or self.driver()
        self.root = Path(tempfile.mkdtemp(prefix="fleet-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.pid: int | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    @staticmethod
    def unavailable() -> str | None:
        """Why PostgreSQL cannot run here, else None."""
        missing = [tool for tool in ("initdb", "pg_ctl") if _tool(tool) is None]
        if missing:
            where = "on PATH or in /usr/lib/postgresql/*/bin: apt-get install postgresql"
            return f"{' and '.join(missing)} not found ({where})"
        if Postgres.driver() is None:
            return (
                "neither psycopg nor psycopg2 is importable (`pip install 'psycopg[binary]'`): mlflow server "
                "needs one to reach PostgreSQL"
            )
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                return "running as root and no runuser to run PostgreSQL as another user"
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                return "running as root and there is no 'postgres' user to run PostgreSQL as"
        return None

    @staticmethod
    def driver() -> str | None:
        """The PostgreSQL driver to name in the store URI: psycopg 3 where it is installed, as docs/fleet.md
        advises (SQLAlchemy 2.1's default for ``postgresql://``; it pipelines and prepares the per-key
        UPDATEs of MLflow's ``log_batch``), else psycopg2."""
        return next((name for name in ("psycopg", "psycopg2") if importlib.util.find_spec(name) is not None), None)

    def _run(self, *command: str) -> None:
        done = subprocess.run(
            [*self._as, *command],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
            cwd=self.root,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {(done.stdout + done.stderr)[-2000:]}")

    def start(self) -> Postgres:
        self._run(
            _tool("initdb") or "initdb",
            "-D",
            str(self.data),
            "-U",
            "mlflow",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c max_connections=200"
        self._run(
            _tool("pg_ctl") or "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "postgres.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        return self

    def create_database(self, name: str) -> str:
        """A fresh database; its store URI."""
        driver = self.driver_name or "psycopg2"
        module = importlib.import_module(driver)
        connection = module.connect(host="127.0.0.1", port=self.port, user="mlflow", dbname="postgres")
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {name}")
        finally:
            connection.close()
        return f"postgresql+{driver}://mlflow@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.pid is not None:
            try:
                self._run(_tool("pg_ctl") or "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
            except (RuntimeError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            self.pid = None
        shutil.rmtree(self.root, ignore_errors=True)
