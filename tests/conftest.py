"""Session fixtures: one real ``mlflow server``, its client, a basic-auth ``mlflow server`` and a TLS
proxy in front of the first (started only for the tests that ask for them), and the socket watch
(tests/socket_io.py); the ``slow`` marker on every test that needs a server process."""

from pathlib import Path

import pytest
from socket_io import socket_io  # noqa: F401 - a fixture for every test

from testkit.mlflow_server import MlflowServer


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real tracking server for the session (tests that kill it start their own)."""
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


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
_SLOW_FIXTURES = {"mlflow_server", "client", "auth_server", "tls_proxy"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        folder = item.path.relative_to(tests).parts[0]
        if folder in _SLOW_FOLDERS or _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
