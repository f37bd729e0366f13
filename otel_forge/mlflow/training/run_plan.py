"""``RunPlan``: what a ``TrainingRun`` was asked for, resolved once and frozen: where the run is,
which run it is (asked for, handed by ``otel-forge run``, or the job key's), and what this process
does in it. No I/O."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from otel_forge.config import JOURNALS_DELIVERED_BY_ENV, ConfigError, ForgeConfig
from otel_forge.mlflow.training.launched_run import LaunchedRun
from otel_forge.mlflow.training.run_source import RunSource
from otel_forge.mlflow.training.script_run import ScriptRun
from otel_forge.node import TORCHRUN_MAX_RESTARTS_VAR, TORCHRUN_RESTART_COUNT_VAR, NodeIdentity

_logger = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "otel-forge"
# A local store is not a server that may be down: creating its tables is part of opening it (seconds
# on a fresh file); the wait is bounded only for a store another process holds locked.
_LOCAL_STORE_WAIT_S = 120.0


def embedded_tracking_uri() -> str:
    """A local store in the working directory, the one ``mlflow ui`` opens there."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://", "databricks"))


@dataclass(frozen=True)
class RunPlan:
    """The run a process asks for and its part in it."""

    forge_config: ForgeConfig
    tracking_uri: str
    experiment: str  # name, or id (all digits)
    run_name: str | None
    source: RunSource  # where the run comes from
    node: NodeIdentity
    system_metrics: bool
    register_checkpoints: bool
    node_sampled_by_launcher: bool  # `otel-forge run` samples this node already
    delivered_by_launcher: bool  # `otel-forge run` delivers our journal (it reads its job's directory)
    init_deadline_s: float
    end_deadline_s: float
    # The companion opens the run from the journal and tells us (``RunNotice``): no MLflow in this process.
    delivery_opens: bool = False
    # Another process of the job claimed the run where the script names the experiment: its
    # publication names the run (script_run.py).
    adopts: ScriptRun | None = None

    @classmethod
    def resolve(
        cls,
        forge_config: ForgeConfig,
        *,
        tracking_uri: str | None,
        experiment: str | None,
        run_name: str | None,
        run_id: str | None,
        node: NodeIdentity | None,
        system_metrics: bool,
        register_checkpoints: bool,
        create_if_missing: bool,
        deadlines: tuple[float, float],
    ) -> RunPlan:
        launched = LaunchedRun.from_environ()
        requested = run_id or forge_config.run_id
        uri = tracking_uri or forge_config.tracking_uri or embedded_tracking_uri()
        node = node or NodeIdentity.from_config(forge_config)
        launchers = forge_config.experiment_name or forge_config.experiment_id
        named = bool(experiment or launchers)
        if launched is not None and experiment and launchers and experiment != launchers:
            # One job, one run: the one `otel-forge run` opened, online as in replay.
            _logger.warning(
                "MLflow: this job's run is the one otel-forge run opened, in experiment %s; experiment %s, "
                "named here, is not used (otel-forge run --experiment %s puts the job there)",
                launchers, experiment, experiment,
            )  # fmt: skip
            experiment = None
        return cls(
            forge_config=forge_config,
            tracking_uri=uri,
            experiment=_experiment(uri, experiment or forge_config.experiment_name or forge_config.experiment_id),
            run_name=run_name,
            source=RunSource.resolve(
                requested,
                launched.source if launched is not None else None,
                named=named,
                node=node,
                create_if_missing=create_if_missing,
            ),
            node=node,
            system_metrics=system_metrics,
            register_checkpoints=register_checkpoints,
            node_sampled_by_launcher=launched is not None and launched.sampled_node == node.sampling_key,
            delivered_by_launcher=_launcher_delivers(),
            init_deadline_s=deadlines[0],
            end_deadline_s=deadlines[1],
        )

    @property
    def requested_run_id(self) -> str | None:
        """The run asked for by id: explicit, MLFLOW_RUN_ID, the run `otel-forge run` handed us."""
        return self.source.run_id

    @property
    def owns_run(self) -> bool:
        """Global rank 0 creates the run and logs training metrics; other ranks only attach."""
        return self.node.is_global_zero

    @property
    def samples_node(self) -> bool:
        """This process samples its node into the run (local rank 0, where ``otel-forge run`` does not)."""
        return self.system_metrics and self.node.runs_agent and not self.node_sampled_by_launcher

    @property
    def needs_run_only_to_end_it(self) -> bool:
        """A rank that neither logs (not global rank 0) nor samples its node, handed no run id: it finds
        the job's run only should it fail, to end it so; until then it imports no MLflow and asks the
        server nothing (ranks 1 to 7 of a node of 8)."""
        return not self.owns_run and not self.samples_node and self.source.run_id is None

    @property
    def start_wait_s(self) -> float:
        """How long to wait for the run before the job starts: the setting for a tracking server,
        as long as a local store takes to create."""
        wait_s = self.forge_config.start_wait_s
        return wait_s if is_remote(self.tracking_uri) else max(wait_s, _LOCAL_STORE_WAIT_S)

    def journal_entry(self, default_run_name: str | None, tags: Mapping[str, str]) -> dict[str, object]:
        """The plan as the journal keeps it: enough for a delivery to open the run we would have."""
        from otel_forge.scrub import uri_without_credentials

        return {
            "tracking_uri": uri_without_credentials(self.tracking_uri),
            "experiment": self.experiment,
            "experiment_id": self.forge_config.experiment_id,
            "source": self.source.entry(),
            "run_name": self.run_name or default_run_name,
            "named": self.run_name,  # the name the script gave: the launcher's run takes it, as online
            "delivery_opens": self.delivery_opens,
            "adopts": self.adopts.entry() if self.adopts else None,
            "tags": dict(tags),
            "node": dataclasses.asdict(self.node),
            "attempt_environ": {
                name: os.environ[name]
                for name in (TORCHRUN_RESTART_COUNT_VAR, TORCHRUN_MAX_RESTARTS_VAR)
                if name in os.environ
            },
        }


def _experiment(tracking_uri: str, experiment: str | None) -> str:
    relative = experiment and not experiment.startswith("/") and not experiment.isdigit()
    if tracking_uri.startswith("databricks") and relative:
        raise ConfigError(
            f"invalid experiment: on Databricks an experiment is an absolute workspace path "
            f"such as '/Users/you@example.com/project', got {experiment!r}"
        )
    return experiment or DEFAULT_EXPERIMENT


def _launcher_delivers() -> bool:
    """``otel-forge run`` delivers our journal: it said so, and it still runs."""
    import psutil

    pid = os.environ.get(JOURNALS_DELIVERED_BY_ENV, "")
    return pid.isdigit() and int(pid) != os.getpid() and psutil.pid_exists(int(pid))
