"""Two questions a delivery asks a tracking server outside MLflow's client, each bounded by a second.

- Does it take connections? A server that refuses them is down: the run's opener says so at once
  instead of waiting out MLflow's own HTTP retries (2 + 4 + 8 s at its 3 retries), and a close does
  not wait out its deadline for it.
- How long did it ask to be left alone? After a 429 or a 503, the ``Retry-After`` it sends. MLflow's
  client keeps the status of a refused call, not the answer's headers, so the header is read from
  the server's ``/health`` (no credentials needed) answered at that moment: a rate-limiting gateway or
  an overloaded server answers it as it answers the calls.
"""

from __future__ import annotations

import email.utils
import logging
import os
import socket
import time
import urllib.parse

_logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
RETRY_AFTER_MAX_S = 60.0  # a Retry-After longer than this is cut to it: delivery is tried again by then
RETRY_AFTER_STATUSES = (429, 503)
_HTTP_SCHEMES = ("http", "https")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class ServerRefused(ConnectionRefusedError):
    """The tracking server takes no connections (its text says why, as urllib3's would)."""


def check_connects(tracking_uri: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``ServerRefused`` where the server at ``tracking_uri`` (http or https) takes no TCP
    connection within ``timeout_s``: refused, unreachable, or silent. Other URIs pass."""
    address = _address(tracking_uri)
    if address is None or _behind_a_proxy(address[0]):
        return
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except TimeoutError:
        raise ServerRefused(f"{address[0]}:{address[1]}: connect timed out") from None
    except OSError as error:
        raise ServerRefused(f"{address[0]}:{address[1]}: {error.strerror or error}") from None


def retry_after_s(tracking_uri: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> float | None:
    """The ``Retry-After`` the server at ``tracking_uri`` answers now with a 429 or 503 (capped at
    ``RETRY_AFTER_MAX_S``), or None: it answers otherwise, does not say, or is not asked (not HTTP)."""
    if _address(tracking_uri) is None:
        return None
    import requests  # MLflow's own HTTP library: its TLS and proxy settings are read from the same places

    try:
        answer = requests.get(
            tracking_uri.rstrip("/") + "/health",  # type: ignore[union-attr]
            timeout=timeout_s,
            verify=_verify(),
            allow_redirects=False,
        )
    except requests.RequestException as error:
        _logger.debug("Retry-After not read from %s: %s", tracking_uri, error)
        return None
    if answer.status_code not in RETRY_AFTER_STATUSES:
        return None
    return parse_retry_after(answer.headers.get("Retry-After"))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` value (seconds, or an HTTP date) as seconds from ``now``, within
    0..``RETRY_AFTER_MAX_S``; None for a missing or malformed one."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


def _address(tracking_uri: str | None) -> tuple[str, int] | None:
    parts = urllib.parse.urlsplit(tracking_uri or "")
    if parts.scheme not in _HTTP_SCHEMES or not parts.hostname:
        return None
    try:
        return parts.hostname, parts.port or _DEFAULT_PORTS[parts.scheme]
    except ValueError:  # a port that is not a number: MLflow's client says so
        return None


def _behind_a_proxy(host: str) -> bool:
    """Calls go through an HTTP proxy (``HTTPS_PROXY``...): the server's own port says nothing."""
    import urllib.request

    return bool(urllib.request.getproxies()) and not urllib.request.proxy_bypass(host)


def insecure_tls() -> bool:
    """``MLFLOW_TRACKING_INSECURE_TLS`` is set, as MLflow reads it: certificates are not checked."""
    return os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").strip().lower() in ("true", "1")


def _verify() -> bool | str:
    """Certificate checking as MLflow's client does it (``MLFLOW_TRACKING_INSECURE_TLS``,
    ``MLFLOW_TRACKING_SERVER_CERT_PATH``)."""
    return False if insecure_tls() else os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
