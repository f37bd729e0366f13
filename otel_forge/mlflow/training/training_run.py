"""``TrainingRun``: the MLflow run of a training job, which never stalls the training loop.

The run is opened, resumed and ended on one owner thread, each under a deadline; every other
server call (metrics, params, tags, artifacts, checkpoints) goes through a ``DeliveryWorker``,
so ``log()`` only enqueues. Constructing a ``TrainingRun`` does no I/O: the first ``log()`` (or
``start()``) opens the run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_forge.config import TOLD_SPOOL_ENV, ConfigError, ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.mlflow.client import (
    MAX_METRICS_PER_BATCH,
    RunInfo,
    classify,
    make_client,
)
from otel_forge.mlflow.fluent_runs import fluent_run_id, forget_fluent_run
from otel_forge.mlflow.keys import key_segment, sanitize_key
from otel_forge.mlflow.spool_files import kept_notice_level, spool_root
from otel_forge.mlflow.system_metrics.one_sampler import stand_down_mlflow_sampler
from otel_forge.mlflow.system_metrics.sampler_process import SamplerProcess
from otel_forge.mlflow.training.checkpoints import find_or_create_external_model
from otel_forge.mlflow.training.exit_handlers import ExitHandlers
from otel_forge.mlflow.training.job_run import JobRunFinder, JobRunRequest, MissingRun
from otel_forge.mlflow.training.launched_run import LaunchedRun, make_process_run
from otel_forge.mlflow.training.metric_buffer import MAX_KEY_CHARS, MetricBuffer, MetricRow, checked_step, checked_value
from otel_forge.mlflow.training.metric_flush import MetricFlush
from otel_forge.mlflow.training.outcome import end_run
from otel_forge.mlflow.training.run_description import RunDescription
from otel_forge.mlflow.training.run_metadata import (
    REJECTED_TAG,
)
from otel_forge.mlflow.training.run_owner import OpenRun, RunOwner
from otel_forge.mlflow.training.training_spool import Record, TrainingSpool, training_spool_path
from otel_forge.mlflow.worker import DeliveryWorker, Outcome
from otel_forge.node import NodeIdentity
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import SecretKeys, error_line, scrub, uri_without_credentials

_logger = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "otel-forge"
MAX_PENDING_METRIC_VALUES = 200_000
_MAX_REMEMBERED_KEYS = 10_000
_END_RESERVE_S = 3.0  # of the close budget, kept for the call that ends the run
_ELSEWHERE_WAIT_S = 5.0  # the look for the job's runs in other experiments, at most
_FIRST_OPEN_RETRY_S, _MAX_OPEN_RETRY_S = 1.0, 10.0
# A local store is not a server that may be down: creating its tables is part of opening it (seconds
# on a fresh file); the wait is bounded only for a store another process holds locked.
_LOCAL_STORE_WAIT_S = 120.0
_LAST_ATTEMPT_S = 1.0  # what closing gives a server that did not answer the last attempt
_DATABRICKS_AUTH_HINT = (
    "Databricks authentication: set DATABRICKS_HOST with DATABRICKS_TOKEN, or a profile in "
    "~/.databrickscfg (DATABRICKS_CONFIG_PROFILE), or OAuth M2M (DATABRICKS_CLIENT_ID and "
    "DATABRICKS_CLIENT_SECRET), or run `databricks auth login`"
)


def embedded_tracking_uri() -> str:
    """A local store in the working directory, the one ``mlflow ui`` opens there."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def _is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://", "databricks"))


def _is_databricks(uri: str) -> bool:
    return uri.startswith("databricks")


