"""``otel-forge doctor``: what was detected, the resolved config and where each value came from,
and whether the configured endpoints answer."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import urllib.parse
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from otel_forge.cli.options import add_agent_options, config_from_args
from otel_forge.collectors import open_collectors
from otel_forge.collectors.inventory import node_inventory
from otel_forge.config import COLLECTOR_NAMES, SETTINGS, ForgeConfig, Origin, Setting, Source
from otel_forge.kubernetes import KubernetesIdentity
from otel_forge.mlflow.keys import system_prefix
from otel_forge.mlflow.system_metrics.node_run import SYSTEM_PREFIX
from otel_forge.node import NodeIdentity
from otel_forge.scheduler_grace import close_deadline
from otel_forge.scrub import scrub

_PROBE_TIMEOUT_S = 2.0
DEFAULT_TRACKING = "MLflow's default (./mlflow.db)"


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "doctor",
        help="explain what the agent finds on this machine",
        description=(
            "Say what the agent finds here and why: each collector, present or absent and the reason; the "
            "node and job it belongs to; every setting with its value and where it came from; the "
            "endpoints; and what waits in spools for a tracking server."
        ),
        epilog="examples:\n  otel-forge doctor\n  otel-forge doctor --json",
    )
    add_agent_options(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(run=run)


def _tcp_check(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S):
            return "answers"
    except OSError as error:
        return f"unreachable ({error.strerror or error})"


def _prometheus_check(config: ForgeConfig) -> str:
    if not config.prometheus:
        return "disabled"
    url = f"http://{config.prometheus_host}:{config.prometheus_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT_S) as response:
            return f"in use: {url} answers ({response.status}); an agent may already serve it"
    except OSError:
        pass
    try:
        with socket.create_server((config.prometheus_host, config.prometheus_port)):
            return f"free: an agent would serve {url}"
    except OSError as error:
        return f"cannot bind {config.prometheus_host}:{config.prometheus_port} ({error.strerror or error})"


def _otlp_check(config: ForgeConfig) -> str:
    if not config.otlp_endpoint:
        return "disabled (no OTLP endpoint set)"
    url = config.otlp_metrics_url or ""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"//{url}")  # gRPC's scheme-less host:port
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{config.otlp_protocol} {config.otlp_metrics_url}: {_tcp_check(parsed.hostname or '', port)}"


def _tracking_check(config: ForgeConfig) -> dict[str, Any]:
    """The tracking server asked as MLflow's client asks it (``server_check``): a local store is
    not asked (nor MLflow imported for it)."""
    uri = config.tracking_uri or DEFAULT_TRACKING
    if urllib.parse.urlsplit(uri).scheme not in ("http", "https"):
        return {"verdict": "local_store", "summary": "local store"}
    from otel_forge.mlflow.server_check import check_server
    from otel_forge.mlflow.training.run_plan import DEFAULT_EXPERIMENT

    # The experiment a run of this config goes to: its name, else its id, else the default's name.
    experiment_name = config.experiment_name or (None if config.experiment_id else DEFAULT_EXPERIMENT)
    return check_server(uri, experiment_name, config.experiment_id, _PROBE_TIMEOUT_S).as_dict()


def _spools(config: ForgeConfig) -> list[dict[str, Any]]:
    """Spool directories left by a close: what is pending and how delivery went. A run's journal
    counts the metric values not delivered yet and says whether the run still has to be ended."""
    from otel_forge.mlflow.spool_files import HEADER, STATS, spool_root, writer_alive
    from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
    from otel_forge.mlflow.training.journal_cursor import undelivered
    from otel_forge.mlflow.training.run_journal import KIND as JOURNAL

    root = spool_root(config.spool_dir)
    found = []
    # A spool, or one in a job's directory (`otel-forge run` keeps its job's spools together).
    headers = sorted([*root.glob(f"*/{HEADER}"), *root.glob(f"*/*/{HEADER}")]) if root.is_dir() else []
    for header in headers:
        directory = header.parent
        info = json.loads(header.read_text())
        stats = json.loads((directory / STATS).read_text()) if (directory / STATS).exists() else {}
        alive, run_id = writer_alive(info), info.get("run_id")
        pending, unit = len(WindowSpool.pending_files(directory)), "window(s)"
        if info.get("kind") == JOURNAL:
            left = undelivered(directory)
            pending, unit, run_id = left.values, "metric value(s)", left.run_id
            stats = {**stats, "run end": _journal_end(left.end, alive)}
        found.append(
            {
                "path": str(directory),
                "run_id": run_id,
                "node_id": info.get("node_id"),
                "pending": pending,
                "unit": unit,
                "stats": stats,
                "writer": f"running (pid {info['pid']})" if alive else "ended",
                "replay": f"otel-forge replay {directory}",
            }
        )
    return found


def _journal_end(end: str | None, writer_alive: bool) -> str:
    """How the journal's run ends, as far as the journal says."""
    if end is not None:
        return f"{end}, not delivered yet"
    return "not yet, its process runs" if writer_alive else "KILLED, not delivered yet: its process died"


