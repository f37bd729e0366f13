"""The reference's metric and settings tables, rendered from the code's own tables.

``python -m otel_forge.tables docs/reference.md`` rewrites the marked sections; a test fails when
the document and the code differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from otel_forge.config import SETTINGS
from otel_forge.names import METRICS, Fold, MlflowKey


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def metrics_markdown() -> str:
    rows = [
        "| metric | kind | unit | attributes | collector | MLflow keys (`system/[<node>/]...`) | description |",
        "|---|---|---|---|---|---|---|",
    ]
    seen: dict[str, list[str]] = {}
    for spec in METRICS:
        seen.setdefault(spec.name, []).append(spec.source)
    for spec in METRICS:
        sources = seen.pop(spec.name, None)
        if sources is None:
            continue  # the same metric from another collector: one row, both sources
        attributes = ", ".join(_code(a) for a in spec.attributes)
        keys = "<br>".join(_mlflow_key(k) for k in spec.mlflow)
        rows.append(
            f"| {_code(spec.name)} | {spec.kind.value} | {_code(spec.unit)} | {attributes} "
            f"| {', '.join(sources)} | {keys} | {spec.description} |"
        )
    return "\n".join(rows)


def _mlflow_key(key: MlflowKey) -> str:
    notes = [] if key.fold is Fold.MEAN else [key.fold.value.replace("_", " ")]
    notes += [f"{name}={'/'.join(values)}" for name, values in key.where]
    notes += [f"no {name}" for name in key.without]
    if key.gives_way_to is not None:
        notes.append(f"`{key.gives_way_to[1]}` where `{key.gives_way_to[0]}` reports")
    return _code(key.key) + (f" ({'; '.join(notes)})" if notes else "")


def settings_markdown() -> str:
    rows = ["| setting | environment variables (first set wins) | default | meaning |", "|---|---|---|---|"]
    for setting in SETTINGS:
        default = setting.default
        if isinstance(default, tuple):
            default = ",".join(default)
        shown = "" if default in (None, {}) else _code(str(default))
        rows.append(f"| {_code(setting.name)} | {', '.join(_code(e) for e in setting.env)} | {shown} | {setting.doc} |")
    return "\n".join(rows)


SECTIONS = {"metrics": metrics_markdown, "settings": settings_markdown}


def render(readme: str) -> str:
    """``readme`` with every ``<!-- NAME:begin -->...<!-- NAME:end -->`` section regenerated."""
    for name, build in SECTIONS.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->).*?(<!-- {name}:end -->)", re.DOTALL)
        body = build()
        readme = pattern.sub(lambda m: f"{m.group(1)}\n{body}\n{m.group(2)}", readme)  # noqa: B023 - used at once
    return readme


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docs/reference.md")
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
