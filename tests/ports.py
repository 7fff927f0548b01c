"""Free local ports for the processes tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