def diagnose(config: ForgeConfig) -> dict[str, Any]:
    """Everything doctor reports, as plain data."""
    opened = open_collectors(config)
    try:
        collectors = {c.name: {"present": True, "details": c.describe()} for c in opened.present}
        collectors.update({name: {"present": False, "reason": reason} for name, reason in opened.absent.items()})
        node = NodeIdentity.from_config(config)
        inventory = node_inventory(opened.present, node.kubernetes)
    finally:
        opened.close()
    for name in COLLECTOR_NAMES:
        collectors.setdefault(name, {"present": False, "reason": "not in the collectors setting"})
    tracking = _tracking_check(config)
    settings = {
        s.name: {
            "value": _plain(getattr(config, s.name)),
            "source": str(config.source(s.name)),
            "not_used": _not_used(s, config.source(s.name)),
        }
        for s in SETTINGS
    }
    if config.samples_per_window is None:
        settings["samples_per_window"] = {
            "value": config.mlflow_samples_per_window(node.node_count),
            "source": f"default for a job of {node.node_count or 1} node(s)",
        }
    if config.drain_deadline_s is None:
        seconds, why = close_deadline(config, node.node_count, node.kubernetes)
        settings["drain_deadline_s"] = {"value": seconds, "source": f"default for {why}"}
    return {
        "collectors": collectors,
        "node": asdict(node),
        "mlflow_keys": _mlflow_keys(config, node),
        "inventory": inventory,
        "config": settings,
        "endpoints": {
            "prometheus": _prometheus_check(config),
            "otlp": _otlp_check(config),
            "mlflow": f"{scrub(config.tracking_uri or DEFAULT_TRACKING)}: {tracking['summary']}",
        },
        "tracking": tracking,
        "spools": _spools(config),
        "files": _shipped_files(),
    }


def _shipped_files() -> str | None:
    """Where the dashboards and Collector configs are: the wheel installs them under
    ``<prefix>/share/otel-forge``; a checkout has them at its root."""
    for where in (Path(sys.prefix) / "share" / "otel-forge", Path(__file__).resolve().parents[2]):
        if (where / "dashboards").is_dir() and (where / "collector-config").is_dir():
            return str(where)
    return None


def _mlflow_keys(config: ForgeConfig, node: NodeIdentity) -> dict[str, Any]:
    """Where this node's windows land in MLflow, and why."""
    node_run = config.mlflow_node_runs(node.node_count)
    where = "<key> in the node's own run under the job's run" if node_run else "<key> in the job's run"
    return {
        "node_run": node_run,
        "keys": (SYSTEM_PREFIX if node_run else system_prefix(node.node_id)) + where,
        "why": f"a job of {node.node_count or 1} node(s); node runs above {config.node_runs_above}",
    }


