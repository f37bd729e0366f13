"""Every knob of otel_forge, its environment variables and its default, in one table.

A value is resolved as: explicit argument > the first environment variable of its row that is
set > the default. ``OTEL_*`` and ``MLFLOW_*`` variables mean what their own specifications say;
``OTEL_FORGE_*`` variables are ours: set but empty is a value (refused where it means nothing), not
the "unset" the OTel spec makes of an empty ``OTEL_*`` variable. ``ForgeConfig.sources`` remembers
where each value came from, so an error (and ``otel-forge doctor``) can say so.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COLLECTOR_NAMES = ("cpu", "memory", "cgroup", "disk", "network", "infiniband", "process", "nvidia", "amd")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
CGROUP_VIEWS = ("process", "machine")
MLFLOW_STATS = ("mean", "max", "min")
OWN_PREFIX = "OTEL_FORGE_"


class ConfigError(ValueError):
    """A setting has an invalid value; the message names the setting and where it came from."""


# --- parsers: each takes the raw text and returns the typed value or raises ValueError ---------


def _float_within(low: float, high: float, unit: str = "") -> Callable[[str], float]:
    """A finite number in [low, high]: outside it is a typo or a value that cannot work."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise ValueError(f"must be a number from {low:g} to {high:g}{unit}, got {text!r}")
        return value

    return parse


def _int_within(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"must be an integer from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}, got {text!r}")
        return value

    return parse


# Below 10 ms a sample costs more CPU than it is worth; past a day a timer is surely a typo (and
# past ~292 years Python's own timers overflow).
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 86_400.0
_interval = _float_within(MIN_INTERVAL_S, MAX_INTERVAL_S, " s")
_export_timeout = _float_within(0.001, MAX_INTERVAL_S, " s")


def _from_milliseconds(parse: Callable[[str], float]) -> Callable[[str], float]:
    """The OTel SDK's variables give milliseconds; our settings are seconds."""

    def parse_ms(text: str) -> float:
        try:
            return parse(repr(float(text) / 1000))
        except ValueError as error:
            raise ValueError(f"{error} (from {text!r} milliseconds)") from None

    return parse_ms


_deadline = _float_within(0.1, 3_600.0, " s")


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a port number 0-65535, got {text!r}")
    return value


_KEY_PREFIX = re.compile(r"[A-Za-z0-9_.\- /]{0,64}")


def _key_prefix(text: str) -> str:
    """The start of MLflow keys: what MLflow allows in a key, ``/`` included; empty is none."""
    if not _KEY_PREFIX.fullmatch(text):
        raise ValueError(f"must be up to 64 letters, digits, '_', '.', '-', ' ' or '/', got {text!r}")
    return text


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def _optional_text(text: str) -> str | None:
    return text.strip() or None


def _directory(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError(f"must be a directory path, got {text!r}")
    return value


_NODE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


def _node_id(text: str) -> str | None:
    """A node id is one segment of an MLflow key and a label value: letters, digits, ``_.-``."""
    value = text.strip()
    if value and not _NODE_ID.fullmatch(value):
        raise ValueError(f"must be 1-128 letters, digits, '_', '.' or '-' (not starting with '.' or '-'), got {text!r}")
    return value or None


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _host(text: str) -> str:
    """An address to bind: an IP address or a host name. Empty would mean every interface: say so."""
    value = text.strip()
    try:
        ipaddress.ip_address(value.strip("[]"))
        return value.strip("[]")
    except ValueError:
        pass
    if not value or len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in value.split(".")):
        raise ValueError(f"must be a host name or an IP address (0.0.0.0 for every interface), got {text!r}")
    return value


# ``ForgeConfig.pid`` of an agent started before the process it monitors (``otel-forge run`` serves
# /metrics before CMD starts): its process trees are empty until ``Agent.follow_process``.
PID_NOT_STARTED = 0


def _pid(text: str) -> int | None:
    if not text.strip():
        return None
    value = int(text)
    if value < 1:
        raise ValueError(f"must be a process id >= 1, got {text!r}")
    return value


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {text!r}")
        return value

    return parse


def _subset_of(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise ValueError(f"unknown {', '.join(unknown)}; known: {', '.join(choices)}")
        if not names:
            raise ValueError(f"must name at least one of {', '.join(choices)}, got {text!r}")
        return names

    return parse


_GPU_ENTRY = re.compile(r"\d+|(?:GPU-|MIG-)?[0-9A-Fa-f][0-9A-Fa-f\-]{3,}", re.IGNORECASE)


def _gpus(text: str) -> str:
    value = text.strip()
    if value.lower() in ("all", "visible"):
        return value.lower()
    entries = [entry.strip() for entry in value.split(",")]
    bad = [entry for entry in entries if not _GPU_ENTRY.fullmatch(entry)]
    if not value or bad:
        raise ValueError(
            f"must be 'all', 'visible' or a list of GPU indices (0, 1, ...) and UUIDs "
            f"(GPU-..., MIG-...){'; not ' + ', '.join(map(repr, bad)) if value else ''}"
        )
    return value


# The OTel exporter spec's endpoint variables: the signal's own is the URL posted to, the generic
# one a base URL that gains the signal's path.
OTLP_METRICS_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTLP_METRICS_PATH = "/v1/metrics"
# ``host:port`` without a scheme, as the OTel gRPC exporter takes it (``[::1]:4317`` for IPv6).
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})")


