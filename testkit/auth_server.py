"""A real ``mlflow server --app-name basic-auth`` for tests: the plain server of ``mlflow_server``
with MLflow's basic-auth app, its own user store in ``root``, an admin, and every user READ by default.

Users, experiments, runs and permissions are made through MLflow's own REST API as the admin, so
the server checks a request exactly as it checks a user's: ``create_user``, ``create_experiment``,
``create_run``, ``grant`` (``READ``, ``USE``, ``EDIT``, ``MANAGE``, ``DENY``) and ``revoke``.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from testkit.mlflow_server import MlflowServer

ADMIN = "admin"
_PERMISSIONS = "/api/3.0/mlflow/users/permissions"


class AuthMlflowServer(MlflowServer):
    """``mlflow server --app-name basic-auth``; ``admin_password`` is made afresh for each server."""

    def __init__(self, root: Path, port: int | None = None, default_permission: str = "READ") -> None:
        super().__init__(root, port)
        self.admin_password = secrets.token_urlsafe(12)
        self.secret_key = secrets.token_hex(16)
        root.mkdir(parents=True, exist_ok=True)
        self.config_path = root / "basic_auth.ini"
        self.config_path.write_text(
            "[mlflow]\n"
            f"default_permission = {default_permission}\n"
            f"database_uri = sqlite:///{root / 'basic_auth.db'}\n"
            f"admin_username = {ADMIN}\n"
            f"admin_password = {self.admin_password}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )

    def command(self) -> list[str]:
        return [*super().command(), "--app-name", "basic-auth"]

    def environ(self) -> dict[str, str]:
        environ = super().environ()
        # The server's own admin comes from its config file, not from the test's environment.
        for name in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD"):
            environ.pop(name, None)
        # The app refuses to start without a fixed key for its forms' CSRF tokens.
        return {
            **environ,
            "MLFLOW_AUTH_CONFIG_PATH": str(self.config_path),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": self.secret_key,
        }

    def create_user(self, username: str, password: str | None = None) -> str:
        """A user (not an admin); its password (made up when not given)."""
        password = password or secrets.token_urlsafe(12)
        self.admin_call("POST", "/api/2.0/mlflow/users/create", {"username": username, "password": password})
        return password

    def create_experiment(self, name: str) -> str:
        """An experiment made by the admin (so no other user manages it); its id."""
        return str(self.admin_call("POST", "/api/2.0/mlflow/experiments/create", {"name": name})["experiment_id"])

    def create_run(self, experiment_id: str) -> str:
        """A run made by the admin in the experiment; its id."""
        body = {"experiment_id": experiment_id, "start_time": int(time.time() * 1000)}
        return str(self.admin_call("POST", "/api/2.0/mlflow/runs/create", body)["run"]["info"]["run_id"])

    def grant(self, username: str, experiment_id: str, permission: str) -> None:
        """The user's permission on the experiment (``DENY`` takes even READ away)."""
        body = {"username": username, "resource_type": "experiment", "resource_id": experiment_id}
        self.admin_call("POST", f"{_PERMISSIONS}/grant", {**body, "permission": permission})

    def revoke(self, username: str, experiment_id: str) -> None:
        """The user's permission on the experiment back to the default."""
        body = {"username": username, "resource_type": "experiment", "resource_id": experiment_id}
        self.admin_call("POST", f"{_PERMISSIONS}/revoke", body)

    def admin_call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One REST call as the admin; its JSON answer. An HTTP error raises with the server's text."""
        return call(self.uri, method, path, (ADMIN, self.admin_password), body)


def call(uri: str, method: str, path: str, user: tuple[str, str], body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One REST call to ``uri`` as ``user`` (name, password); its JSON answer."""
    token = base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
    data = json.dumps(body).encode() if body is not None and method != "GET" else None
    query = f"?{urllib.parse.urlencode(body)}" if body is not None and method == "GET" else ""
    request = urllib.request.Request(
        f"{uri}{path}{query}",
        data=data,
        method=method,
        headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{method} {path}: HTTP {error.code}: {error.read().decode(errors='replace')}") from None
    return json.loads(text) if text.strip() else {}
