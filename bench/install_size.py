"""What a node's install costs: pip install time, installed size and distributions, lean vs full.

Run:  python -m bench.install_size [--variants lean local] [--cache cold|warm] [--json]

Each variant is installed into a fresh ``python -m venv`` under a temporary directory, from a copy of
this checkout's pyproject.toml, README.md and otel_forge/ (so the checkout is not written to):
``lean`` is ``pip install <copy>`` (core dependencies: mlflow-skinny), ``local`` is
``pip install '<copy>[local]'`` (adds the full mlflow: SQL store, ``mlflow ui``, ``mlflow server``).
Measured: the wall time of that one ``pip install`` (resolution, download, unpacking; the venv's
creation not included), the size of the venv's site-packages (``du``-style, bytes of files), and the
distributions ``pip list`` shows. ``--cache cold`` (default) passes ``--no-cache-dir``, so every wheel
is fetched from the configured indexes; ``warm`` uses pip's cache: its first run fills the cache
(a cold run leaves none), a second one reads every wheel from disk. The times depend on the network
and the indexes; the sizes and counts do not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"lean": "", "local": "[local]"}


def _project_copy(directory: Path) -> Path:
    copy = directory / "otel-forge"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, copy / name)
    shutil.copytree(REPO_ROOT / "otel_forge", copy / "otel_forge", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def measure(variant: str, project: Path, directory: Path, cache: str) -> dict[str, object]:
    venv = directory / f"venv-{variant}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    command = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if cache == "cold":
        command.append("--no-cache-dir")
    started = time.perf_counter()
    subprocess.run([*command, f"{project}{EXTRAS[variant]}"], check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    )
    distributions = {d["name"].lower(): d["version"] for d in json.loads(listed.stdout)}
    return {
        "variant": variant,
        "install": f"pip install 'otel-forge{EXTRAS[variant]}'",
        "seconds": round(seconds, 1),
        "site_packages_mb": round(_tree_bytes(site_packages) / 1e6),
        "distributions": len(distributions),
        "mlflow": distributions.get("mlflow") or f"skinny {distributions.get('mlflow-skinny')}",
    }


def markdown(rows: list[dict[str, object]], cache: str) -> str:
    lines = [
        f"| install | pip install, s ({cache} cache) | site-packages, MB | distributions | mlflow |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{r['install']}` | {r['seconds']} | {r['site_packages_mb']} | {r['distributions']} | {r['mlflow']} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.install_size", description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", choices=sorted(EXTRAS), default=["lean", "local"])
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="otel-forge-install-") as temporary:
        directory = Path(temporary)
        project = _project_copy(directory)
        rows = [measure(variant, project, directory, args.cache) for variant in args.variants]
    print(json.dumps(rows, indent=2) if args.json else markdown(rows, args.cache))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_NO_INPUT", "1")
    sys.exit(main())