def _otlp_endpoint(text: str) -> str | None:
    """An http(s) URL, or ``host:port``; that the latter is only for gRPC needs the protocol, so
    ``ForgeConfig`` checks it."""
    value = text.strip()
    if not value:
        return None
    parsed = urllib.parse.urlsplit(value)
    host_port = _HOST_PORT.fullmatch(value)
    if host_port and int(host_port.group(1)) <= 65535:
        return value
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"must be an http:// or https:// URL (or host:port with grpc), got {value!r}")
    try:
        _ = parsed.port  # checked on access
    except ValueError:
        raise ValueError(f"has a port out of range 0-65535: {value!r}") from None
    return value


def _grpc_target(endpoint: str) -> str:
    """What the gRPC exporter dials: ``host:port`` as given, else the URL's scheme and authority
    (gRPC has no path; the scheme still decides TLS)."""
    if _HOST_PORT.fullmatch(endpoint):
        return endpoint
    parsed = urllib.parse.urlsplit(endpoint)
    return f"{parsed.scheme}://{parsed.netloc}"


def _http_metrics_url(endpoint: str, env_name: str | None) -> str:
    """The URL the HTTP exporter posts to: the metrics variable's value as is, the generic
    variable's plus ``/v1/metrics``; an argument is taken as a full URL when its path already ends
    in ``/v1/metrics`` (as users paste it), else as a base URL."""
    if env_name == OTLP_METRICS_ENDPOINT_ENV:
        return endpoint
    parsed = urllib.parse.urlsplit(endpoint)
    path = parsed.path.rstrip("/")
    if env_name is None and path.endswith(OTLP_METRICS_PATH):
        return urllib.parse.urlunsplit(parsed._replace(path=path))
    return urllib.parse.urlunsplit(parsed._replace(path=path + OTLP_METRICS_PATH))


_TRACKING_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")


def _tracking_uri(text: str) -> str | None:
    value = text.strip()
    if not value:
        return None
    scheme = urllib.parse.urlsplit(value).scheme.split("+")[0]
    if (scheme or value.startswith("databricks")) and scheme not in _TRACKING_SCHEMES and len(scheme) > 1:
        raise ValueError(f"unsupported scheme {scheme!r}; use one of {', '.join(_TRACKING_SCHEMES)} or a path")
    return value


def _phrases(text: str) -> tuple[str, ...]:
    return tuple(phrase.strip() for phrase in text.split(",") if phrase.strip())


def _optional_float_within(low: float, high: float, unit: str = "") -> Callable[[str], float | None]:
    """A number in [low, high], or unset (empty)."""
    number = _float_within(low, high, unit)
    return lambda text: number(text) if text.strip() else None


def _functions(text: str) -> tuple[str, ...]:
    """``module:Qualified.name`` entries, comma-separated."""
    names = _phrases(text)
    for name in names:
        module, sep, qualname = name.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"must be module:function entries, comma-separated, got {name!r}")
    return names


# What MLflow's SQL store (sqlite:///mlflow.db, the default) needs beyond mlflow-skinny, the core
# dependency; the [local] extra brings them with the full mlflow package.
_SQL_STORE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_SQL_STORE_MODULES = ("sqlalchemy", "alembic")
LOCAL_EXTRA_INSTALL = "pip install 'otel-forge[local]'"


def _missing_modules(names: tuple[str, ...]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def local_store_problem(tracking_uri: str) -> str | None:
    """Why a database store cannot be written, else None. A lean install (mlflow-skinny) has no SQL
    store: said in one line with the install that adds it, before MLflow's own error about a model
    registry. A sqlite file is then opened for appending (MLflow creates it anyway), since access
    checks do not see read-only mounts as root."""
    parsed = urllib.parse.urlsplit(tracking_uri)
    if parsed.scheme.split("+")[0] in _SQL_STORE_SCHEMES and (missing := _missing_modules(_SQL_STORE_MODULES)):
        return (
            f"the MLflow store {parsed.scheme}:// is a database, and MLflow's SQL store is not installed "
            f"(no {', '.join(missing)}: the lean otel-forge talks to a tracking server): {LOCAL_EXTRA_INSTALL}"
        )
    if parsed.scheme != "sqlite" or parsed.path in ("", "/", "/:memory:"):
        return None
    path = Path(urllib.parse.unquote(parsed.path[1:]))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as error:
        return f"cannot write {path}: {error.strerror or error}"
    return None


def _stats(text: str) -> tuple[str, ...]:
    stats = _subset_of(MLFLOW_STATS)(text)
    return stats if "mean" in stats else ("mean", *stats)


_MAX_SPOOL_BYTES = 1 << 40


def _byte_size(text: str) -> int:
    value = text.strip().upper()
    factor = 1
    for suffix, multiplier in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("B", 1)):
        if value.endswith(suffix):
            value, factor = value[: -len(suffix)], multiplier
            break
    problem = ValueError(f"must be a size from 0 to 1 TiB (bytes, or with KiB/MiB/GiB), got {text!r}")
    try:
        number = float(value) * factor
    except ValueError:
        raise problem from None
    if not 0 <= number <= _MAX_SPOOL_BYTES:
        raise problem
    return int(number)


def _resource_attributes(text: str) -> dict[str, str]:
    """Parse ``key1=value1,key2=value2`` (values percent-decoded), as the OTel spec defines."""
    attributes: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value pairs, got {pair!r}")
        attributes[key.strip()] = urllib.parse.unquote(value.strip())
    return attributes


