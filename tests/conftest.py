"""Session fixtures: one real ``mlflow server``, its client, one the tests may kill and one they may
pause, a basic-auth ``mlflow server`` and a TLS proxy in front of the first (started only for the tests
that ask for them), and the socket watch (tests/socket_io.py); the ``slow`` marker on every test that
needs a server process; the worker groups (pytest-xdist's ``loadgroup``); what ``./run-tests
--no-system`` leaves out."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from socket_io import socket_io  # noqa: F401 - a fixture for every test

from testkit.mlflow_server import MlflowServer

_OWN_DIRECTORIES = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    # What the tests' processes leave in the default spool root stays in the session's own cache: in
    # the user's ~/.cache, every later otel-forge process (a test's, the user's) would try to deliver
    # it to a test server long gone. The host's locks (one writer per node of a run) are the session's
    # own too: a test worker's agents never make another worker's stand down.
    own = config.stash[_OWN_DIRECTORIES] = []
    for variable, prefix in (("XDG_CACHE_HOME", "cache"), ("XDG_RUNTIME_DIR", "runtime")):
        own.append(tempfile.mkdtemp(prefix=f"otel-forge-tests-{prefix}-"))
        os.environ[variable] = own[-1]


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in config.stash.get(_OWN_DIRECTORIES, []):
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real tracking server for the session (tests that kill it start their own)."""
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


def _own_server(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[MlflowServer]:
    mlflow_server = MlflowServer(tmp_path_factory.mktemp(name)).start()
    try:
        yield mlflow_server
    finally:
        mlflow_server.kill()  # SIGCONT + SIGKILL: fast, and safe whatever state the tests left it in


@pytest.fixture(scope="session")
def _killable_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    yield from _own_server(tmp_path_factory, "killable-server")


@pytest.fixture
def killable_server(_killable_server: MlflowServer) -> Iterator[MlflowServer]:
    """A tracking server the test may kill and restart (same port, same database), shared by the tests
    that kill it, one after the other, each in a run of its own: a server start is 6-15 s on 2 cores.
    Whatever state a test leaves it in, the next one finds it up."""
    _killable_server.resume()
    if not _killable_server.healthy():
        _killable_server.kill()
        _killable_server.start()
    yield _killable_server


@pytest.fixture(scope="session")
def _pausable_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    yield from _own_server(tmp_path_factory, "pausable-server")


@pytest.fixture
def pausable_server(_pausable_server: MlflowServer) -> Iterator[MlflowServer]:
    """One server shared by the tests that only pause (SIGSTOP) and resume it, each in a run of its
    own: a server start is 6-15 s on 2 cores. Resumed after each test, whatever the test did."""
    assert _pausable_server.healthy(), "the shared tracking server does not answer"
    try:
        yield _pausable_server
    finally:
        _pausable_server.resume()


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory):
    """A real ``mlflow server --app-name basic-auth`` (testkit/auth_server.py): an admin, users READ by default."""
    from testkit.auth_server import AuthMlflowServer

    with AuthMlflowServer(tmp_path_factory.mktemp("mlflow-auth-server")) as server:
        yield server


@pytest.fixture(scope="session")
def tls_proxy(mlflow_server, tmp_path_factory):
    """HTTPS in front of the session's server, its certificate signed by a CA of the test's own
    (``tls_proxy.ca_path``) that no trust store knows."""
    from testkit.tls_proxy import TlsProxy  # cryptography: only where a test asks for it

    with TlsProxy(mlflow_server.uri, tmp_path_factory.mktemp("tls")) as proxy:
        yield proxy


@pytest.fixture
def client(mlflow_server):
    """An ``MlflowClient`` of the session's tracking server."""
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.uri)


# The inner loop (`./run-tests -m "not slow"`, under a minute): what needs no server process. Slow:
# every test that starts or uses a real server (MLflow, Prometheus, an agent or CMD subprocess).
_SLOW_FOLDERS = {
    "cli_run",
    "frameworks",
    "collector_config",
    "dashboards",
    "faults",
    "integration",
    "multinode",
    "training_run",
}
_SLOW_FIXTURES = {"mlflow_server", "client", "auth_server", "tls_proxy", "killable_server", "pausable_server"}


