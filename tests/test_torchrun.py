"""Multi-node launch: 2 "nodes" x 1 process on loopback, started the way a cluster would start them, one launcher
per node. Lightning picks up the cluster environment from the launcher's variables (it starts no process of its
own); oscars must balance the load and average across the nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subproc import ROOT, clean_env, free_port, kill_group, start

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120
JOB = str(ROOT / "tests" / "torchrun_job.py")


def _run_nodes(commands: list[tuple[list[str], dict[str, str]]], out: Path, ranks: int = 2) -> list[dict]:
    """Start every node's command at once; a shared hard deadline kills all of them (one hung node leaves the
    others waiting at the rendezvous). Returns each global rank's JSON."""
    nodes = [start(cmd, env) for cmd, env in commands]
    deadline = time.monotonic() + TIMEOUT
    logs, timed_out = [], False
    for proc in nodes:
        try:
            log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for other in nodes:
                if other.poll() is None:
                    kill_group(other)
            log, _ = proc.communicate()
        logs.append(log)
    report = "\n".join(
        f"--- node {i} (exit {p.returncode})\n{log[-3000:]}" for i, (p, log) in enumerate(zip(nodes, logs))
    )
    assert not timed_out, f"nodes did not finish within {TIMEOUT}s (deadlock?)\n{report}"
    assert [p.returncode for p in nodes] == [0] * len(nodes), report
    results = []
    for rank in range(ranks):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result\n{report}"
        results.append(json.loads(path.read_text()))
    return results


def _check_balanced_and_agreed(results: list[dict], environment: str) -> None:
    fast, slow = results
    for r in results:
        assert "error" not in r, r["error"]
        assert r["strategy"] == "OscarsStrategy" and r["cluster_environment"] == environment
        assert r["world_size"] == 2 and r["local_rank"] == 0
    assert (fast["node_rank"], slow["node_rank"]) == (0, 1)
    # Averaged to identical weights, in lockstep, on the same schedule.
    assert fast["weights"] == slow["weights"], "ranks ended with different weights"
    assert fast["global_step"] == slow["global_step"] > 0
    assert fast["schedule"] == slow["schedule"] and fast["num_averagings"] == slow["num_averagings"] > 0
    # Load balance: rank 1 is 3x slower, so rank 0 takes more local steps and trains on more data.
    assert fast["schedule"][0] > fast["schedule"][1], fast["schedule"]
    assert fast["steps_taken"] > slow["steps_taken"]
    assert fast["seen"] + slow["seen"] == 2 * 512  # every sample once per epoch, 2 epochs


def test_two_nodes_by_torchrun(tmp_path):
    port = free_port()
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    rendezvous = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    commands = [([*torchrun, f"--node-rank={node}", *rendezvous, JOB, str(tmp_path)], env) for node in (0, 1)]
    _check_balanced_and_agreed(_run_nodes(commands, tmp_path), "TorchElasticEnvironment")


@pytest.mark.parametrize("shard", [False, True])
def test_two_nodes_of_two_ranks_train_as_two_replicas_by_torchrun(tmp_path, shard):
    """``replica_size="node"``: the ranks of a node are one replica (DDP inside, or the model sharded between them
    with ``shard_replicas``), the nodes are balanced."""
    port = free_port()
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_NODE_REPLICAS="1")
    env["OSCARS_TEST_SHARD"] = "1" if shard else "0"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2"]
    rendezvous = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    commands = [([*torchrun, f"--node-rank={node}", *rendezvous, JOB, str(tmp_path)], env) for node in (0, 1)]
    results = _run_nodes(commands, tmp_path, ranks=4)
    for r in results:
        assert "error" not in r, r["error"]
        assert r["world_size"] == 4 and r["replica"] == r["node_rank"] == r["rank"] // 2
        assert r["sharded"] == shard
    assert len({json.dumps(r["weights"]) for r in results}) == 1, "ranks ended with different weights"
    schedule = results[0]["schedule"]
    assert all(r["schedule"] == schedule for r in results) and len(schedule) == 2, "one entry per replica (node)"
    assert schedule[0] > schedule[1], f"the faster node takes more local steps: {schedule}"
    seen = [r["seen"] for r in results]
    assert seen[0] + seen[1] > seen[2] + seen[3] and sum(seen) == 2 * 512, seen  # every sample once per epoch


def test_two_nodes_as_srun_starts_them(tmp_path):
    # What `srun` exports to each task of `sbatch --nodes=2 --ntasks-per-node=1`; no SLURM needed.
    port = str(free_port())
    commands = []
    for node in (0, 1):
        env = clean_env(
            OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20),
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="oscars_test",
            SLURM_NNODES="2",
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="1",
            SLURM_NODELIST="127.0.0.1",
            SLURM_PROCID=str(node),
            SLURM_LOCALID="0",
            SLURM_NODEID=str(node),
            MASTER_PORT=port,  # SLURMEnvironment would derive one from the job id; a free one avoids clashes
        )
        commands.append(([sys.executable, JOB, str(tmp_path)], env))
    _check_balanced_and_agreed(_run_nodes(commands, tmp_path), "SLURMEnvironment")
