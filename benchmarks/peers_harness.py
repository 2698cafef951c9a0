"""One run of a plain-loop peer of ``benchmarks.peers``: every rank started as ``python -m benchmarks.peers --worker``
in a session of its own (the lighthouse too, for torchft), all of them stopped whatever happens, and the run's
summary from every rank's own accounting (in the fields ``benchmarks.heterogeneous.summarize`` reads).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.heterogeneous import ranks_of
from benchmarks.ports import free_port

__all__ = ["peer_summary", "run_peer"]

RUN_TIMEOUT_S = 600.0


def _regime_value(args: list[str], flag: str, default: float) -> float:
    return float(args[args.index(flag) + 1]) if flag in args else default


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_peer(algo: str, sync_every: int, regime_args: list[str], epochs: int, slowdown: str) -> dict:
    """One plain-loop run of ``algo``; every rank in its own session, all killed if anything goes wrong."""
    world = ranks_of(slowdown)
    tmp = Path(tempfile.mkdtemp(prefix="oscars_peers_"))
    lighthouse = None
    procs: list[subprocess.Popen] = []
    logs = []
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RUST_LOG="warn")
    ok = False
    try:
        if algo.startswith("torchft"):
            os.environ.setdefault("RUST_LOG", "warn")  # read once, when torchft's extension starts logging
            from torchft.coordination import LighthouseServer

            lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world, join_timeout_ms=100)
            # address() names the host; the replicas reach it on loopback
            where = ["--lighthouse", "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]]
        else:
            where = ["--port", str(free_port())]
        step_ms = _regime_value(regime_args, "--step-ms", 0.0)
        hidden = int(_regime_value(regime_args, "--hidden", 512))
        n_train = int(_regime_value(regime_args, "--n-train", 16384))
        val = _regime_value(regime_args, "--val-check-interval", 0.25)
        for rank in range(world):
            cmd = [sys.executable, "-m", "benchmarks.peers", "--worker", "--algo", algo, "--rank", str(rank)]
            cmd += ["--world", str(world), "--sync-every", str(sync_every), "--slowdown", slowdown, *where]
            cmd += ["--step-ms", str(step_ms), "--hidden", str(hidden), "--n-train", str(n_train)]
            cmd += ["--epochs", str(epochs), "--val-check-interval", str(val), "--out", str(tmp / f"{rank}.json")]
            log = open(tmp / f"{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            logs[failed[0]].seek(0)
            tail = logs[failed[0]].read()[-3000:]
            raise RuntimeError(f"{algo} sync_every={sync_every} {slowdown!r}: rank {failed[0]} failed\n{tail}")
        ranks = [json.loads((tmp / f"{r}.json").read_text()) for r in range(world)]
        ok = True
    finally:
        for proc in procs:
            _kill_group(proc)
        if lighthouse is not None:
            lighthouse.shutdown()
        for log in logs:
            log.close()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
    return peer_summary(algo, sync_every, ranks)


def peer_summary(algo: str, sync_every: int, ranks: list[dict]) -> dict:
    """The fields ``benchmarks.heterogeneous.summarize`` reads, from every rank's own accounting."""
    wall = max(r["wall_s"] for r in ranks)
    samples = sum(r["real_steps"] for r in ranks) * 64
    keys = ("solo_step_s", "start_factor", "real_steps", "busy_s", "wall_s")
    return {
        "strategy": algo,
        "sync_every": sync_every,
        "train_wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "val_acc": ranks[0]["curve"][-1][2],
        "curve": ranks[0]["curve"],
        "schedule": [sync_every] * len(ranks),
        "rounds": ranks[0]["syncs"],
        "allreduce_s": None,
        "sync_s": [r["sync_s"] for r in ranks],
        "param_checksums": [r.get("param_checksum") for r in ranks],
        "cluster": [{k: r[k] for k in keys} for r in ranks],
        "history": None,
    }
