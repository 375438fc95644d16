"""A port nothing answers on, held for as long as a test needs it (not a test).

The suite never picks a "free" port for a process to bind later: servers and side
channels bind port 0 and report what they got. A test that needs a *dead* address (a
peer that does not answer) binds a TCP socket to port 0 and never listens on it:
connecting is refused, and nobody else can bind the port while the socket is held::

    with dead_port() as port:
        ...  # 127.0.0.1:port refuses connections until the block ends
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def dead_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` that is bound (by this process) but refuses connections."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))  # no listen(): a connect gets RST
        yield int(sock.getsockname()[1])
