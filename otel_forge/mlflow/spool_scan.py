"""Which spools a directory holds, and which of them ended processes left: a scan of headers only,
so a process that starts (the node agent, ``otel-forge run``) looks for leftovers without importing the
delivery (``replay``) unless there is something to deliver."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from otel_forge.mlflow.spool_files import HEADER, writer_alive
from otel_forge.mlflow.training.run_journal import is_journal, read_header


def spools_in(path: Path) -> list[Path]:
    """``path`` if it is a spool, else the spools in it (a job's directory, ``otel-forge run``'s): the
    journals first, the launcher's before its command's (it opens the job's run, which the others
    then find), then the windows."""
    if (path / HEADER).exists():
        return [path]
    found = sorted(header.parent for header in path.glob(f"*/{HEADER}"))
    return sorted(found, key=lambda spool: (not is_journal(spool), not is_launchers_journal(spool)))


def left_in(root: Path) -> list[Path]:
    """What earlier processes left under the spool root: its spools and job directories whose
    writers have all ended, oldest first (a spool a running process writes is its own)."""
    if not root.is_dir():
        return []
    left: dict[Path, float] = {}  # entry -> when its oldest spool was made
    for entry in root.iterdir():
        spools = spools_in(entry) if entry.is_dir() else []
        if spools and not any(writer_alive(_header(spool)) for spool in spools):
            with contextlib.suppress(OSError):  # delivered by another process meanwhile: not left
                left[entry] = min((spool / HEADER).stat().st_mtime for spool in spools)
    return sorted(left, key=left.__getitem__)


def _header(spool: Path) -> dict[str, Any]:
    try:
        return read_header(spool)
    except (OSError, ValueError):
        return {}


def is_launchers_journal(path: Path) -> bool:
    return is_journal(path) and read_header(path).get("launcher", False)
