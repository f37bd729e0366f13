"""``otel-forge run``'s side of a job whose script names the experiment (``script_run``): CMD starts
with no run; the run CMD's process makes is adopted, else ours opens in the default experiment."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.script_run import ScriptRun
from otel_forge.node import NodeIdentity


def script_names_experiment(experiment: str | None, config: ForgeConfig, node: NodeIdentity) -> bool:
    """Nothing names the experiment but the script, and the job is this node's alone: its run
    opens once the script names one (the other nodes of a larger job look for it in theirs)."""
    named = experiment or config.experiment_name or config.experiment_id or config.run_id
    return not named and (node.node_count or 1) <= 1


def script_run_of(training_run: Any, spool: Path) -> ScriptRun:
    """The job's record in its directory, by its key (one made up for a job its launcher names none)."""
    if (key := training_run.node.job_key) is None:
        key = f"otel-forge-{uuid.uuid4().hex}"
        training_run.adopt_job_key(key, "otel-forge run (the experiment the script names)")
    return ScriptRun(spool, key)


class ScriptRunWatch:
    """Where the script names the experiment, the job's run opens once CMD's process publishes the
    run it made, or when a process of CMD asks for it (``job_run_id()``), or after ``wait_s`` if CMD
    has not imported MLflow (a script that names none: ours, in the default experiment); else at
    CMD's end (``finish``)."""

    _POLL_S = 0.1

    def __init__(self, script: ScriptRun, training_run: Any, wait_s: float) -> None:
        self._script = script
        self._training_run = training_run
        self._open_after = time.monotonic() + wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otel-forge-script-run", daemon=True)

    def start(self) -> ScriptRunWatch:
        self._thread.start()
        return self

    def finish(self) -> None:
        """Open the run now if it is not (a run opened meanwhile stays), and wait for it a while:
        the node's last windows and CMD's values go to it."""
        self._stop.set()
        self._thread.join()
        self._training_run.open_script_run(self._script)
        self._training_run.wait_open(self._training_run.start_wait_s)

    def _run(self) -> None:
        while not self._stop.wait(self._POLL_S):
            if self._due():
                self._training_run.open_script_run(self._script)
                return

    def _due(self) -> bool:
        script = self._script
        if script.published() is not None or script.asked():
            return True
        if script.claimed() is not None:
            return False  # a process of CMD is opening it: its publication follows
        return time.monotonic() >= self._open_after and not script.mlflow_imported()
