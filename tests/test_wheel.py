"""The wheel as a user who has only it installs it: built with one command, installed into a fresh
virtual environment, it answers ``--version``, says where its dashboards and Collector configs are,
and holds them there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # builds a wheel and a virtual environment: seconds, not the inner loop


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    # As a user's shell runs it: no PYTHONPATH pointing into a checkout.
    environ = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=environ, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the wheel (its dependencies seen from this Python's)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # The README's one command, with the build isolation off: no index to fetch setuptools from.
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", REPO_ROOT)
    [wheel] = (tmp / "dist").glob("otel_forge-*.whl")
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", venv)
    # A venv made from a venv sees the base interpreter's packages, which on a fresh machine hold none
    # of the dependencies: a path file hands it this environment's too. A path line adds the folder
    # without running its own path files, so this environment's editable otel-forge stays out.
    [site_packages] = (venv / "lib").glob("python*/site-packages")
    (site_packages / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: this Python's own otel-forge (an editable checkout) must not stand for the wheel.
    _run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel)
    return venv


def test_the_installed_wheel_answers_its_version(installed: Path) -> None:
    from importlib.metadata import version

    assert _run(installed / "bin" / "otel-forge", "--version").strip() == f"otel-forge {version('otel-forge')}"


def test_the_wheel_installs_its_dashboards_and_collector_configs_and_doctor_names_them(installed: Path) -> None:
    share = installed / "share" / "otel-forge"
    shipped = {path.relative_to(REPO_ROOT / "dashboards") for path in (REPO_ROOT / "dashboards").glob("*.json")}
    assert shipped and {p.relative_to(share / "dashboards") for p in (share / "dashboards").glob("*.json")} == shipped
    for name in ("agent.yaml", "gateway.yaml", "prometheus.yml", "alert-rules.yml", "recording-rules.yml"):
        assert (share / "collector-config" / name).read_text() == (REPO_ROOT / "collector-config" / name).read_text()
    doctor = json.loads(
        _run(installed / "bin" / "otel-forge", "doctor", "--json", "--collectors", "cpu", "--no-prometheus", cwd=share)
    )
    assert Path(doctor["files"]) == share


def test_the_wheel_carries_the_rank_hook_that_otel_forge_run_hands_its_command(installed: Path) -> None:
    # The hook is a sitecustomize.py outside any package: package data, which a wheel drops unless named.
    code = (
        "import otel_forge.cli, pathlib; "
        "print((pathlib.Path(otel_forge.cli.__file__).parent / 'bootstrap' / 'sitecustomize.py').is_file())"
    )
    assert _run(installed / "bin" / "python", "-c", code).strip() == "True"
