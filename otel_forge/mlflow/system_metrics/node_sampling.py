"""``NodeSampling``: the node's companion samples the node once, whatever the number of runs it
samples into.

A sweep's trials, or a notebook beside a job, on one node with one environment share a companion
(``CompanionLink``). Each training process that samples gets its run's exporter on the one agent
the first started (``SampledNode``): the node is read once an interval, /metrics serves every run
(``otel_forge_run_info``, each process tree by its ``process.pid``), and each run's windows hold
the node and its own training process. It was an agent per run: every GPU read as many times, and
the Prometheus port refused to all but the first. A run whose sampling differs (another interval,
other collectors or endpoints, its own OTLP receiver) gets a ``SystemMetricsMonitor`` of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from otel_forge.config import PID_NOT_STARTED, ForgeConfig
from otel_forge.node import NodeIdentity
from otel_forge.scheduler_grace import close_deadline

if TYPE_CHECKING:  # the agent's stack is imported with the first run sampled, not by a companion that only delivers
    from otel_forge.mlflow.client import RunInfo
    from otel_forge.mlflow.system_metrics.exporter import MLflowMetricExporter
    from otel_forge.mlflow.system_metrics.sampled_node import SampledNode
    from otel_forge.pipeline import Agent

# What the agent reads of the settings: runs that agree on all of them share one. The rest (the
# run, its delivery, its windows) is each run's exporter's own.
AGENT_SETTINGS = (
    "sampling_interval_s", "export_timeout_s", "max_age_s", "node_id", "job_id", "service_name",
    "resource_attributes", "collectors", "gpus", "per_cpu", "cgroup", "infiniband_root", "prometheus",
    "prometheus_host", "prometheus_port", "otlp_endpoint", "otlp_protocol", "spool_dir",
)  # fmt: skip
_STOP_MARGIN_S = 5.0  # past the drain deadline, for the agent's last collect and the endpoint's close


class SampledRun(Protocol):
    """One run's sampling, as the companion's session uses it."""

    @property
    def exporter(self) -> MLflowMetricExporter | None: ...

    def attach(self, run_id: str, known: RunInfo | None = None) -> None: ...

    def stop(self) -> None: ...


@dataclasses.dataclass
class _Shared:
    key: tuple[Any, ...]  # what its runs agreed on: the agent's settings, the node as it names it
    sampled: SampledNode
    runs: int = 0


class _SharedRun:
    """A run's exporter on a shared agent; ``stop`` gives it the last collect and drains it, once."""

    def __init__(self, exporter: MLflowMetricExporter, leave: Callable[[], None]) -> None:
        self.exporter = exporter
        self._leave: Callable[[], None] | None = leave

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        self.exporter.attach(run_id, known)

    def stop(self) -> None:
        leave, self._leave = self._leave, None
        if leave is not None:
            leave()


class NodeSampling:
    """The agents of one process (the companion), by what they read; ``sample`` per run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: list[_Shared] = []

    @property
    def agents(self) -> list[Agent]:
        """The agents running: one per set of agent settings and node its runs asked for."""
        with self._lock:
            return [shared.sampled.agent for shared in self._shared if shared.sampled.agent is not None]

    def sample(self, config: ForgeConfig, node: NodeIdentity) -> SampledRun:
        """The node sampled into ``config``'s run (attached later where it is not open yet), its
        training process (``config.pid``) read apart."""
        from otel_forge.mlflow.system_metrics.monitor import SystemMetricsMonitor, run_exporter
        from otel_forge.mlflow.system_metrics.sampled_node import SampledNode

        if config.otlp_receiver:  # its receiver's ports and series are the run's own
            return SystemMetricsMonitor(config, node=node, run_pending=True).start()
        deadline_s, _ = close_deadline(config, node.node_count, node.kubernetes)
        exporter = run_exporter(config, node, deadline_s, process_pid=config.pid)
        key = (*(getattr(config, name) for name in AGENT_SETTINGS), *_names(node))
        with self._lock:
            shared = next((s for s in self._shared if s.key == key), None)
            if shared is None:
                agent_config = dataclasses.replace(config.replace(run_id=None), pid=PID_NOT_STARTED)
                shared = _Shared(key, SampledNode(agent_config, node).start())
                self._shared.append(shared)
            shared.sampled.join(exporter, config.pid)
            shared.runs += 1
        return _SharedRun(exporter, functools.partial(self._leave, shared, exporter, config.pid, deadline_s))

    def _leave(self, shared: _Shared, exporter: MLflowMetricExporter, pid: int | None, deadline_s: float) -> None:
        """The run's last window, drained within ``deadline_s`` (not under the lock: the others' joins
        go on); the agent stops with the last run."""
        shared.sampled.leave(exporter, deadline_s + _STOP_MARGIN_S, pid)
        with self._lock:
            shared.runs -= 1
            if shared.runs == 0:
                self._shared.remove(shared)
                shared.sampled.stop(timeout_s=_STOP_MARGIN_S)  # under the lock: its port is free for the next


def _names(node: NodeIdentity) -> tuple[Any, ...]:
    """The node as the agent names it (its resource, the info metric, the inventory)."""
    return (node.node_id, node.hostname, node.node_count, node.kubernetes)