# `./run-tests --no-system` (OTEL_FORGE_NO_SYSTEM=1) installs no Debian package, and leaves out the tests
# that run a program of the system's: by a part of their id (a file, a parameter) or a fixture they use.
# Where torch's CPU build cannot be installed (OTEL_FORGE_NO_TORCH=1), the tests that need torch go too.
NO_SYSTEM_ENV, NO_TORCH_ENV = "OTEL_FORGE_NO_SYSTEM", "OTEL_FORGE_NO_TORCH"
_TORCH_TESTS = {
    "frameworks/": "torch",
    "multinode/test_torchrun.py": "torch",
    "multinode/test_torchrun_elastic.py": "torch",
    "multinode/test_pytorchjob.py": "torch",
    "progress/test_torchrun_progress.py": "torch",
    "progress/test_energy.py": "torch",
}
_SYSTEM_PROGRAM_TESTS = {
    "collector_config/test_alert_rules_live.py": "Prometheus",
    "collector_config/test_promtool.py": "promtool",
    "collector_config/test_rule_units.py": "promtool",
    "conformance/test_promtool.py": "promtool",
    "dashboards/test_dashboard_queries.py": "Prometheus",
    "integration/test_prometheus_scrape.py": "Prometheus",
    "mlflow/test_ui_reads_well.py": "Chromium",
    "multinode/test_fleet_start_stop.py": "PostgreSQL",
    "deploy/test_deploy_files.py::test_the_unit_passes_systemd_analyze_verify": "systemd-analyze",
    "deploy/test_deploy_files.py::test_verify_as_run_here_fails_a_unit_with_an_unknown_directive": "systemd-analyze",
}
_SYSTEM_PROGRAM_FIXTURES = {"browser": "Chromium"}
_left_out: dict[str, list[str]] = {}  # program -> the test ids left out for it


def _missing_need(item: pytest.Item, tests: Path) -> str | None:
    """What the test needs that this run was told is missing (``NO_SYSTEM_ENV``, ``NO_TORCH_ENV``)."""
    test_id = "::".join([item.path.relative_to(tests).as_posix(), *item.nodeid.split("::")[1:]])
    missing: dict[str, str] = {}
    if os.environ.get(NO_SYSTEM_ENV) == "1":
        missing.update(_SYSTEM_PROGRAM_TESTS)
        fixtures = set(getattr(item, "fixturenames", ()))
        if found := next((program for name, program in _SYSTEM_PROGRAM_FIXTURES.items() if name in fixtures), None):
            return found
    if os.environ.get(NO_TORCH_ENV) == "1":
        missing.update(_TORCH_TESTS)
    for part, program in missing.items():
        if (
            test_id == part
            or test_id.startswith((part + "::", part + "["))
            or (part.endswith("/") and test_id.startswith(part))
        ):
            return program
    return None


# Tests that build in the checkout (setuptools' build/ and egg-info): one worker runs them all.
_CHECKOUT_BUILDS = ("test_wheel.py", "cli_run/test_readme_runs.py")


def _worker_group(item: pytest.Item, tests: Path) -> str | None:
    """The tests that must run on one worker (``--dist loadgroup``): those that build in the checkout,
    and a module's tests that share a module's fixture (a framework's launch, a server stack), made
    once; None: whichever worker is free. pytest tells a test's fixture scopes only in its fixture info."""
    module = item.path.relative_to(tests).as_posix()
    if module in _CHECKOUT_BUILDS:
        return "checkout-build"
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    shares = any(definition.scope in ("module", "package") for chain in definitions for definition in chain)
    return module if shares else None


@pytest.hookimpl(tryfirst=True)  # the groups are set before pytest-xdist's own hook reads them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        folder = item.path.relative_to(tests).parts[0]
        if folder in _SLOW_FOLDERS or _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if (group := _worker_group(item, tests)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get(NO_SYSTEM_ENV) != "1" and os.environ.get(NO_TORCH_ENV) != "1":
        return
    kept = []
    for item in items:
        if (program := _missing_need(item, tests)) is None:
            kept.append(item)
        else:
            _left_out.setdefault(program, []).append(item.nodeid)
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for program, test_ids in sorted(_left_out.items()):
        files = sorted({test_id.split("::")[0] for test_id in test_ids})
        terminalreporter.write_line(f"left out {len(test_ids)} test(s) that need {program}, in {', '.join(files)}")
