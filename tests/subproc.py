"""Launching example scripts and torchrun jobs from tests: a clean environment and a hard timeout that kills the
whole process group (Lightning's launcher and torchrun start children of their own)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Rendezvous variables an in-process Trainer may have left behind, and Lightning's own PL_* settings.
_LEAKED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without rendezvous / Lightning variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if k not in _LEAKED and not k.startswith(("PL_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def start(cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in the repository root, in a session of its own (so its whole tree can be killed)."""
    return subprocess.Popen(
        list(cmd),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env if env is not None else clean_env(),
        start_new_session=True,
        text=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` to completion; on timeout kill its process group and return ``(None, log)``."""
    proc = start(cmd, env)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        log, _ = proc.communicate()
        return None, log
    return proc.returncode, log


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