# --- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One knob: the ``ForgeConfig`` field, its environment variables (first set wins), and the
    parser of those variables whose unit differs from the setting's (the OTel SDK's milliseconds)."""

    name: str
    env: tuple[str, ...]
    parse: Callable[[str], Any]
    default: Any
    doc: str
    env_parse: Mapping[str, Callable[[str], Any]] = field(default_factory=dict)

    def parser(self, env_name: str | None) -> Callable[[str], Any]:
        return self.env_parse.get(env_name or "", self.parse)

    def env_set(self, environ: Mapping[str, str]) -> list[str]:
        """Its variables that give a value in ``environ`` (the first wins)."""
        return [name for name in self.env if _is_set(name, environ)]


# The MLflow keys one run may hold (bench/run_page.py): its run page draws in seconds, `runs/get`
# answers in ~0.1 s, and the chart state MLflow's UI keeps per run opened fits 4 times in a browser's
# storage (a run of ~10,000 keys fills it alone, and the page then fails).
RUN_KEY_BUDGET = 2_500
# A node of 8 GPUs is ~300 keys: 8 such nodes fill the budget.
NODE_RUNS_ABOVE = RUN_KEY_BUDGET // 300

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "sampling_interval_s",
        ("OTEL_FORGE_SAMPLING_INTERVAL", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "OTEL_METRIC_EXPORT_INTERVAL"),
        _interval,
        10.0,
        "Seconds between two samples of the hardware (periodic readers' interval), 0.01 to 86400; "
        "`OTEL_METRIC_EXPORT_INTERVAL` in milliseconds, as the OTel SDK reads it.",
        env_parse={"OTEL_METRIC_EXPORT_INTERVAL": _from_milliseconds(_interval)},
    ),
    Setting(
        "export_timeout_s",
        ("OTEL_FORGE_EXPORT_TIMEOUT", "OTEL_METRIC_EXPORT_TIMEOUT"),
        _export_timeout,
        30.0,
        "Seconds one collect and its exports may take (the periodic reader's export timeout; it also bounds "
        "the OTLP exporter's requests); `OTEL_METRIC_EXPORT_TIMEOUT` in milliseconds.",
        env_parse={"OTEL_METRIC_EXPORT_TIMEOUT": _from_milliseconds(_export_timeout)},
    ),
    Setting(
        "samples_per_window",
        ("OTEL_FORGE_SAMPLES_PER_WINDOW", "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING"),
        _int_within(1, 10_000),
        None,
        "Samples folded into one MLflow step (default: by the job's node count, 1 alone or up to 32 nodes, 3 up "
        "to 256, 6 up to 1,024, 12 beyond: 10, 30, 60, 120 s windows at the default interval; Prometheus and "
        "OTLP keep every sample).",
    ),
    Setting(
        "node_runs_above",
        ("OTEL_FORGE_NODE_RUNS_ABOVE",),
        _int_within(0, 1_000_000),
        NODE_RUNS_ABOVE,
        "A job of more than this many nodes logs each node's system metrics into a run of its own under the "
        "job's run (`system/<key>`), not as `system/<node>/<key>` in the job's run, which then stays small "
        "enough for MLflow's run page whatever the node count (0: every node its own run).",
    ),
    Setting(
        "max_age_s",
        ("OTEL_FORGE_MAX_AGE",),
        _float_within(0.001, MAX_INTERVAL_S, " s"),
        None,
        "A snapshot younger than this is served from cache (default: 0.9 x sampling interval).",
    ),
    Setting(
        "node_id",
        ("OTEL_FORGE_NODE_ID", "MLFLOW_SYSTEM_METRICS_NODE_ID"),
        _node_id,
        None,
        "Node id in metric keys and the resource (default: derived from SLURM/torchrun when the job spans nodes, "
        "the host name under MPI).",
    ),
    Setting(
        "job_id",
        ("OTEL_FORGE_JOB_ID",),
        _optional_text,
        None,
        "Job key every process of one job shares, to find the job's one MLflow run (default: derived from "
        "SLURM job id and step, torchrun's rendezvous id or the MPI job).",
    ),
    Setting("service_name", ("OTEL_SERVICE_NAME",), _optional_text, "otel-forge", "OTel `service.name`."),
    Setting(
        "resource_attributes",
        ("OTEL_RESOURCE_ATTRIBUTES",),
        _resource_attributes,
        {},
        "Extra resource attributes, `key=value,...`.",
    ),
    Setting(
        "collectors",
        ("OTEL_FORGE_COLLECTORS",),
        _subset_of(COLLECTOR_NAMES),
        COLLECTOR_NAMES,
        "Collectors to run, comma-separated.",
    ),
    Setting(
        "gpus",
        ("OTEL_FORGE_GPUS",),
        _gpus,
        "all",
        "GPUs to read: `all`, `visible` (CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES) "
        "or a list of indices/UUIDs.",
    ),
    Setting("per_cpu", ("OTEL_FORGE_PER_CPU",), _bool, False, "Also report utilization per logical CPU."),
    Setting(
        "cgroup",
        ("OTEL_FORGE_CGROUP",),
        _one_of(CGROUP_VIEWS),
        "process",
        "Whose limits the cgroup collector measures against: `process`, the monitored process's cgroup (an "
        "agent inside the job's container, `otel-forge run`, `TrainingRun`); `machine`, none (a node agent "
        "beside the jobs, such as a DaemonSet: its own pod's limits are not the job's; pressure is the machine's).",
    ),
    Setting(
        "infiniband_root",
        ("OTEL_FORGE_INFINIBAND_ROOT",),
        _directory,
        "/sys/class/infiniband",
        "Where the InfiniBand collector finds the RDMA devices (a container that mounts the host's `/sys` "
        "elsewhere: `/host/sys/class/infiniband`).",
    ),
    Setting("pid", ("OTEL_FORGE_PID",), _pid, None, "Root of the monitored process tree (default: this process)."),
    Setting("prometheus", ("OTEL_FORGE_PROMETHEUS",), _bool, True, "Serve a Prometheus `/metrics` endpoint."),
    Setting(
        "prometheus_host",
        ("OTEL_EXPORTER_PROMETHEUS_HOST",),
        _host,
        "localhost",
        "Address the Prometheus endpoint binds (`0.0.0.0`: every interface).",
    ),
    Setting(
        "prometheus_port",
        ("OTEL_EXPORTER_PROMETHEUS_PORT",),
        _port,
        9464,
        "Port of the Prometheus endpoint (0 picks a free one).",
    ),
    Setting(
        "otlp_endpoint",
        (OTLP_METRICS_ENDPOINT_ENV, OTLP_ENDPOINT_ENV),
        _otlp_endpoint,
        None,
        "OTLP endpoint; unset means no OTLP export. HTTP: `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` is the URL "
        "posted to, `OTEL_EXPORTER_OTLP_ENDPOINT` a base URL that gains `/v1/metrics`, an argument "
        "(`--otlp-endpoint`) either: a URL ending in `/v1/metrics` is kept, any other gains it. gRPC: also "
        "`host:port`, which uses TLS unless `OTEL_EXPORTER_OTLP_[METRICS_]INSECURE=true`, as the OTel exporter "
        "does (`http://` is plaintext, `https://` TLS); a path means nothing to gRPC and is dropped, with a "
        "warning. `otel-forge doctor` shows the URL used.",
    ),
    Setting(
        "otlp_protocol",
        ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
        _one_of(OTLP_PROTOCOLS),
        "http/protobuf",
        "OTLP transport: `grpc` or `http/protobuf`.",
    ),
    Setting(
        "otlp_receiver",
        ("OTEL_FORGE_OTLP_RECEIVER",),
        _bool,
        False,
        "Receive OTLP metrics (gRPC and HTTP) into MLflow runs: a request's `x-mlflow-run-id` header, else its "
        "resource's `mlflow.run_id` attribute, else the run this process serves.",
    ),
    Setting(
        "otlp_receiver_host",
        ("OTEL_FORGE_OTLP_RECEIVER_HOST",),
        _host,
        "localhost",
        "Address the OTLP receiver binds (`0.0.0.0`: every interface).",
    ),
    Setting(
        "otlp_receiver_grpc_port",
        ("OTEL_FORGE_OTLP_RECEIVER_GRPC_PORT",),
        _port,
        4327,
        "Port of the OTLP/gRPC receiver (the Collector's 4317 plus 10; 0 picks a free one).",
    ),
    Setting(
        "otlp_receiver_http_port",
        ("OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT",),
        _port,
        4328,
        "Port of the OTLP/HTTP receiver, `/v1/metrics` (the Collector's 4318 plus 10; 0 picks a free one).",
    ),
    Setting(
        "otlp_receiver_prefix",
        ("OTEL_FORGE_OTLP_RECEIVER_PREFIX",),
        _key_prefix,
        "otlp/",
        "Prefix of the MLflow keys the received metrics become.",
    ),
    Setting(
        "otlp_receiver_max_series",
        ("OTEL_FORGE_OTLP_RECEIVER_MAX_SERIES",),
        _int_within(1, 100_000),
        300,
        "Distinct received series (a metric and its attributes) per run; points of more are refused, and said once.",
    ),
    Setting(
        "otlp_receiver_max_request_bytes",
        ("OTEL_FORGE_OTLP_RECEIVER_MAX_REQUEST_BYTES",),
        _byte_size,
        4 << 20,
        "Largest OTLP request the receiver takes (after decompression); larger ones are refused.",
    ),
    Setting(
        "run_id",
        ("MLFLOW_RUN_ID",),
        _optional_text,
        None,
        "MLflow run that receives the system metrics (`otel-forge monitor --run-id`).",
    ),
    Setting(
        "experiment_id",
        ("MLFLOW_EXPERIMENT_ID",),
        _optional_text,
        None,
        "The run's experiment (`otel-forge monitor --run-id`): the info metric's label, where node runs and the "
        "inventory go; no agent reads a run to learn it (default: the experiment `MLFLOW_EXPERIMENT_NAME` names, "
        "else not known: an empty label, node runs in MLflow's default experiment `0`, no inventory in a job's run).",
    ),
    Setting(
        "experiment_name",
        ("MLFLOW_EXPERIMENT_NAME",),
        _optional_text,
        None,
        "Experiment of the run `TrainingRun` and `otel-forge run` open or find (default: `experiment_id`, "
        "else `otel-forge`).",
    ),
    Setting(
        "tracking_uri",
        ("MLFLOW_TRACKING_URI",),
        _tracking_uri,
        None,
        "MLflow tracking URI (default: MLflow's own default, a local store in the working directory).",
    ),
    Setting(
        "mlflow_stats",
        ("OTEL_FORGE_MLFLOW_STATS",),
        _stats,
        ("mean",),
        "Window statistics logged to MLflow: `mean`, plus `max`/`min` as `<key>_max`/`<key>_min`.",
    ),
    Setting(
        "secret_keys",
        ("OTEL_FORGE_SECRET_KEYS",),
        _phrases,
        (),
        "More key words that name a secret, comma-separated (`vault path,pin`): values under such keys are "
        "masked in params, tags, config.json and the uploaded launch file. Built in: see Credentials.",
    ),
    Setting(
        "spool_dir",
        ("OTEL_FORGE_SPOOL_DIR",),
        _optional_text,
        None,
        "Where undelivered windows and the training runs' journals wait (default: `$XDG_CACHE_HOME/otel-forge/spool`).",
    ),
    Setting(
        "spool_max_bytes",
        ("OTEL_FORGE_SPOOL_MAX_BYTES",),
        _byte_size,
        64 << 20,
        "Cap of the on-disk spool per exporter; past it windows are dropped and counted.",
    ),
    Setting(
        "queue_size",
        ("OTEL_FORGE_QUEUE_SIZE",),
        _int_within(1, 100_000),
        64,
        "Windows held in memory before spilling to the spool.",
    ),
    Setting(
        "flush_interval_s",
        ("OTEL_FORGE_FLUSH_INTERVAL",),
        _float_within(0.0, 3_600.0, " s"),
        1.0,
        "The training loop's metrics go to MLflow in one `log_batch` at most this often (0: after every "
        "`log()`), sooner once 1,000 values wait; closing the run sends what waits at once.",
    ),
    Setting(
        "call_deadline_s",
        ("OTEL_FORGE_CALL_DEADLINE",),
        _deadline,
        30.0,
        "Deadline of one tracking-server call; a hung call costs a thread, never the caller.",
    ),
    Setting(
        "start_wait_s",
        ("OTEL_FORGE_START_WAIT",),
        _float_within(0.0, 3_600.0, " s"),
        15.0,
        "How long `otel-forge run` waits for the tracking server before starting CMD, and entering a "
        "`TrainingRun` before its block runs (so the run a framework opens in it is this one); the run "
        "goes on opening in the background, and CMD finds it by a job key.",
    ),
    Setting(
        "experiment_wait_s",
        ("OTEL_FORGE_EXPERIMENT_WAIT",),
        _float_within(0.0, 3_600.0, " s"),
        30.0,
        "Where nothing outside the script names the experiment (no `--experiment`, no `MLFLOW_EXPERIMENT_NAME` "
        "or `_ID`), how long the job's run waits for the script to name it (its first MLflow run, "
        "`TrainingRun(experiment=...)`) before it opens in `otel-forge`; a `TrainingRun` also opens at its "
        "first `log()`. A single-node job only: nodes of a larger one find the run in the experiment they know.",
    ),
    Setting(
        "journal_fsync_s",
        ("OTEL_FORGE_JOURNAL_FSYNC",),
        _float_within(0.0, 3_600.0, " s"),
        1.0,
        "How often the run's journal is forced to disk (by its delivery process, never the training loop): "
        "a node crash loses at most this much of what the loop logged (0: never forced; the training "
        "process's own death loses nothing either way).",
    ),
    Setting(
        "delivery_patience_s",
        ("OTEL_FORGE_DELIVERY_PATIENCE",),
        _float_within(0.0, 86_400.0, " s"),
        600.0,
        "How long the delivery process of a training process that died goes on trying a tracking server "
        "that does not answer, before it leaves the run's journal for `otel-forge replay`.",
    ),
    Setting(
        "exit_grace_s",
        ("OTEL_FORGE_EXIT_GRACE",),
        _float_within(0.0, 600.0, " s"),
        5.0,
        "How long the processes CMD started may take to exit once CMD has (a DDP rank finishing a moment "
        "after rank 0) before `otel-forge run` calls them left over: warned about by command line, stopped.",
    ),
    Setting(
        "drain_deadline_s",
        ("OTEL_FORGE_DRAIN_DEADLINE",),
        _deadline,
        None,
        "How long closing waits for pending windows and values before leaving them in the spool (default: "
        "by the job's node count, 10 s up to 333 nodes, 0.03 s a node beyond, at most 60 s: one tracking "
        "server takes the last calls of a fleet stopped together; within the scheduler's grace, less 5 s, "
        "where it is known: SLURM's `KillWait`, the pod's `terminationGracePeriodSeconds`). What is left is "
        "delivered by the next otel-forge process on the node.",
    ),
    Setting(
        "progress",
        ("OTEL_FORGE_PROGRESS",),
        _bool,
        True,
        "Whether `otel-forge run` follows the training's progress: each Python process of CMD reports its "
        "optimizer steps, checkpoints and evaluations to the node's otel-forge (docs/progress.md).",
    ),
    Setting(
        "stall_floor_s",
        ("OTEL_FORGE_STALL_FLOOR",),
        _float_within(1.0, 86_400.0, " s"),
        120.0,
        "The shortest time without a step of any rank that is a stall (the threshold is the larger of this "
        "and `stall_factor` median steps): past the slowest ordinary step, well before PyTorch's NCCL "
        "watchdog (480 s) and collective timeout (600 s).",
    ),
    Setting(
        "stall_factor",
        ("OTEL_FORGE_STALL_FACTOR",),
        _float_within(2.0, 1_000.0),
        10.0,
        "A stall is at least this many median step times without a step: a slow step or a logging pause is not one.",
    ),
    Setting(
        "stall_action",
        ("OTEL_FORGE_STALL_ACTION",),
        _one_of(("none", "end")),
        "none",
        "What `otel-forge run` does once a stall has lasted `stall_action_after_s`: none, or end: stop the "
        "stalled ranks (SIGTERM, then SIGKILL) so that the launcher restarts them (torchrun's --max-restarts) "
        "or the job fails.",
    ),
    Setting(
        "stall_action_after_s",
        ("OTEL_FORGE_STALL_ACTION_AFTER",),
        _float_within(0.0, 86_400.0, " s"),
        600.0,
        "How long a stall lasts, from the last step, before `stall_action` is taken.",
    ),
    Setting(
        "slow_rank_ratio",
        ("OTEL_FORGE_SLOW_RANK_RATIO",),
        _float_within(1.01, 100.0),
        1.2,
        "A rank whose own work per step (its step time less its waits in collectives and backward) is at "
        "least this many times the median rank's is named the slow rank.",
    ),
    Setting(
        "slow_rank_after_s",
        ("OTEL_FORGE_SLOW_RANK_AFTER",),
        _float_within(0.0, 86_400.0, " s"),
        30.0,
        "How long a rank stays the slowest, past `slow_rank_ratio`, before it is named the slow rank: a "
        "rank held up once (a page fault, a late batch) is not.",
    ),
    Setting(
        "evaluation_functions",
        ("OTEL_FORGE_EVALUATION_FUNCTIONS",),
        _functions,
        (
            "transformers.trainer:Trainer.evaluate",
            "lightning.pytorch.loops.evaluation_loop:_EvaluationLoop.run",
            "pytorch_lightning.loops.evaluation_loop:_EvaluationLoop.run",
        ),
        "Functions (`module:Qualified.name`, comma-separated) during which a rank evaluates: not a stall, "
        "and counted as evaluating (default: HF Trainer's evaluate, Lightning's evaluation loop).",
    ),
    Setting(
        "samples_per_step",
        ("OTEL_FORGE_SAMPLES_PER_STEP",),
        _optional_float_within(0.0, 1e15),
        None,
        "Samples the whole job processes per optimizer step (the global batch): gives samples per second.",
    ),
    Setting(
        "tokens_per_step",
        ("OTEL_FORGE_TOKENS_PER_STEP",),
        _optional_float_within(0.0, 1e18),
        None,
        "Tokens the whole job processes per optimizer step: gives tokens per second, and MFU with `model_parameters`.",
    ),
    Setting(
        "model_parameters",
        ("OTEL_FORGE_MODEL_PARAMETERS",),
        _optional_float_within(0.0, 1e16),
        None,
        "The model's parameter count: with `tokens_per_step`, FLOPs per step = 6 x parameters x tokens "
        "(the dense transformer estimate; `flops_per_step` overrides).",
    ),
    Setting(
        "flops_per_step",
        ("OTEL_FORGE_FLOPS_PER_STEP",),
        _optional_float_within(0.0, 1e30),
        None,
        "The job's FLOPs per optimizer step, all ranks together: gives MFU against the GPUs' peak.",
    ),
    Setting(
        "gpu_peak_flops",
        ("OTEL_FORGE_GPU_PEAK_FLOPS",),
        _optional_float_within(1.0, 1e18),
        None,
        "One GPU's peak FLOP/s for MFU (default: the dense BF16 peak of the GPU's model, docs/progress.md).",
    ),
)

# The close's deadline by the job's node count: a node's last calls cost the server ~30 ms of CPU.
DRAIN_MIN_S, DRAIN_S_PER_NODE, DRAIN_MAX_S = 10.0, 0.03, 60.0
GRACE_MARGIN_S = 5.0  # left of the scheduler's grace for the process's own exit

# The default samples per MLflow window by the job's node count: (at most this many nodes, samples).
# Past 1,024 nodes a 60 s window is ~0.7 of a core on one sqlite writer (bench/fleet.py): 120 s.
SAMPLES_PER_WINDOW_BY_NODE_COUNT: tuple[tuple[float, int], ...] = ((32, 1), (256, 3), (1024, 6), (math.inf, 12))

SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}


def env_name(setting: str) -> str:
    """The variable that sets ``setting`` first: what a parent process hands its child."""
    return SETTINGS_BY_NAME[setting].env[0]


# What `otel-forge run` hands its command besides settings (mlflow/training/launched_run.py writes
# and reads them): the job's run, or LAUNCHER_OPENS while the server has not answered yet (the
# command finds it by job key); the runs the command's MLflow calls open after the first nest under
# it (mlflow/training/run_context.py).
LAUNCHED_RUN_ENV = "OTEL_FORGE_LAUNCHED_RUN_ID"
LAUNCHER_OPENS = "pending"
# ... or SCRIPT_OPENS: the first run the command opens is the job's, in the experiment the command
# names; the launcher adopts it (mlflow/training/script_run.py).
SCRIPT_OPENS = "script"
# That run again if the launcher described it just now (the command's TrainingRun adds its config).
DESCRIBE_RUN_ENV = "OTEL_FORGE_DESCRIBE_RUN_ID"
# The last training step the launched run held when the launcher opened it: rank 0, which attaches to
# it without reading it, skips the steps a resumed run holds already, as its own open would have.
LAUNCHED_LAST_STEP_ENV = "OTEL_FORGE_LAUNCHED_LAST_STEP"
# The node the launcher samples already (NodeIdentity.sampling_key): the command's TrainingRun does not.
SAMPLED_NODE_ENV = "OTEL_FORGE_SAMPLED_NODE"
# The pid of the `otel-forge run` that delivers the journals its command writes in its job's directory.
JOURNALS_DELIVERED_BY_ENV = "OTEL_FORGE_JOURNALS_DELIVERED_BY"
# The spool directory the user was told of when the tracking server did not answer (`otel-forge run`
# says it once, for itself and its command): what closing keeps there is not said again.
TOLD_SPOOL_ENV = "OTEL_FORGE_TOLD_SPOOL"
# The directory of the progress board (progress/board.py) CMD's processes write to, one per node and job.
PROGRESS_BOARD_ENV = "OTEL_FORGE_PROGRESS_BOARD"
# MLflow's own sampler, which stands down where otel_forge samples the run's node.
MLFLOW_SYSTEM_METRICS_VAR = "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"


# Variables of the libraries underneath: theirs, not settings of ours, but named here too, so every
# variable otel_forge reads or sets is in this module.
# The OTLP exporter's own timeout: when set, it wins over the one we derive (pipeline/otlp.py).
OTLP_TIMEOUT_VARS = ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
# MLflow's HTTP defaults (2 min timeout, 7 retries with growing backoff) would hide a down server
# inside one call for minutes: bounded. Ending a run prints its URL, credentials included: not.
# The user's own settings win (mlflow/client.py sets these before importing mlflow).
MLFLOW_CLIENT_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
# What the CLI sets in its own process: one attempt per call (our worker retries), MLflow quiet.
MLFLOW_RETRIES_VAR = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
MLFLOW_LOGGING_LEVEL_VAR = "MLFLOW_LOGGING_LEVEL"


class Origin(enum.Enum):
    """Where a setting's value came from."""

    DEFAULT = "default"
    ENV = "env"
    ARGUMENT = "argument"


