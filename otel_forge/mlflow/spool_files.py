"""Where spools live and how their files are written: a directory per spool under one root,
``spool.json`` its header, each file written whole (temp file + rename) and readable by its owner
only (spools may name hosts and runs). Shared by the system-metrics window spool and the training
spool, which ``otel-forge replay`` and ``doctor`` read."""

from __future__ import annotations

import os
from pathlib import Path

HEADER = "spool.json"
STATS = "stats.json"


def default_spool_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "otel-forge" / "spool"


def write_atomically(path: Path, text: str) -> None:
    """Write whole or not at all: a crash loses at most the file being written."""
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(temporary, path)
