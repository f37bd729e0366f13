"""``CompanionLink``: where a node's companion listens, and the messages on its connections.

One companion serves every training process on the node that would start one with the same
environment: it holds one MLflow client and one OpenTelemetry SDK however many runs it delivers
(each companion held ~80 MB of its own). What decides "the same" is ``COMPANION_ENVIRONMENT``:
the variables the companion's own code reads from its environment (MLflow's client, the OTLP
exporter, TLS and proxies, the GPUs a collector may see), the interpreter and its module path. Two
processes that differ in any of them get a companion each, as two jobs on disjoint GPUs must.

The companion listens on a Unix socket in a host-local directory of the user's own (``companions``
beside the writer locks: ``$XDG_RUNTIME_DIR/otel-forge``, else ``$TMPDIR/otel-forge-<uid>``, 0700),
named by a hash of that environment; a lock file beside it is held by whoever starts one or ends
one, so that a process never connects to a companion that is leaving. The socket is reached through
``/proc/self/fd``: the directory may be deeper than a socket address's 107 bytes.

On a connection the training process first hands over its stderr (``send_stderr``: the companion's
lines go to the terminal of a process it serves, and it holds none past that process's session),
then sends messages, each a pickle after its length in 4 bytes (``start``, ``attach``, ``stop``);
the companion answers one byte, ``DONE``, once that process's session has ended (its journal
delivered or left, its sampling stopped).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import socket
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from otel_forge.private_dirs import open_private_file

# Read by the companion's own code from its environment: a process that differs in one gets its own.
COMPANION_ENVIRONMENT_PREFIXES = ("MLFLOW_", "OTEL_", "AWS_", "AZURE_", "GOOGLE_", "DATABRICKS_")
COMPANION_ENVIRONMENT = (
    "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
    "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR", "HOME",
)  # fmt: skip
DONE = b"d"  # the session of this connection has ended
_STDERR = b"e"
_HEADER_BYTES = 4


def environment_key(environ: Mapping[str, str], path: list[str], executable: str) -> str:
    """A hash of what the companion's behaviour depends on (see the module's docstring)."""
    relevant = sorted(
        (name, value)
        for name, value in environ.items()
        if name in COMPANION_ENVIRONMENT or name.startswith(COMPANION_ENVIRONMENT_PREFIXES)
    )
    text = repr((relevant, [p for p in path if p], executable))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CompanionLink:
    """The socket and the lock of the node's companion for this environment, in ``root``."""

    def __init__(self, root: Path, key: str) -> None:
        self.root = root
        self.key = key

    @classmethod
    def for_this_process(cls, root: Path) -> CompanionLink:
        return cls(root, environment_key(os.environ, sys.path, sys.executable))

    @property
    def socket_name(self) -> str:
        return f"companion-{self.key}.sock"

    @contextlib.contextmanager
    def _address(self) -> Iterator[str]:
        """The socket's path, short whatever the root's length: through an fd on the root."""
        fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield f"/proc/self/fd/{fd}/{self.socket_name}"
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held to start or end a companion, and to connect: no one connects to one that is ending."""
        fd = open_private_file(self.root / f"companion-{self.key}.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def connect(self) -> socket.socket | None:
        """A connection to the companion listening here; None where none does (or one died), or
        where what listens is not the user's own."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._address() as address:
                sock.connect(address)
            if peer(sock)[1] != os.getuid():
                raise PermissionError("not our companion")
        except OSError:
            sock.close()
            return None
        return sock

    def listen(self) -> socket.socket:
        """The companion's listening socket (a stale one, left by a companion that died, replaced)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with self._address() as address:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
            sock.bind(address)
        sock.listen(64)
        return sock

    def remove(self) -> None:
        """The companion leaves: its socket goes with it."""
        with contextlib.suppress(OSError), self._address() as address:
            os.unlink(address)


def peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of ``sock``."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def send_stderr(sock: socket.socket) -> None:
    socket.send_fds(sock, [_STDERR], [2])


def receive_stderr(sock: socket.socket) -> int | None:
    """The stderr ``send_stderr`` handed over (an fd of this process now); None where none came."""
    try:
        data, fds, _flags, _address = socket.recv_fds(sock, 1, 1)
    except OSError:
        return None
    if data != _STDERR or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None
    return fds[0]


def send_message(sock: socket.socket, message: tuple[object, ...]) -> None:
    frame = pickle.dumps(message)
    sock.sendall(len(frame).to_bytes(_HEADER_BYTES, "big") + frame)


def read_message(sock: socket.socket) -> tuple[object, ...] | None:
    """The next message; None at the connection's end (or one cut short: its writer died)."""
    header = _read_exactly(sock, _HEADER_BYTES)
    frame = _read_exactly(sock, int.from_bytes(header, "big")) if len(header) == _HEADER_BYTES else b""
    try:
        message = pickle.loads(frame) if frame else None
    except (pickle.UnpicklingError, EOFError):
        return None
    return message if isinstance(message, tuple) else None


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0:
        try:
            chunk = sock.recv(size)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)
