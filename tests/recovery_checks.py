"""What tests/test_recovery.py and tests/test_recovery_paradigms.py share: running ``recovery_case.py`` (a restart at a
time, each with a hard timeout), reading what its ranks trained, and the promises of a recovered fit."""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subproc import ROOT, clean_env, free_port, kill_group, start

TIMEOUT = 150
CASE = str(ROOT / "tests" / "recovery_case.py")
SAMPLES = 64  # paradigm_models_case.SAMPLES
RESTORED = "Restoring states from the checkpoint path at "  # Lightning's line, then the recovery point's file


def run(cmd: list[str], env: dict[str, str], timeout: float = TIMEOUT) -> tuple[int, str]:
    return finish(start(cmd, env), timeout)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str]:
    """Wait for ``proc`` (a hard timeout: a hang fails the test), then kill what is left of its process group."""
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        log, _ = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout}s (deadlock?)\n{log[-4000:]}")
    kill_group(proc)  # a killed rank's orphans, if any
    return proc.returncode, log


def trained_by_process(out: Path) -> dict[int, dict[int, list[int]]]:
    """pid -> epoch -> the samples that process trained (every run's every rank)."""
    found: dict[int, dict[int, list[int]]] = {}
    for path in out.glob("trained-*.jsonl"):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found.setdefault(pid, {}).setdefault(row["epoch"], []).extend(row["indices"])
    return found


def assert_recovered(out: Path, lost_pids: set[int], ranks: int) -> list[dict]:
    """A recovered fit's promises: it completed on every rank, no recovery point is left, the ranks hold identical
    weights, every sample of every epoch was trained, the samples trained twice are only those of ``lost_pids``, the
    processes whose work was lost, and no sample was trained twice by processes that lived on."""
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r in results:
        assert r["epoch"] == 2 and r["recovery_left"] == [], r
    assert len({json.dumps(r["weights"]) for r in results}) == 1, "ranks ended with different weights"
    trained = trained_by_process(out)
    for epoch in (0, 1):
        counts = collections.Counter(i for by_epoch in trained.values() for i in by_epoch.get(epoch, []))
        assert sorted(counts) == list(range(SAMPLES)), f"epoch {epoch}: a sample was never trained"
        twice = {i for i, n in counts.items() if n > 1}
        lost = {i for pid in lost_pids for i in trained.get(pid, {}).get(epoch, [])}
        assert twice <= lost, f"epoch {epoch}: samples trained twice that no dead rank had: {sorted(twice - lost)}"
        # A survivor's work is kept, so no sample is trained twice by processes that lived on; a sample can be trained
        # once more per lost process that trained it (two failures in a row can lose the same sample twice).
        kept = collections.Counter(
            i for pid, by_epoch in trained.items() if pid not in lost_pids for i in by_epoch.get(epoch, [])
        )
        assert max(kept.values(), default=0) <= 1, f"epoch {epoch}: survivors trained a sample twice"
    return results


def assert_steps_applied_once(out: Path, point_step: int, ranks: int) -> list[dict]:
    """A fit under ``balance="batch"`` that lost a rank and resumed from the survivors' point at ``point_step``: it
    completed on every rank with no point left and identical weights, and every sample of every epoch is in exactly
    one step that was taken (the failed world's steps before the point, and every step of the restarted one; the
    failed step's batches, whose all-reduce broke, count for nothing)."""
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r in results:
        assert r["epoch"] == 2 and r["recovery_left"] == [], r
    assert len({json.dumps(r["weights"]) for r in results}) == 1, "ranks ended with different weights"
    applied: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in out.glob("trained-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        failed_world = bool(rows) and rows[0]["step"] < point_step  # the restarted processes start at the point
        for row in rows:
            if not failed_world or row["step"] < point_step:
                applied[row["epoch"]].update(row["indices"])
    for epoch in (0, 1):
        assert sorted(applied[epoch]) == list(range(SAMPLES)), f"epoch {epoch}: a sample in no step taken"
        assert max(applied[epoch].values()) == 1, f"epoch {epoch}: a sample in two steps taken"
    return results


def killed_pids(out: Path, before: set[int]) -> set[int]:
    """The processes of a run that ended on a SIGKILL: the one whose file stops at the kill (rank 1's)."""
    return {int(p.stem.split("-")[1]) for p in out.glob("trained-*.jsonl")} - before


# Per run of a restart sequence: its exit code, its log, the processes whose work is lost.
Runs = list[tuple[int, str, set[int]]]


def rank_of(out: Path, pid: int) -> int | None:
    lines = (out / f"trained-{pid}.jsonl").read_text().splitlines()
    return json.loads(lines[0])["rank"] if lines else None


def restored_step(log: str) -> int | None:
    """The global step of the recovery point a run restored from (``None``: it restored from none)."""
    found = re.search(re.escape(RESTORED) + r"\S*oscars-recovery/step-(\d+)/", log)
    return int(found.group(1)) if found else None


def steps(out: Path, pid: int) -> list[int]:
    lines = (out / f"trained-{pid}.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines] or [-1]


def torchrun(port: int, *args: str) -> list[str]:
    # torch's shared rendezvous store keeps the last round's keys across an agent's restart (pytorch/pytorch#135712):
    # the ranks of a restarted round then wait for keys nobody writes. A store of the ranks' own avoids it.
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
    ]
    return [*launcher, "--monitor-interval=1", *args, CASE]


def torchrun_env(kill: str) -> dict[str, str]:
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_TORCHRUN="1", OSCARS_TEST_KILL=kill)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def pids_by_last_step(out: Path) -> dict[int, int]:
    return {int(p.stem.split("-")[1]): max(steps(out, int(p.stem.split("-")[1]))) for p in out.glob("trained-*")}


def srun(out: Path, env: dict[str, str], nodes: int, kill_wait_s: float = 30.0) -> tuple[list[int], str]:
    """One job step as SLURM's ``srun`` runs it, emulated on loopback: a task per node, each its own process with
    the ``SLURM_*`` variables srun sets (Lightning's ``SLURMEnvironment``; no launcher watches them). When a task
    fails, the others get SIGTERM and, ``kill_wait_s`` later (SLURM's ``KillWait``), SIGKILL, as SLURM ends a step
    whose task or node failed. A hang fails the test after ``TIMEOUT`` s. Returns the tasks' exit codes and logs."""
    port, step = free_port(), len(list(out.glob("srun-*.log")))
    tasks = []
    for rank in range(nodes):
        slurm = {"SLURM_NTASKS": str(nodes), "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": str(nodes)}
        slurm.update(SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank), SLURM_JOB_NAME="recovery")
        slurm.update(SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(out / f"srun-{step}-task{rank}.log", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [sys.executable, CASE, str(out)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, **slurm},
            start_new_session=True,
        )
        tasks.append((proc, log))
    deadline, terminated = time.monotonic() + TIMEOUT, None
    try:
        while any(proc.poll() is None for proc, _ in tasks):
            if time.monotonic() > deadline:
                pytest.fail(f"srun step {step} did not finish within {TIMEOUT}s (deadlock?)")
            if terminated is None and any(proc.returncode not in (None, 0) for proc, _ in tasks):
                terminated = time.monotonic()
                for proc, _ in tasks:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
            if terminated is not None and time.monotonic() > terminated + kill_wait_s:
                for proc, _ in tasks:
                    kill_group(proc)
            time.sleep(0.1)
    finally:
        for proc, log in tasks:
            kill_group(proc)
            log.close()
    logs = "".join((out / f"srun-{step}-task{rank}.log").read_text() for rank in range(nodes))
    return [int(proc.returncode) for proc, _ in tasks], logs
