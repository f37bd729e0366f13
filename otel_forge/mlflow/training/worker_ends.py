"""Which worker failed a job that ``otel-forge run`` launched through a launcher (torchrun).

The wrapper runs the launcher, not a rank: when the launcher fails, its own rank says nothing of
which worker raised (torchrun stops the others with SIGTERM and exits 1; its report goes to the
terminal). Each worker under ``otel-forge run`` that raises an exception nobody caught writes one
small file, ``<job directory>/worker-ends/<rank>.json``, from ``sys.excepthook`` (chained: the
traceback is printed as before); the wrapper names the first that failed, or "a worker".

MLflow imports ``run_context`` (which installs the hook) in every worker that uses it, and this
module must therefore never raise and import nothing heavy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from otel_forge.config import env_name
from otel_forge.node import TORCHRUN_RESTART_COUNT_VAR

_logger = logging.getLogger(__name__)

ENDS_DIR = "worker-ends"
UNKNOWN_WORKER = "a worker"  # the outcome when no worker said it failed


def install_failure_record(environ: Mapping[str, str] | None = None) -> bool:
    """In a worker of a launcher under ``otel-forge run`` (``RANK`` and the job's directory set):
    an uncaught exception records this rank's failure before Python prints it. True if installed."""
    environ = os.environ if environ is None else environ
    rank, job_dir = environ.get("RANK", ""), environ.get(env_name("spool_dir"), "")
    if not rank.isdigit() or not job_dir:
        return False
    previous = sys.excepthook

    def record_then_report(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            attempt = environ.get(TORCHRUN_RESTART_COUNT_VAR, "0")
            _write(
                Path(job_dir) / ENDS_DIR,
                int(rank),
                int(attempt) if attempt.isdigit() else 0,
                f"{kind.__name__}: {error}"[:300],
            )
        previous(kind, error, trace)

    sys.excepthook = record_then_report
    return True


def _write(directory: Path, rank: int, attempt: int, error: str) -> None:
    end = {"rank": rank, "attempt": attempt, "error": error, "time": time.time()}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{attempt}-{rank}.json").write_text(json.dumps(end))
    except OSError:
        pass  # the outcome then says "a worker": never a second error on the way out


def take_failed_worker(job_dir: Path) -> str:
    """``rank N`` of the worker that failed first in the launcher's last attempt that had a failure
    (torchrun restarts), as the workers recorded it; else ``a worker``. The records are removed."""
    ends = []
    directory = job_dir / ENDS_DIR
    for path in sorted(directory.glob("*.json")):
        try:
            end = json.loads(path.read_text())
            ends.append((-int(end["attempt"]), float(end["time"]), int(end["rank"])))
            path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            _logger.debug("unreadable worker end %s", path)
    with contextlib.suppress(OSError):
        directory.rmdir()
    return f"rank {min(ends)[2]}" if ends else UNKNOWN_WORKER
