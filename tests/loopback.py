"""Real traffic over the loopback interface: a TCP transfer from this process to itself."""

from __future__ import annotations

import socket
import threading

_CHUNK = 1 << 20


def loopback_transfer(nbytes: int) -> int:
    """Send ``nbytes`` over a TCP connection to 127.0.0.1 and receive them; returns the bytes received.

    Each byte crosses ``lo`` once: the kernel counts it both as sent and as received there.
    """
    received = 0
    with socket.create_server(("127.0.0.1", 0)) as server:

        def drain() -> None:
            nonlocal received
            connection, _ = server.accept()
            with connection:
                while chunk := connection.recv(_CHUNK):
                    received += len(chunk)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        with socket.create_connection(server.getsockname()) as sender:
            payload = bytes(_CHUNK)
            for start in range(0, nbytes, _CHUNK):
                sender.sendall(payload[: min(_CHUNK, nbytes - start)])
        reader.join(timeout=30)
    return received