def _print_inventory(inventory: dict[str, Any]) -> None:
    """What the agent records in the run as ``inventory.json``, a line per part."""
    cpu = inventory["cpu"]
    print("inventory:")
    print(f"  host     {inventory['host']}, kernel {inventory['kernel']}, Python {inventory['python']}")
    print(f"  cpu      {cpu['model']}, {cpu['physical_cores']} cores, {cpu['logical_cores']} threads")
    print(f"  memory   {inventory['memory_bytes'] / 2**30:.1f} GiB")
    for vendor in inventory["gpus"]:
        gpus = vendor.get("gpus") or []
        names = ", ".join(sorted({str(gpu.get("name")) for gpu in gpus})) or "none"
        print(
            f"  gpu      {len(gpus)} x {names} ({vendor.get('vendor')}, driver {_shown(vendor.get('driver_version'))}, "
            f"CUDA {_shown(vendor.get('cuda_version'))})"
        )
    print("  packages " + ", ".join(f"{name} {_shown(version)}" for name, version in inventory["packages"].items()))
    if inventory.get("kubernetes"):
        print(f"  k8s      {KubernetesIdentity(**inventory['kubernetes']).describe()}")


def _not_used(setting: Setting, source: Source) -> list[str]:
    """The setting's variables that are set but lost to the source that won (e.g.
    ``OTEL_METRIC_EXPORT_INTERVAL`` under ``OTEL_FORGE_SAMPLING_INTERVAL``)."""
    return [name for name in setting.env_set(os.environ) if source != Source(Origin.ENV, name)]


def _shown(value: Any) -> str:
    """A value as the text report shows it: "none" where there is none, never Python's ``None``."""
    return "none" if value is None or value == "" else str(value)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, str):
        return scrub(value)
    return dict(value) if hasattr(value, "items") else value


def _print_text(report: dict[str, Any]) -> None:
    print("collectors:")
    for name, entry in report["collectors"].items():
        if entry["present"]:
            print(f"  {name:<8} present")
            for line in entry["details"]:
                print(f"           {line}")
        else:
            print(f"  {name:<8} absent: {entry['reason']}")
    node = report["node"]
    # A plain process has no launcher: what it would set is left out, not shown as None.
    places = [f"{name}={node[name]}" for name in ("rank", "local_rank", "world_size") if node[name] is not None]
    node_id = f"id={node['node_id']} ({node['node_id_source']}) " if node["node_id"] else "id none (one node) "
    print(f"node: {node_id}host={node['hostname']}{''.join(' ' + place for place in places)}")
    job_key = f"key={node['job_key']} ({node['job_key_source']})" if node["job_key"] else "none (no launcher names one)"
    print(f"job: {job_key}")
    print(f"mlflow: {report['mlflow_keys']['keys']} ({report['mlflow_keys']['why']})")
    _print_inventory(report["inventory"])
    print("config:")
    for name, entry in report["config"].items():
        lost = f"; set but not used: {', '.join(entry['not_used'])}" if entry.get("not_used") else ""
        print(f"  {name:<22} {_shown(entry['value']):<30} ({entry['source']}{lost})")
    print("endpoints:")
    for name, status in report["endpoints"].items():
        print(f"  {name:<10} {status}")
    print(f"files: dashboards/ and collector-config/ in {_shown(report['files'])}")
    print("mlflow spools:" if report["spools"] else "mlflow spools: none pending")
    for spool in report["spools"]:
        counts = ", ".join(f"{k} {v}" for k, v in spool["stats"].items())
        print(
            f"  run {spool['run_id'] or 'not open yet'} node {spool['node_id'] or 'this host'}: "
            f"{spool['pending']} {spool['unit']} pending{' (' + counts + ')' if counts else ''}; "
            f"writer {spool['writer']}; "
            f"{spool['replay']}"
        )
    if left := sum(spool["writer"] == "ended" for spool in report["spools"]):
        print(
            f"  {left} left by ended processes: the next otel-forge process on this node delivers them in the "
            "background, or now: otel-forge replay --all"
        )


def run(args: argparse.Namespace) -> int:
    report = diagnose(config_from_args(args))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_text(report)
    return 0
