"""OTel data points -> MLflow metric keys, as the metric table (``names.METRICS``) declares them."""

from __future__ import annotations

import math
import re
import socket
from collections.abc import Iterable, Mapping
from typing import Protocol

from otel_forge.names import METRICS, Fold, MlflowKey

_PLACEHOLDER = re.compile(r"\{([^}]+)\}")
# MLflow accepts alphanumerics, underscores, dashes, periods, spaces, colons and slashes.
_NOT_IN_KEY = re.compile(r"[^\w.\- :/]")
_NOT_IN_SEGMENT = re.compile(r"[^\w.\-]+")

# What one sample is: key -> (fold, value).
Sample = dict[str, tuple[Fold, float]]


class DataPoint(Protocol):
    """What a key is made from: an OTel number data point (``NumberDataPoint``) of a gauge or a sum."""

    @property
    def attributes(self) -> Mapping[str, object] | None: ...

    @property
    def value(self) -> float: ...


def _path_segment(segment: str) -> str:
    # MLflow refuses empty, "." and ".." path segments.
    return "_" if not segment.strip(".") else segment


def sanitize_key(key: str) -> str:
    """A key MLflow accepts: disallowed characters become ``_``; no empty, ``.`` or ``..`` segment."""
    key = _NOT_IN_KEY.sub("_", key)
    return "/".join(_path_segment(segment) for segment in key.split("/"))


def key_segment(value: object) -> str:
    """An attribute value as one key segment: ``/`` -> ``root``, ``/mnt/data`` -> ``mnt_data``."""
    return _path_segment(_NOT_IN_SEGMENT.sub("_", str(value)).strip("_") or "root")


def node_host_tags(node_id: str, hostname: str | None = None, pod: Mapping[str, str] | None = None) -> dict[str, str]:
    """``otel_forge.node.<node id>.host``: which host a ``system/<node id>/`` prefix samples (a
    ``node_0`` says nothing of it); on Kubernetes ``pod``'s attributes too, as
    ``otel_forge.node.<node id>.k8s.pod.name`` and the like. Written once per node, by the node's agent."""
    segment = key_segment(node_id)
    tags = {f"otel_forge.node.{segment}.host": hostname or socket.gethostname()}
    tags.update({f"otel_forge.node.{segment}.{name}": value for name, value in (pod or {}).items()})
    return tags


def system_prefix(node_id: str | None) -> str:
    """``system/`` or ``system/<node>/``, as MLflow's own monitor names them."""
    return f"system/{key_segment(node_id)}/" if node_id else "system/"


def _render(template: str, attributes: Mapping[str, object]) -> str | None:
    missing = False

    def substitute(match: re.Match[str]) -> str:
        nonlocal missing
        if match.group(1) not in attributes:
            missing = True
            return ""
        return key_segment(attributes[match.group(1)])

    rendered = _PLACEHOLDER.sub(substitute, template)
    return None if missing else rendered


def _matches(key: MlflowKey, attributes: Mapping[str, object]) -> bool:
    return all(str(attributes.get(name)) in allowed for name, allowed in key.where) and not any(
        name in attributes for name in key.without
    )


class KeyMapper:
    """Turns the data points of one export into one sample of ``{key: (fold, value)}``."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._keys: dict[str, tuple[MlflowKey, ...]] = {}
        for spec in METRICS:
            if spec.mlflow:
                self._keys.setdefault(spec.name, spec.mlflow)

    def sample(self, metrics: Iterable[tuple[str, Iterable[DataPoint]]]) -> Sample:
        """``metrics``: (metric name, data points with ``.attributes`` and ``.value``)."""
        sample: Sample = {}
        exported = [(name, list(points)) for name, points in metrics if name in self._keys]
        reporting = {name for name, points in exported if points}
        for name, points in exported:
            keys = self._keys[name]
            for point in points:
                value = float(point.value)
                if not math.isfinite(value):
                    continue  # NaN and inf are never sent
                attributes = point.attributes or {}
                for key in keys:
                    self._add(sample, key, attributes, value, reporting)
        return sample

    def _add(
        self, sample: Sample, key: MlflowKey, attributes: Mapping[str, object], value: float, reporting: set[str]
    ) -> None:
        if not _matches(key, attributes):
            return
        template = key.key
        if key.gives_way_to is not None and key.gives_way_to[0] in reporting:
            template = key.gives_way_to[1]
        rendered = _render(template, attributes)
        if rendered is None:
            return
        full_key = sanitize_key(self._prefix + rendered)
        _, total = sample.get(full_key, (key.fold, 0.0))
        # Points that map to one key are summed: the key names no attribute that tells them apart.
        sample[full_key] = (key.fold, total + value * key.scale)
