"""Which run is the job's: the one asked for (an explicit id, the run ``otel-forge run`` opened),
else the one the job key names, else a new one that this process makes and publishes under the
key. Only global rank 0 makes a run; every other process finds the job's run and never reads it
(its size must not cost every node)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from otel_forge.config import ConfigError
from otel_forge.mlflow.client import RunGone, TrackingClient, classify, live_run, run_gone
from otel_forge.mlflow.delivery.retry import Outcome
from otel_forge.mlflow.training.outcome import begin_attempt
from otel_forge.mlflow.training.rendezvous import (
    create_experiment,
    find_experiment,
    publish,
    published_run_id,
    wait_for_run,
)
from otel_forge.mlflow.training.run_metadata import DESCRIBED_TAG
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.training.run_plan import is_remote
from otel_forge.mlflow.training.run_source import RunSource
from otel_forge.mlflow.training.run_state import RunEvent, RunState
from otel_forge.mlflow.training.script_run import ScriptRun
from otel_forge.node import NodeIdentity
from otel_forge.scrub import error_line, uri_without_credentials

_logger = logging.getLogger(__name__)

_ADOPT_POLL_S = 0.05


class MissingRun(LookupError):
    """The run id names no run at all (deleted runs are replaced; a mistyped id is not)."""


def transient_open_error(error: BaseException, tracking_uri: str) -> bool:
    """An outage of a tracking server, worth waiting through for the run; a missing run, a bad setting
    and a local store's errors are not (but a store another process holds locked)."""
    if isinstance(error, (MissingRun, ConfigError)) or classify(error) is not Outcome.RETRY:
        return False
    return is_remote(tracking_uri) or "database is locked" in str(error)


@dataclass(frozen=True)
class JobRunRequest:
    """What names the job's run, as the process asking for it knows it."""

    tracking_uri: str
    experiment: str  # name, or id (all digits)
    experiment_id: str | None  # given (MLFLOW_EXPERIMENT_ID): a process that never reads the run says it so
    source: RunSource
    run_name: str | None
    samples_node: bool  # this process samples its node into the run: say so when none can be found
    late_after_s: float  # when a process waiting for rank 0's run says it still waits
    # Another process of the job claimed the run where the script names the experiment: its
    # publication names the run (script_run.py).
    adopts: ScriptRun | None = None


