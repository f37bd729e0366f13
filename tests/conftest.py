import sys
from pathlib import Path

# Test helpers (servers.py, gpu_fakes.py, proxy.py, hermetic.py, ...) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402

from mlflow_server import MlflowServer  # noqa: E402


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real tracking server for the session (tests that kill it start their own)."""
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


@pytest.fixture
def client(mlflow_server):
    """An ``MlflowClient`` of the session's tracking server."""
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.uri)
