"""Launching example scripts and torchrun jobs from tests: a clean environment and a hard timeout that kills the
whole process group (Lightning's launcher and torchrun start children of their own)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from benchmarks.ports import free_port, wait_until_listening  # noqa: F401 - the tests take them from here

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


def run_in_pairs(
    cmds: Sequence[Sequence[str]], timeout: float, env: dict[str, str] | None = None
) -> list[tuple[int | None, str]]:
    """Run independent commands two at a time (their processes mostly sleep or wait: two launches share two cores
    well), each with its own ``timeout``; ``(exit code or None on timeout, log)`` per command, in order."""
    results: list[tuple[int | None, str] | None] = [None] * len(cmds)
    pending = list(enumerate(cmds))
    running: list[tuple[int, subprocess.Popen, float]] = []
    while pending or running:
        while pending and len(running) < 2:
            index, cmd = pending.pop(0)
            running.append((index, start(cmd, env), time.monotonic() + timeout))
        index, proc, deadline = running.pop(0)
        try:
            log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[index] = (proc.returncode, log)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            log, _ = proc.communicate()
            results[index] = (None, log)
    return [r for r in results if r is not None]


def load_script(path: Path, name: str) -> ModuleType:
    """Import an example script (not a package module) by its path, under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def as_cli(script: Path) -> Iterator[None]:
    """Run LightningCLI in-process as if ``script`` had been started: ``sys.argv`` names it (LightningCLI warns
    when given args while ``sys.argv`` holds pytest's), and the PL_* variables ``seed_everything`` exports do not
    leak into later tests."""
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = [str(script)]
    try:
        yield
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)


def assert_clean_exit(code: int | None, log: str, timeout: float) -> None:
    """The launcher exited 0 within ``timeout`` and no rank aborted at interpreter exit (a rank other than 0 can
    abort after the launcher's own rank succeeded: its message is then the only trace)."""
    assert code is not None, f"no exit within {timeout}s (deadlock?)\n{log[-4000:]}"
    assert code == 0, f"exit code {code}\n{log[-4000:]}"
    assert "terminate called" not in log, f"a rank aborted at exit\n{log[-4000:]}"