@dataclass(frozen=True)
class Source:
    """A value's provenance: its ``origin`` and, for the environment, the variable's ``name``; for
    an argument, what the user typed for it (a CLI flag) if known. ``str()`` is how messages and
    ``doctor`` say it: ``default``, ``env NAME``, ``--flag`` or ``argument``."""

    origin: Origin
    name: str = ""

    @property
    def is_default(self) -> bool:
        return self.origin is Origin.DEFAULT

    def __str__(self) -> str:
        if self.origin is Origin.ENV:
            return f"env {self.name}"
        return self.name or self.origin.value


DEFAULT_SOURCE = Source(Origin.DEFAULT)
ARGUMENT_SOURCE = Source(Origin.ARGUMENT)


@dataclass(frozen=True)
class ForgeConfig:
    """The resolved settings. Build it with ``ForgeConfig.resolve``; every field is a row of
    ``SETTINGS``, which holds its default (``ForgeConfig.defaults()``)."""

    sampling_interval_s: float
    export_timeout_s: float
    samples_per_window: int | None
    node_runs_above: int
    max_age_s: float | None
    node_id: str | None
    job_id: str | None
    service_name: str
    resource_attributes: Mapping[str, str]
    collectors: tuple[str, ...]
    gpus: str
    per_cpu: bool
    cgroup: str
    infiniband_root: str
    pid: int | None
    prometheus: bool
    prometheus_host: str
    prometheus_port: int
    otlp_endpoint: str | None
    otlp_protocol: str
    otlp_receiver: bool
    otlp_receiver_host: str
    otlp_receiver_grpc_port: int
    otlp_receiver_http_port: int
    otlp_receiver_prefix: str
    otlp_receiver_max_series: int
    otlp_receiver_max_request_bytes: int
    run_id: str | None
    experiment_id: str | None
    experiment_name: str | None
    tracking_uri: str | None
    mlflow_stats: tuple[str, ...]
    secret_keys: tuple[str, ...]
    spool_dir: str | None
    spool_max_bytes: int
    queue_size: int
    flush_interval_s: float
    call_deadline_s: float
    start_wait_s: float
    experiment_wait_s: float
    journal_fsync_s: float
    delivery_patience_s: float
    exit_grace_s: float
    drain_deadline_s: float | None
    progress: bool
    stall_floor_s: float
    stall_factor: float
    stall_action: str
    stall_action_after_s: float
    slow_rank_ratio: float
    slow_rank_after_s: float
    evaluation_functions: tuple[str, ...]
    samples_per_step: float | None
    tokens_per_step: float | None
    model_parameters: float | None
    flops_per_step: float | None
    gpu_peak_flops: float | None
    sources: Mapping[str, Source] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def resolve(
        cls, environ: Mapping[str, str] | None = None, argument_names: Mapping[str, str] | None = None, **explicit: Any
    ) -> ForgeConfig:
        """Resolve every setting: ``explicit`` (None means unset) > environment > default.

        ``argument_names`` maps a field to what the user typed for it (a CLI flag), so an
        error says ``from --prometheus-port`` rather than ``from argument``.
        """
        environ = os.environ if environ is None else environ
        argument_names = argument_names or {}
        unknown = set(explicit) - set(SETTINGS_BY_NAME)
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        sources: dict[str, Source] = {}
        for setting in SETTINGS:
            argument = Source(Origin.ARGUMENT, argument_names.get(setting.name, ""))
            values[setting.name], sources[setting.name] = _resolve_one(
                setting, explicit.get(setting.name), environ, argument
            )
        return cls(**values, sources=sources)

    def source(self, name: str) -> Source:
        """Where setting ``name``'s value came from."""
        return self.sources.get(name, DEFAULT_SOURCE)

    def mlflow_samples_per_window(self, node_count: int | None) -> int:
        """Samples per MLflow window: the setting, else a window that grows with the job, so that one
        tracking server carries a fleet (each node's calls and rows fall with the window)."""
        if self.samples_per_window is not None:
            return self.samples_per_window
        return next(samples for most, samples in SAMPLES_PER_WINDOW_BY_NODE_COUNT if (node_count or 1) <= most)

    def close_deadline_s(self, node_count: int | None = None, grace_s: float | None = None) -> float:
        """How long a close waits for what is pending: the setting, else by the job's node count,
        within the scheduler's grace (``grace_s``, where known) less ``GRACE_MARGIN_S``."""
        if self.drain_deadline_s is not None:
            return self.drain_deadline_s
        by_size = min(max(DRAIN_MIN_S, (node_count or 1) * DRAIN_S_PER_NODE), DRAIN_MAX_S)
        if grace_s is None:
            return by_size
        return min(by_size, max(grace_s - GRACE_MARGIN_S, grace_s / 2))

    def mlflow_node_runs(self, node_count: int | None) -> bool:
        """Whether each node of a job of ``node_count`` nodes logs into a run of its own."""
        return (node_count or 1) > self.node_runs_above

    @classmethod
    def defaults(cls) -> ForgeConfig:
        """Every setting at its default, whatever the environment says."""
        return cls.resolve(environ={})

    @property
    def snapshot_max_age_s(self) -> float:
        """How old a cached snapshot may be: a little under the sampling interval."""
        return self.max_age_s if self.max_age_s is not None else 0.9 * self.sampling_interval_s

    @property
    def otlp_metrics_url(self) -> str | None:
        """The endpoint the OTLP exporter is given: for HTTP the URL it posts to, for gRPC the
        target it dials (see the ``otlp_endpoint`` row)."""
        if self.otlp_endpoint is None:
            return None
        if self.otlp_protocol == "grpc":
            return _grpc_target(self.otlp_endpoint)
        source = self.source("otlp_endpoint")
        return _http_metrics_url(self.otlp_endpoint, source.name if source.origin is Origin.ENV else None)

    def __post_init__(self) -> None:
        # Only here are endpoint and protocol known together: host:port alone is gRPC's form.
        if self.otlp_endpoint and self.otlp_protocol != "grpc" and _HOST_PORT.fullmatch(self.otlp_endpoint):
            raise ConfigError(
                f"invalid otlp_endpoint (from {self.source('otlp_endpoint')}): must be "
                f"an http:// or https:// URL with otlp_protocol {self.otlp_protocol} (host:port alone "
                f"is for grpc), got {self.otlp_endpoint!r}"
            )

    def replace(self, **changes: Any) -> ForgeConfig:
        """A copy with ``changes`` applied as explicit arguments (validated the same way)."""
        sources = dict(self.sources)
        values = {}
        for name, raw in changes.items():
            values[name], sources[name] = _resolve_one(SETTINGS_BY_NAME[name], raw, {})
        return dataclasses.replace(self, **values, sources=sources)