class TrainingRun:
    """The MLflow run of a training job: ``log``, ``register_checkpoint``, ``close``.

    Run the same code in every rank. Global rank 0 creates the run (or resumes the one its job key
    names) and logs training metrics; every other process finds the run by the job key (or takes
    ``run_id`` / ``MLFLOW_RUN_ID`` / the run ``otel-forge run`` opened), and with ``system_metrics``
    local rank 0 of every node samples its node into it from the moment the run is entered. Any
    process that fails ends the run FAILED. Failures are warned (rate-limited), never raised into
    training: a run that cannot be opened leaves logging disabled. A run it creates carries MLflow's
    context tags (``mlflow.user``, ``mlflow.source.*``), as one ``mlflow.start_run`` creates would.
    """

    def __init__(
        self,
        config: Any = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        description: str | None = None,
        tags: Mapping[str, str] | None = None,
        system_metrics: bool = True,
        register_checkpoints: bool = False,
        launch_argv: Sequence[str] | None = None,
        forge_config: ForgeConfig | None = None,
        node: NodeIdentity | None = None,
        init_deadline_s: float = 60.0,
        end_deadline_s: float = 60.0,
        handle_sigterm: bool = True,
        create_if_missing: bool = False,
    ) -> None:
        self.forge_config = forge_config or ForgeConfig.resolve()
        self.config = config
        self.tracking_uri = tracking_uri or self.forge_config.tracking_uri or embedded_tracking_uri()
        self.experiment = self._experiment(experiment)
        self.run_name = run_name
        launched = LaunchedRun.from_environ()
        self._handed = launched.run_id if launched is not None else None
        self.requested_run_id = run_id or self.forge_config.run_id or self._handed
        self.system_metrics = system_metrics
        self.register_checkpoints = register_checkpoints
        self.launch_argv = list(sys.argv if launch_argv is None else launch_argv)
        self.node = node or NodeIdentity.from_config(self.forge_config)
        self._deadlines = (init_deadline_s, end_deadline_s)
        # Reentrant: the SIGTERM handler closes the run on the main thread, which may hold it in log().
        self._lock = threading.RLock()
        self._pid = os.getpid()  # the process that owns the run: a forked child logs and ends nothing
        self._owner: RunOwner | None = None
        self._opening: concurrent.futures.Future | None = None
        self._run: OpenRun | None = None
        self._worker: DeliveryWorker[Callable[[], None]] | None = None
        self._system_monitor: SamplerProcess | None = None
        self._closed = False
        self._model_ids: dict[int, str] = {}
        self._metrics = MetricBuffer(MAX_PENDING_METRIC_VALUES)
        self._key_names: dict[Any, str | None] = {}
        self.rejected = 0  # metric values log() refused (bad step, key or value), each warned
        self._flush_pending = False
        self._next_flush_at = 0.0  # wall-clock: a flush is due at most once per flush interval
        self._rejected_recorded = False
        self._rejected_warned = 0  # the count the last warning said
        self._pending_records: list[Record] = []  # describing the run, not delivered yet
        self._outage_at_open = False  # closed while the server never answered the open
        # A run `otel-forge run` opened for this process is this attempt's, not a requeued one.
        self._launched = bool(self.requested_run_id) and self.requested_run_id == self._handed
        self._describe_launched = self._launched and launched is not None and launched.described
        # `otel-forge run` is still opening the run (the server was late): find it by key, never make one.
        self._launcher_opens = not self.requested_run_id and launched is not None and launched.pending
        self._node_sampled_by_launcher = launched is not None and launched.sampled_node == self.node.sampling_key
        self._restore_environ: Callable[[], None] | None = None  # once the run is this process's
        self._script_run_id: str | None = None  # the MLflow run the script had open when we started
        self.described = False
        self.ended = False  # the run's end was recorded by close()
        self._warnings = RateLimitedLogger(_logger)
        self._exit_handlers = ExitHandlers(self.close, handle_sigterm)
        self._create_if_missing = create_if_missing
        self._description = RunDescription(
            config,
            description,
            dict(tags or {}),
            self.launch_argv,
            SecretKeys(self.forge_config.secret_keys),
            self._warnings,
        )
        self.open_error: BaseException | None = None  # why the run did not open, once it did not
        self._stopping = threading.Event()  # set when close() stops waiting for the run to open
        self._wake = threading.Event()  # stops a wait for the job's run: closing, or rank 0 known
        self._finder: JobRunFinder | None = None  # once opening: the request is known then
        self.on_open: list[Callable[[], None]] = []  # called on the owner thread once the run is open
        # Called (on the owner thread) with the error when the server first does not answer: the
        # caller tells the user; with none, a warning does.
        self.on_unanswered: list[Callable[[BaseException], None]] = []
        self._unanswered = threading.Event()  # the last attempt to open failed: the server is down
        self._asking = threading.Event()  # MLflow is imported: the server is being asked
        if os.environ.get(TOLD_SPOOL_ENV):
            self._unanswered.set()  # `otel-forge run` found the server down before starting us

    # --- configuration (no I/O) -------------------------------------------------------------

    def _experiment(self, explicit: str | None) -> str:
        experiment = explicit or self.forge_config.experiment_name or self.forge_config.experiment_id
        if (
            _is_databricks(self.tracking_uri)
            and experiment
            and not experiment.startswith("/")
            and not experiment.isdigit()
        ):
            raise ConfigError(
                f"invalid experiment: on Databricks an experiment is an absolute workspace path "
                f"such as '/Users/you@example.com/project', got {experiment!r}"
            )
        return experiment or DEFAULT_EXPERIMENT

    @property
    def _owns_run(self) -> bool:
        """Global rank 0 creates the run and logs training metrics; other ranks only attach."""
        return self.node.is_global_zero

    # --- opening ----------------------------------------------------------------------------

    @property
    def start_wait_s(self) -> float:
        """How long to wait for the run before the job starts: the setting for a tracking server,
        as long as a local store takes to create."""
        wait_s = self.forge_config.start_wait_s
        return wait_s if _is_remote(self.tracking_uri) else max(wait_s, _LOCAL_STORE_WAIT_S)

    def start(self, timeout_s: float | None = None) -> bool:
        """Open (or resume) the run now, waiting at most ``timeout_s`` (default: the init deadline),
        or until the server fails to answer once; True when it is live. Not live yet: it goes on
        opening in the background."""
        timeout_s = self._deadlines[0] if timeout_s is None else timeout_s
        self._begin_opening()
        assert self._opening is not None
        # The wait is the server's: importing MLflow (seconds on a cold start) is not counted.
        asked_at: float | None = None
        while not self._opening.done() and not self._unanswered.is_set():
            if asked_at is None and self._asking.is_set():
                asked_at = time.monotonic()
            if asked_at is not None and time.monotonic() - asked_at >= timeout_s:
                self._warnings.warning(
                    "open",
                    "MLflow: the run did not open within %.0f s; it goes on opening in the background",
                    timeout_s,
                )
                return False
            concurrent.futures.wait([self._opening], timeout=0.05)
        return self._opening.done() and self._wait_open(0) is not None

    def take_rank_zero(self) -> None:
        """This process turned out to hold global rank 0 (known only once the launcher's rendezvous
        is done): it makes the job's run, unless one is published by now."""
        with self._lock:
            if self._run is not None or self._closed:
                return
            self.node = dataclasses.replace(self.node, rank=0)
        self._wake.set()

    def adopt_job_key(self, key: str, source: str) -> None:
        """Find or make the run by ``key`` from the next attempt on (one the caller shares)."""
        self.node = dataclasses.replace(self.node, job_key=key, job_key_source=source)

    def _begin_opening(self) -> None:
        with self._lock:
            if self._opening is not None or self._closed:
                return
            if self.requested_run_id is None and not self._launcher_opens:
                # `with mlflow.start_run(): with TrainingRun(): ...`: the script's run is the job's;
                # the script ends it.
                self.requested_run_id = self._script_run_id = fluent_run_id()
            self._finder = self._finder_for()
            self._owner = RunOwner("mlflow-run-owner")
            self._owner.submit(self._start_sampling)  # from the moment the run is entered
            self._opening = self._owner.submit(self._open)
            self._worker = DeliveryWorker(
                lambda call: call(),
                name="mlflow-training-run",
                max_queue=self.forge_config.queue_size * 16,
                call_deadline_s=self.forge_config.call_deadline_s,
                classify=self._classify,
                due=lambda call: getattr(call, "due", 0.0),
            )
            self._exit_handlers.install()

    def _wait_open(self, timeout_s: float | None) -> OpenRun | None:
        assert self._opening is not None
        try:
            return self._opening.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise
        except Exception:  # noqa: BLE001 - the failure was reported by _open
            return None

    def _classify(self, error: BaseException) -> Outcome:
        if isinstance(error, _RunUnavailable):
            return Outcome.STOP
        return classify(error)

    def _open(self) -> OpenRun | None:
        """On the owner thread: find or make the run (explicit id > job key > new), then sample.

        A server that does not answer (refused, timed out, 5xx, 429) is retried with backoff until
        it does or the run is closed: the job outlives the server, what it logs waits meanwhile.
        """
        pause_s, last_attempt = _FIRST_OPEN_RETRY_S, False
        while True:
            try:
                client = make_client(self.tracking_uri)
                self._asking.set()
                run = self._find_run(client)
                self._unanswered.clear()
                break
            except Exception as error:
                if not self._transient(error):
                    self._disable(error)
                    raise
                if last_attempt:
                    self.open_error = error  # closed before the server answered: close() keeps what waits
                    self._outage_at_open = True
                    raise
                self._unanswered.set()
                # Closing ends the pause: one last attempt, then close() keeps what waits.
                last_attempt = self._stopping.wait(pause_s)
                pause_s = min(pause_s * 2, _MAX_OPEN_RETRY_S)
        if run is None:
            return None
        self._run = run
        # The process's MLflow calls (HF's callback, autolog, mlflow.log_metric) open this run.
        self._restore_environ = make_process_run(run.run_id)
        if self.system_metrics:
            stand_down_mlflow_sampler(run.run_id)
        if self._owns_run and (self._describe_launched or not run.described):
            self._record_new_run(run)
        if self._owns_run and self._launched and self.run_name and run.run_name != self.run_name:
            # The script names the run `otel-forge run` opened for it, as mlflow.start_run(run_name=...) would.
            self._submit(lambda: run.client.update_run(run.run_id, name=self.run_name))
            run.run_name = self.run_name
        _logger.info(
            "MLflow run %s (%s) in experiment %s at %s",
            run.run_id,
            "resumed" if run.resumed else "new",
            run.experiment,
            scrub(self.tracking_uri),
        )
        if self._system_monitor is not None:
            self._system_monitor.attach(run.run_id, RunInfo(run.experiment_id, run.run_name or "", run.experiment))
        for callback in self.on_open:
            callback()
        return run

    def _find_run(self, client: Any) -> OpenRun | None:
        assert self._finder is not None
        run = self._finder.open(client)
        if run is None and self._wake.is_set() and not self._stopping.is_set():
            run = self._finder.open(client)  # this process turned out to hold rank 0
        return run

    def _finder_for(self) -> JobRunFinder:
        request = JobRunRequest(
            tracking_uri=self.tracking_uri,
            experiment=self.experiment,
            experiment_id=self.forge_config.experiment_id,
            run_id=self.requested_run_id,
            run_name=self.run_name,
            launched=self._launched,
            launcher_opens=self._launcher_opens,
            create_if_missing=self._create_if_missing,
            samples_node=self.system_metrics and self.node.runs_agent and not self._node_sampled_by_launcher,
            late_after_s=self._deadlines[0],
        )
        return JobRunFinder(request, self._description, lambda: self.node, self._stopping, self._wake, self._unanswered)

    def _transient(self, error: BaseException) -> bool:
        """An outage of a tracking server, worth waiting for; a local store's errors are not."""
        if isinstance(error, (MissingRun, ConfigError)) or classify(error) is not Outcome.RETRY:
            return False
        if not _is_remote(self.tracking_uri) and "database is locked" not in str(error):
            return False
        if self._unanswered.is_set():
            return True  # told at the first failure
        if self.on_unanswered:
            for callback in self.on_unanswered:
                callback(error)
        else:
            self._warnings.log(
                kept_notice_level(self._spool_root()),
                "open-retry",
                "MLflow: the tracking server at %s does not answer (%s); the run "
                "opens when it does, and what is logged waits in memory meanwhile",
                uri_without_credentials(self.tracking_uri),
                error_line(error),
            )
        return True

    def _disable(self, error: BaseException) -> None:
        self.open_error = error
        hint = f". {_DATABRICKS_AUTH_HINT}" if _is_databricks(self.tracking_uri) and _auth_error(error) else ""
        _logger.warning("MLflow logging disabled: %s%s", error_line(error), hint)

    def _start_sampling(self) -> None:
        """Local rank 0 samples its node from now on, in a process of its own (the loop keeps the GIL);
        the windows wait for the run to open."""
        if not self.system_metrics or not self.node.runs_agent or self._node_sampled_by_launcher:
            return  # under `otel-forge run` the launcher's agent samples this node already
        if not (self._owns_run or self.requested_run_id or self.node.job_key):
            return  # no run can be found: _find_job_run says so
        config = self.forge_config.replace(run_id=None, tracking_uri=self.tracking_uri)
        try:
            self._system_monitor = SamplerProcess(config, self.node).start()
        except Exception as error:  # noqa: BLE001 - the node's sampling must never cost the run
            _logger.warning("system metrics not sampled: %s", error_line(error))

    # --- what a new run records, all on the worker -----------------------------------------

    def _record_new_run(self, run: OpenRun) -> None:
        """Everything that describes the run, as records made here (off the training thread,
        linear in the config's size, secrets masked) and delivered by the worker."""
        self.described = True
        for record in self._description.records(self.node):
            self._submit_record(run, record)

    def _submit_record(self, run: OpenRun, record: Record, follow_up: bool = False) -> None:
        # Kept until delivered (or refused): close() spools what is left, for `otel-forge replay`.
        with self._lock:
            self._pending_records.append(record)
        self._submit(lambda: self._deliver_record(run, record), follow_up)

    def _deliver_record(self, run: OpenRun, record: Record) -> None:
        try:
            record.deliver(run.client, run.run_id)
        except Exception as error:
            if classify(error) is Outcome.DROP:
                self._record_done(record)
            raise
        self._record_done(record)

    def _record_done(self, record: Record) -> None:
        with self._lock:
            self._pending_records.remove(record)

    def _submit(self, call: Callable[[], None], follow_up: bool = False) -> bool:
        return self._worker is not None and self._worker.submit(call, follow_up=follow_up)

    # --- the training loop's calls: never wait ----------------------------------------------

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue ``metrics`` at ``step`` and return at once. Steps a resumed run has are skipped."""
        if self._closed or not self._owns_run or forked_from(self._pid):
            return
        self._begin_opening()
        timestamp_ms = int(time.time() * 1000)  # fixed now: a retry resends identical metrics
        if (checked := checked_step(step)) is None:
            self._reject(len(metrics), "step %r is not an integer from 0 to 2**63-1", step)
            return
        values = self._checked_values(metrics)
        if not self._metrics.add(values, checked, timestamp_ms):
            self._warnings.warning(
                "log-buffer",
                "MLflow: %d metric values waiting; metrics dropped (%d so far)",
                len(self._metrics),
                self._metrics.dropped,
            )
            return
        with self._lock:
            if self._flush_pending:
                waiting = len(self._metrics)
                if waiting - len(values) < MAX_METRICS_PER_BATCH <= waiting and self._worker is not None:
                    self._worker.nudge()  # a full batch: the waiting flush is due now
                return
            self._flush_pending = True
        if not self._submit(self._metric_flush()):
            with self._lock:
                self._flush_pending = False

    def _checked_values(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        values: dict[str, float] = {}
        for key, raw in metrics.items():
            name = self._key_name(key)
            if name is None:
                self._reject(1, "metric key %r is longer than %d characters", str(key)[:80], MAX_KEY_CHARS)
            elif name in values:
                self._reject(1, "metric key %r is %r once sanitised, as another key of the same step", key, name)
            elif (value := checked_value(raw)) is None:
                self._reject(1, "metric %r: %r is not a finite number or NaN", name, str(raw)[:80])
            else:
                values[name] = value
        return values

    def _key_name(self, key: Any) -> str | None:
        """The key as MLflow accepts it, or None; remembered, since the same keys come every step."""
        if (name := self._key_names.get(key, "")) != "":
            return name
        name = sanitize_key(str(key))
        name = name if len(name) <= MAX_KEY_CHARS else None
        if len(self._key_names) < _MAX_REMEMBERED_KEYS:
            self._key_names[key] = name
        return name

    def _reject(self, count: int, message: str, *args: object) -> None:
        self.rejected += count
        if self._warnings.warning(
            "log-rejected", "MLflow: " + message + "; dropped (%d value(s) so far)", *args, self.rejected
        ):
            self._rejected_warned = self.rejected

    def _metric_flush(self) -> MetricFlush:
        """The next flush: due one flush interval after the last one (sooner once a batch is full)."""
        now, interval_s = time.time(), self.forge_config.flush_interval_s
        due = min(max(now, self._next_flush_at), now + interval_s)  # a clock set back delays no flush more
        self._next_flush_at = due + interval_s
        return MetricFlush(self._live_run, self._metrics, self._refused, self._flush_done, due=due)

    def _refused(self, row: MetricRow, reason: str) -> None:
        self._reject(1, "metric %r at step %d refused by the server: %s", row[0], row[3], reason)

    def _flush_done(self) -> None:
        """After a flush: another one if metrics are waiting, else none pending."""
        with self._lock:
            self._flush_pending = (
                bool(len(self._metrics))
                and self._worker is not None
                and self._worker.submit(self._metric_flush(), follow_up=True)
            )
        self._record_rejected(follow_up=True)

    def _live_run(self) -> OpenRun:
        """On the worker: the open run, waiting for the opening within the call deadline."""
        try:
            run = self._wait_open(self.forge_config.call_deadline_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("the run is still opening") from None
        if run is None:
            raise _RunUnavailable("the run could not be opened")
        return run

    def checkpoint_model_name(self, step: int) -> str:
        run = self._run
        base = (run.run_name or run.run_id) if run else (self.run_name or "run")
        return f"{key_segment(base)}-step-{step}"

    def checkpoint_fields(self, step: int) -> dict[str, str] | None:
        """From memory: the model name of the checkpoint at ``step``, and its id once registered."""
        if not self.register_checkpoints or self.tracking_entry() is None:
            return None
        fields = {"model_name": self.checkpoint_model_name(step)}
        if (model_id := self._model_ids.get(step)) is not None:
            fields["model_id"] = model_id
        return fields

    def register_checkpoint(self, step: int, directory: str | os.PathLike[str]) -> None:
        """Register a committed checkpoint directory as an external logged model, on the worker."""
        if (
            not self.register_checkpoints
            or self._closed
            or not self._owns_run
            or step in self._model_ids
            or forked_from(self._pid)
        ):
            return
        self._begin_opening()
        path = Path(directory).absolute()
        self._submit(lambda: self._register(step, path))

    def _register(self, step: int, directory: Path) -> None:
        if step in self._model_ids:
            return
        run = self._live_run()
        name = self.checkpoint_model_name(step)
        self._model_ids[step] = find_or_create_external_model(run, name, step, directory)

    def tracking_entry(self) -> dict[str, str] | None:
        """``{backend, run_id, experiment, tracking_uri}`` without credentials; None unless live."""
        run = self._run
        if run is None or self._closed:
            return None
        return {
            "backend": "mlflow",
            "run_id": run.run_id,
            "experiment": run.experiment,
            "tracking_uri": uri_without_credentials(self.tracking_uri),
        }

    @property
    def run_id(self) -> str | None:
        return self._run.run_id if self._run else None

    @property
    def experiment_id(self) -> str | None:
        return self._run.experiment_id if self._run else None

    # --- ending ------------------------------------------------------------------------------

    def close(self, status: str = "FINISHED") -> None:
        """Drain pending calls, stop system metrics, end the run with ``status``. Idempotent.

        Bounded whatever the server does: the drain deadline plus a few seconds for the run's end
        (20 s at most by default, inside the 30 s that SLURM and Kubernetes give after SIGTERM).
        """
        if forked_from(self._pid):
            return  # a forked child's copy (a DataLoader worker leaving the block): the parent ends it
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._exit_handlers.remove()
        self._leave_process()
        drain_s = self.forge_config.drain_deadline_s
        if self._unanswered.is_set():
            drain_s = min(drain_s, _LAST_ATTEMPT_S)  # the server is down: one last attempt, then the spool
        deadline = time.monotonic() + drain_s + _END_RESERVE_S

        def left(reserve_s: float = 0.0) -> float:
            return max(0.0, deadline - time.monotonic() - reserve_s)

        if self._opening is not None:
            if self._unanswered.is_set():  # no waiting out a retry pause or a poll
                self._stopping.set()
                self._wake.set()
            # A run still opening queues its metadata and takes the system-metric windows sampled
            # so far when it opens: let it, within the budget, before the monitor stops.
            concurrent.futures.wait([self._opening], timeout=left(_END_RESERVE_S))
        stopping = _in_background(self._system_monitor.stop) if self._system_monitor is not None else None
        self._stopping.set()
        self._wake.set()
        self._record_rejected()
        if self._worker is not None:
            self._worker.close(left(_END_RESERVE_S))
        if stopping is not None:
            stopping.join(left(_END_RESERVE_S))
        if self._owner is not None:
            self._end(status, max(left(), 1.0))
        self._keep_undelivered(status)
        if self.rejected > self._rejected_warned:  # the warnings per value are rate-limited: the total
            _logger.warning(
                "MLflow: %d metric value(s) were refused in all (bad step, key or value); "
                "tag %s of the run holds the count",
                self.rejected,
                REJECTED_TAG,
            )

    def _leave_process(self) -> None:
        """The process's MLflow calls no longer open this run, and MLflow does not end it at exit."""
        if self._restore_environ is not None:
            self._restore_environ()
        if self._run is not None and self._owns_run and self._run.run_id != self._script_run_id:
            forget_fluent_run(self._run.run_id)

    def _record_rejected(self, follow_up: bool = False) -> None:
        """Once closing and no flush is left (a flush may still find values the server refuses):
        the count of refused values, as a tag of the run."""
        with self._lock:
            run = self._run
            if (
                self._flush_pending
                or self._rejected_recorded
                or not self._stopping.is_set()
                or not self.rejected
                or run is None
            ):
                return
            self._rejected_recorded = True
        self._submit_record(run, self._rejected_record(), follow_up)

    def _rejected_record(self) -> Record:
        return Record("tags", {REJECTED_TAG: str(self.rejected)})

    def _unrecorded_rejected(self) -> list[Record]:
        """The refused count's record when no flush got to submit it (the run never opened, the
        server down at close): replay sets it."""
        return [self._rejected_record()] if self.rejected and not self._rejected_recorded else []

    def _keep_undelivered(self, status: str) -> None:
        """What close could not deliver (what describes the run, metric rows, the run's end) goes
        to a spool that ``otel-forge replay`` delivers."""
        rows = self._metrics.take_undelivered()
        with self._lock:
            records = [*self._pending_records, *self._unrecorded_rejected()]
        run = self._run
        header: dict[str, Any] = {
            "status": status,
            "ended": self.ended,
            "node": dataclasses.asdict(self.node),
            "tracking_uri": uri_without_credentials(self.tracking_uri),
            "rejected": self.rejected,
        }
        if run is not None:
            header.update(run_id=run.run_id, experiment_id=run.experiment_id)
        elif self._owns_run and (
            self._outage_at_open
            or (self._opening is not None and not self._opening.done())
            or (self._launcher_opens and self.node.job_key is not None)
        ):
            # The server never answered while the job ran: replay opens the run as we would have.
            header.update(
                run_id=None,
                open={
                    "experiment": self.experiment,
                    "run_name": self.run_name or self._description.default_run_name(),
                    "run_id": self.requested_run_id,
                    "job_key": self.node.job_key,
                    "tags": self._description.creation_tags(self.node.job_key),
                },
            )
            records = [*self._description.records(self.node), *self._unrecorded_rejected()]
        else:
            if rows:
                _logger.warning("MLflow: %d metric value(s) were not delivered: the run never opened", len(rows))
            return
        if not rows and not records and (self.ended or self._owner is None):
            return
        spool = TrainingSpool(training_spool_path(self._spool_root(), header["run_id"] or "unopened"))
        if spool.keep(rows, header, records):
            _logger.log(
                kept_notice_level(spool.path),
                "MLflow: %d metric value(s) and %d call(s) describing run %s were not delivered%s; "
                "they are kept in %s. Deliver them with: otel-forge replay %s",
                len(rows),
                len(records),
                header["run_id"] or "(not opened yet)",
                "" if self.ended else f" and the run was not ended {status}",
                spool.path,
                spool.path,
            )

    def _spool_root(self) -> Path:
        return spool_root(self.forge_config.spool_dir)

    def _end(self, status: str, timeout_s: float) -> None:
        assert self._owner is not None
        run = self._run
        if run is not None:
            deadline_s = min(self._deadlines[1], timeout_s)
            try:
                self._owner.call(
                    lambda: end_run(run.client, run.run_id, run.experiment_id, status, self.node), deadline_s
                )
                self.ended = True
            except Exception as error:  # noqa: BLE001 - the run end is best effort too
                _logger.warning("MLflow: ending run %s as %s failed: %s", run.run_id, status, error_line(error))
            # Once per job, by whoever opened its run (not a process it was handed to), at a clean end.
            if self.ended and status == "FINISHED" and not self._launched:
                with contextlib.suppress(Exception):  # a look for the user's sake, never the run's end
                    self._owner.call(lambda: self._warn_runs_elsewhere(run), min(deadline_s, _ELSEWHERE_WAIT_S))
        self._owner.close()

    def _warn_runs_elsewhere(self, run: OpenRun) -> None:
        if not self._owns_run or run.experiment_id is None:
            return
        from otel_forge.mlflow.training.run_context import runs_elsewhere

        try:
            elsewhere = runs_elsewhere(run.client, run.run_id, run.experiment_id)
        except Exception as error:  # noqa: BLE001 - a look for the user's sake, after the run's end
            _logger.debug("MLflow: the job's runs in other experiments not looked for: %s", error_line(error))
            return
        for run_id, experiment in elsewhere:
            _logger.warning(
                "MLflow: run %s of this job is in experiment %s, not beside run %s in %s: give the "
                "framework the job's run (Lightning: MLFlowLogger(run_id=otel_forge.job_run_id()))",
                run_id,
                experiment,
                run.run_id,
                run.experiment,
            )

    def __enter__(self) -> TrainingRun:
        """Open the run: every rank finds it and its node is sampled. Rank 0 waits for it a while
        (``start_wait_s``, as ``otel-forge run`` does before CMD), so that the run a framework opens
        inside the block (HF's callback, autolog) is this one; past that it goes on opening."""
        if self._owns_run and not self._launcher_opens and self.forge_config.start_wait_s > 0:
            self.start(self.start_wait_s)
        else:
            self._begin_opening()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, *rest: object) -> None:
        if exc_type is None or (issubclass(exc_type, SystemExit) and getattr(error, "code", 1) in (0, None)):
            self.close("FINISHED")
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


class _RunUnavailable(Exception):
    """The run could not be opened: nothing queued for it can be delivered."""


def _in_background(call: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=call, name="otel-forge-close", daemon=True)
    thread.start()
    return thread


def _auth_error(error: BaseException) -> bool:
    text = str(error).lower()
    return any(word in text for word in ("401", "403", "unauthorized", "forbidden", "credential", "auth", "token"))