class OpenWaits(Protocol):
    """What the thread that opens the run waits on: the run's ``RunStateMachine``."""

    @property
    def left(self) -> bool:
        """Closing gave up on the opener: stop waiting, make no new run."""

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds``; True, and at once, when the opener is left or rank 0 became known."""

    def fire(self, event: RunEvent) -> RunState: ...


class JobRunFinder:
    """Finds or makes the job's run (``open``), on the thread that opens it; a wait for it ends when
    the run closes or this process turns out to hold rank 0, and tells ``waits`` whether the server
    answers its looks."""

    def __init__(
        self,
        request: JobRunRequest,
        new_run: Callable[[str | None], tuple[str | None, dict[str, str]]],
        node: Callable[[], NodeIdentity],
        waits: OpenWaits,
    ) -> None:
        self.request = request
        self._node = node  # read at each step: the job key or rank 0 may be learnt meanwhile
        self._new_run = new_run  # job key -> a new run's name and tags
        self._waits = waits
        self._created: OpenRun | None = None  # kept across retries: a second open must not make a second run

    def open(self, client: TrackingClient) -> OpenRun | None:
        """The job's run (explicit id > job key > new); None when none can be found."""
        r, node = self.request, self._node()
        run_id = r.source.run_id
        if r.adopts is not None and (adopted := self._adopt(client, r.adopts, node.is_global_zero)) is not None:
            return adopted
        if not node.is_global_zero or r.source.launcher_opens:
            if run_id:
                return OpenRun(run_id, None, r.experiment_id, r.experiment, True, None, client)
            return self._wait_for_job_run(client, node)
        run = self._resume(client, run_id) if run_id else None
        if run is not None:
            return run
        # No run id (or its run is gone): the job key's run, else a new one carrying the key.
        experiment = find_experiment(client, r.experiment)
        experiment_id = experiment.experiment_id if experiment is not None else create_experiment(client, r.experiment)
        if node.job_key is not None and (published := published_run_id(experiment, node.job_key)) is not None:
            run = self._resume(client, published)  # a requeued job continues its run
        if run is None:
            if self._waits.left:  # closed meanwhile: close() keeps what waits, replay makes the run
                raise RuntimeError("closed before the run was made")
            run = self._created = self._created or self._create(client, experiment_id, node)
        if (key := self._node().job_key) is not None:  # `otel-forge run` may hand one out meanwhile
            publish(client, experiment_id, key, run.run_id)
        return run

    def _adopt(self, client: TrackingClient, record: ScriptRun, resume: bool) -> OpenRun | None:
        """The run the claiming process publishes; None if it gave its claim up (its run failed to
        open): the job key's run, or ours, then."""
        while (published := record.published()) is None:
            if (self._waits.pause(_ADOPT_POLL_S) and self._waits.left) or record.claimed() is None:
                return None
        if resume:
            run = self._resume(client, published.run_id)
            if run is not None and record.claimer_running():
                run.last_step = None  # its claimer logs into it beside us: no step of it is ours already
            return run
        experiment = published.experiment or self.request.experiment
        return OpenRun(published.run_id, None, published.experiment_id, experiment, True, None, client)

    def _wait_for_job_run(self, client: TrackingClient, node: NodeIdentity) -> OpenRun | None:
        key, r = node.job_key, self.request
        if key is None:
            if r.samples_node:
                _logger.warning(
                    "rank %s (node %s): no MLflow run to attach to, so this node is not sampled into "
                    "MLflow; set MLFLOW_RUN_ID, or OTEL_FORGE_JOB_ID (--job-id) to the same value in "
                    "every process of the job",
                    node.rank,
                    node.node_id or "-",
                )
            return None

        def late() -> None:
            _logger.warning(
                "rank %s (node %s): rank 0 has published no run for job %s in experiment %s after "
                "%.0f s; still looking. Check rank 0's log, or set MLFLOW_RUN_ID for every process",
                node.rank,
                node.node_id or "-",
                key,
                r.experiment,
                r.late_after_s,
            )

        found = wait_for_run(
            client,
            r.experiment,
            key,
            self._waits.pause,
            late_after_s=r.late_after_s,
            on_late=late,
            answered=lambda answered: self._waits.fire(RunEvent.ANSWERED if answered else RunEvent.UNANSWERED),
        )
        if found is None:
            # Closing; or this process turned out to hold rank 0 (the caller's node says so now).
            return None
        _logger.info("job %s: found run %s after %d look(s)", key, found.run_id, found.polls)
        return OpenRun(found.run_id, None, found.experiment_id, r.experiment, True, None, client)

    def _resume(self, client: TrackingClient, run_id: str) -> OpenRun | None:
        try:
            run = live_run(client, run_id)
        except Exception as error:
            if not run_gone(error):
                # Transient (server down, 5xx, timeout): a new run would fork the history.
                raise
            if not isinstance(error, RunGone) and not self.request.source.create_if_missing:
                # Never existed: a mistyped id, not a run to replace.
                raise MissingRun(
                    f"run {run_id} does not exist at {uri_without_credentials(self.request.tracking_uri)}; "
                    f"pass an existing run id, or ask to create one if missing"
                ) from None
            _logger.warning("MLflow run %s is gone (%s); starting a new run", run_id, error_line(error))
            return None
        if not self.request.source.launched:
            begin_attempt(client, run)
        training_steps = [
            m.step
            for m in run.data._metric_objs  # noqa: SLF001 - latest metrics with steps
            if not m.key.startswith("system/")
        ]
        experiment = client.get_experiment(run.info.experiment_id)
        return OpenRun(
            run_id,
            run.info.run_name,
            run.info.experiment_id,
            experiment.name,
            True,
            max(training_steps, default=None),
            client,
            described=DESCRIBED_TAG in run.data.tags,
        )

    def _create(self, client: TrackingClient, experiment_id: str, node: NodeIdentity) -> OpenRun:
        r = self.request
        default_name, tags = self._new_run(node.job_key)
        created = client.create_run(experiment_id, run_name=r.run_name or default_name, tags=tags)
        return OpenRun(created.info.run_id, created.info.run_name, experiment_id, r.experiment, False, None, client)
