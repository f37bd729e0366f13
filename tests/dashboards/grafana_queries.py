"""What Grafana would send to Prometheus for the dashboards of ``dashboards/``.

Loads the dashboard JSON, walks its panels (rows included), variables and annotations, and
interpolates variables the way Grafana's Prometheus data source does: a multi-value or
"include All" variable is regex-escaped (``prometheusSpecialRegexEscape``) and several values
become ``(a|b)``; "All" is the variable's ``allValue``; ``$__rate_interval``, ``$__range`` and
``$__interval`` get fixed test values. An unknown variable is an error, so a typo in a query fails.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS_DIR = REPO_ROOT / "dashboards"
DASHBOARD_FILES = ("otel-forge-node.json", "otel-forge-fleet.json", "otel-forge-run.json")

# Grafana's built-in interval variables, as a 30 s range at a 1 s scrape interval would give them
# ($__rate_interval = max($__interval + scrape interval, 4 x scrape interval), rounded up).
BUILTINS = {"__rate_interval": "5s", "__range": "30s", "__interval": "2s"}
ALL = "$__all"

_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$", re.S)


def load_builder() -> ModuleType:
    """``dashboards/build.py`` as a module (it is a script, not a package)."""
    name = "otel_forge_dashboard_build"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DASHBOARDS_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS_DIR / name).read_text())


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that is not a row, including those inside (collapsed) rows."""
    for panel in dashboard.get("panels", ()):
        if panel["type"] == "row":
            yield from panel.get("panels", ())
        else:
            yield panel


def variables(dashboard: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def grafana_regex_escape(value: str) -> str:
    """Grafana's ``prometheusSpecialRegexEscape``: backslashes doubled in the PromQL string."""
    return _REGEX_SPECIAL.sub(lambda match: "\\\\" + match.group(0), value.replace("\\", "\\\\\\\\"))


def interpolate(expr: str, dashboard: Mapping[str, Any], values: Mapping[str, str | Sequence[str]]) -> str:
    """``expr`` with every ``$var`` / ``${var}`` replaced as Grafana would for ``values``."""
    defined = variables(dashboard)

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        if name not in defined:
            raise KeyError(f"query uses ${name}, which the dashboard does not define: {expr}")
        if name not in values:
            raise KeyError(f"the test gives no value for ${name}: {expr}")
        variable, value = defined[name], values[name]
        if value == ALL or value == [ALL]:
            assert variable.get("includeAll"), f"${name} has no All option"
            return variable["allValue"]
        chosen = [value] if isinstance(value, str) else list(value)
        if variable.get("multi") or variable.get("includeAll"):
            escaped = [grafana_regex_escape(item) for item in chosen]
            return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
        assert len(chosen) == 1, f"${name} takes one value"
        return chosen[0]

    return _VARIABLE.sub(replace, expr)


@dataclass(frozen=True)
class Target:
    """One query of a panel: what a test evaluates."""

    panel: str
    ref_id: str
    expr: str
    instant: bool


def targets(dashboard: Mapping[str, Any]) -> list[Target]:
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", ()):
            found.append(Target(panel["title"], target["refId"], target["expr"], bool(target.get("instant"))))
    return found


def annotation_queries(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Prometheus annotations (not Grafana's built-in one)."""
    return [a for a in dashboard["annotations"]["list"] if a.get("datasource", {}).get("type") == "prometheus"]


def label_values(query: str) -> tuple[str, str]:
    """``label_values(SELECTOR, LABEL)`` -> (SELECTOR, LABEL)."""
    match = _LABEL_VALUES.match(query.strip())
    if match is None:
        raise ValueError(f"not a label_values() query: {query!r}")
    return match.group("selector"), match.group("label")
