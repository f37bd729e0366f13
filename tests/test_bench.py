"""The benches still start: each one's module imports (the otel_forge names it uses, and ``testkit``, the
helpers it shares with the tests) and parses its arguments, as ``python -m bench.<name> --help`` from
the repository root does. The measurements themselves are not run here (they take minutes)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "bench").glob("*.py") if p.stem[0] != "_")


def test_the_benches_the_readme_names_are_found() -> None:
    names = {"collect_once", "fleet", "gpu_check", "log_latency", "mlflow_export", "overhead", "rendezvous", "sampling"}
    assert names <= set(BENCHES), BENCHES


@pytest.mark.parametrize("name", BENCHES)
def test_a_bench_imports_and_parses_its_arguments(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    bench = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exited:
        bench.main(["--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
