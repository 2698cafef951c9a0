"""A free TCP port on loopback, for the benchmarks that start their own rendezvous (torchrun agents, peers' loops),
and a wait until a process listens on one."""

from __future__ import annotations

import socket
import subprocess
import time

__all__ = ["free_port", "wait_until_listening"]


def free_port() -> int:
    """A port nothing listens on now (the OS's pick): free until somebody else binds it, which a benchmark that
    starts its job at once rarely meets."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_listening(port: int, process: subprocess.Popen, timeout: float = 60.0) -> None:
    """Return once something accepts connections on ``port`` on loopback (the rendezvous store an elastic agent
    hosts); raise if ``process`` exits first or ``timeout`` seconds pass. Starting a second agent only then makes
    the first one the store's host, however busy the machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the process exited ({process.returncode}) before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listened on port {port} within {timeout} s")