def _is_set(env_name: str, environ: Mapping[str, str]) -> bool:
    """Whether a variable gives a value. The OTel spec makes an empty OTEL_*/MLflow variable unset;
    an empty variable of our own is a value like any other (and refused where it means nothing)."""
    value = environ.get(env_name)
    if value is None:
        return False
    return env_name.startswith(OWN_PREFIX) or bool(value.strip())


def _resolve_one(
    setting: Setting, explicit: Any, environ: Mapping[str, str], argument_source: Source = ARGUMENT_SOURCE
) -> tuple[Any, Source]:
    env_name = None
    if explicit is not None:
        source = argument_source
        raw = explicit
    else:
        env_name = next(iter(setting.env_set(environ)), None)
        if env_name is None:
            return setting.default, DEFAULT_SOURCE
        source = Source(Origin.ENV, env_name)
        raw = environ[env_name]
    try:
        return (setting.parser(env_name)(raw) if env_name else _parse(setting, raw)), source
    except (ValueError, TypeError) as error:
        raise ConfigError(f"invalid {setting.name} (from {source}): {error}") from None


def _parse(setting: Setting, raw: Any) -> Any:
    if isinstance(raw, str):
        return setting.parse(raw)
    # Typed explicit values go through the same parser, so an argument obeys the env's rules.
    if isinstance(raw, (list, tuple)):
        return setting.parse(",".join(str(item) for item in raw))
    if isinstance(raw, Mapping):
        return setting.parse(",".join(f"{k}={v}" for k, v in raw.items()))
    if isinstance(raw, bool):
        return setting.parse("true" if raw else "false")
    return setting.parse(str(raw))
