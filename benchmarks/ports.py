"""A free TCP port on loopback, for the benchmarks that start their own rendezvous (torchrun agents, peers' loops)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port nothing listens on now (the OS's pick): free until somebody else binds it, which a benchmark that
    starts its job at once rarely meets."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
