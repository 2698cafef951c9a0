"""Replica groups at scale: nodes of ``k`` alike GPUs, nodes of different speeds, ``replica_size=1`` against
``"node"`` (and ddp), 16 to 1,024 ranks, on the strategy's own round controller (``engine.simulate``).

    python -m benchmarks.simulator.replicas --out benchmarks/results

Model (what the figures do and do not include):

* A node's GPUs are alike (its speed: the mix's, per node); every GPU step draws its own lognormal noise.
* ``replica_size=1``: every GPU is a rank of oscars. ``"node"``: a node is one replica; its step is the slowest of its
  ``k`` GPUs' steps (DDP waits for every gradient) plus the part of the intra-node gradient all-reduce (ring over the
  node's fast link) that backward does not hide. The engine then runs one rank per node whose step times are these.
* A round's averaging, two ways for the replicas (the same bytes: one model per rank, equal within a replica):
  ``all ranks`` (one all-reduce over every rank: NCCL's hierarchical algorithms reduce inside the node, cross the
  network on every GPU's own NIC with ``1/k`` of the model each, gather inside the node) and ``leaders`` (the
  replicas' first ranks all-reduce over one NIC each, then broadcast inside the node). ``replica_size=1`` and ddp
  use the all-ranks cost. Times are ring formulas: no congestion, no topology beyond node / network.
* Throughput is samples per second over the ideal (every GPU always computing); statistical efficiency (``k`` times
  the batch per replica step, fewer models to average) is not modelled.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.simulator.cluster import Cluster, ring_allreduce_time
from benchmarks.simulator.engine import simulate_bsp, simulate_oscars
from benchmarks.tables import markdown_table

__all__ = ["NodeCluster", "replica_row", "replica_study"]

NODES = (2, 4, 8, 16, 32, 64, 128)
MIXES = ("generations", "stragglers")


@dataclass(frozen=True)
class NodeCluster:
    """``nodes`` nodes of ``gpus`` alike GPUs, and the two links (bytes/s, seconds per hop)."""

    nodes: int
    gpus: int = 8
    mix: str = "generations"
    step_time_s: float = 0.1
    noise: float = 0.05
    params: float = 25e6
    bytes_per_param: float = 4.0
    intra_bandwidth: float = 150e9  # NVLink-class, per GPU
    intra_latency: float = 2e-6
    nic_bandwidth: float = 25e9  # one 200 Gb/s NIC per GPU
    inter_latency: float = 5e-6
    backward_overlap: float = 0.5  # share of the intra-node gradient all-reduce hidden behind backward

    @property
    def model_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def node_step_times(self) -> np.ndarray:
        """Mean seconds per step of each node's GPUs: ``generations`` has its first half of nodes at 0.4x speed,
        ``stragglers`` 5% of nodes (at least one) at 0.2x."""
        speed = np.ones(self.nodes)
        if self.mix == "generations":
            speed[: self.nodes // 2] = 0.4
        elif self.mix == "stragglers":
            speed[self.nodes - max(1, round(0.05 * self.nodes)) :] = 0.2
        else:
            raise ValueError(f"unknown mix {self.mix!r}; choose from {MIXES}")
        return self.step_time_s / speed

    def allreduce_all_ranks(self) -> float:
        """One all-reduce of the model over every rank, hierarchically: a reduce-scatter inside each node, an
        all-reduce of each GPU's ``1/k`` across the nodes on its own NIC, an all-gather inside the node."""
        k, m = self.gpus, self.model_bytes
        inside = ring_allreduce_time(k, m, self.intra_bandwidth, self.intra_latency)  # = reduce-scatter + gather
        across = ring_allreduce_time(self.nodes, m / k, self.nic_bandwidth, self.inter_latency)
        return inside + across

    def allreduce_leaders(self) -> float:
        """The replicas' first ranks all-reduce over one NIC each, then broadcast inside their node."""
        across = ring_allreduce_time(self.nodes, self.model_bytes, self.nic_bandwidth, self.inter_latency)
        broadcast = self.model_bytes / self.intra_bandwidth + (self.gpus - 1) * self.intra_latency
        return across + broadcast

    def replica_step_cost(self) -> float:
        """What the intra-node gradient all-reduce adds to a replica's step (the part backward does not hide)."""
        grad = ring_allreduce_time(self.gpus, self.model_bytes, self.intra_bandwidth, self.intra_latency)
        return (1.0 - self.backward_overlap) * grad

    def expected_max_factor(self, seed: int = 0, draws: int = 20000) -> float:
        """The mean of the slowest of ``k`` mean-1 lognormal step factors: a replica waits for its slowest GPU."""
        rng = np.random.default_rng(seed)
        sigma = self.noise
        factors = rng.lognormal(-0.5 * sigma * sigma, sigma, size=(draws, self.gpus))
        return float(factors.max(axis=1).mean())


def replica_row(c: NodeCluster, steps_per_rank: int = 300, seed: int = 0) -> dict[str, Any]:
    """One cluster: ddp, oscars with ``replica_size=1`` and with ``"node"`` (both averaging paths)."""
    node_times = c.node_step_times()
    gpu_times = tuple(float(t) for t in np.repeat(node_times, c.gpus))
    ideal = float(np.sum(1.0 / np.asarray(gpu_times)))  # GPU steps per second, every GPU always computing
    ranks = c.nodes * c.gpus
    all_ranks = c.allreduce_all_ranks()
    per_gpu = Cluster(gpu_times, noise=c.noise)
    total = ranks * steps_per_rank
    bsp = simulate_bsp(per_gpu, total, allreduce_s=all_ranks, overlap=c.backward_overlap, seed=seed)
    single = simulate_oscars(per_gpu, total, allreduce_s=all_ranks, seed=seed)
    # A replica: the slowest of its GPUs plus the gradient all-reduce; its noise is what is left after the max.
    replica_times = tuple(float(t * c.expected_max_factor(seed) + c.replica_step_cost()) for t in node_times)
    per_node = Cluster(replica_times, noise=c.noise / 2)
    replica_units = c.nodes * steps_per_rank
    paths = {"all_ranks": all_ranks, "leaders": c.allreduce_leaders()}
    node = {name: simulate_oscars(per_node, replica_units, allreduce_s=s, seed=seed) for name, s in paths.items()}
    row: dict[str, Any] = {
        "mix": c.mix,
        "nodes": c.nodes,
        "ranks": ranks,
        "allreduce_all_ranks_ms": 1e3 * all_ranks,
        "allreduce_leaders_ms": 1e3 * paths["leaders"],
        "ddp": bsp.throughput / ideal,
        "replica_size=1": single.throughput / ideal,
        "replica_size=1 tau": _span(single.final_local_steps),
    }
    for name, result in node.items():  # a replica step trains k GPUs' batches
        row[f"node, {name}"] = c.gpus * result.throughput / ideal
        row[f"node, {name} tau"] = _span(result.final_local_steps)
    return row


def _span(steps: Sequence[int] | None) -> str:
    return "-" if not steps else f"{min(steps)}-{max(steps)}"


def replica_study(nodes: Sequence[int] = NODES, mixes: Sequence[str] = MIXES, **cluster: Any) -> list[dict[str, Any]]:
    rows = []
    for mix in mixes:
        for n in nodes:
            row = replica_row(NodeCluster(n, mix=mix, **cluster))
            rows.append(row)
            print(
                f"{mix:12s} {row['ranks']:5d} ranks  ddp {row['ddp']:.3f}  replica_size=1 {row['replica_size=1']:.3f}"
                f"  node {row['node, all_ranks']:.3f} / leaders {row['node, leaders']:.3f}",
                flush=True,
            )
    return rows


def markdown(rows: list[dict[str, Any]], setup: str) -> str:
    headers = ["mix", "nodes x 8", "ranks", "ddp", "replica_size=1 (tau)", "node, all ranks (tau)", "node, leaders"]
    headers += ["all-reduce ms: all ranks / leaders"]
    table = [
        [
            r["mix"],
            str(r["nodes"]),
            str(r["ranks"]),
            f"{r['ddp']:.3f}",
            f"{r['replica_size=1']:.3f} ({r['replica_size=1 tau']})",
            f"{r['node, all_ranks']:.3f} ({r['node, all_ranks tau']})",
            f"{r['node, leaders']:.3f}",
            f"{r['allreduce_all_ranks_ms']:.1f} / {r['allreduce_leaders_ms']:.1f}",
        ]
        for r in rows
    ]
    lines = ["Fraction of the ideal throughput (every GPU always computing), simulated.", "", setup, ""]
    return "\n".join(lines + markdown_table(headers, table, "lrrrrrrr")) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--nodes", default=",".join(map(str, NODES)))
    p.add_argument("--mixes", default=",".join(MIXES))
    p.add_argument("--step-time-s", type=float, default=0.1)
    p.add_argument("--params", type=float, default=25e6)
    a = p.parse_args(argv)
    nodes = tuple(int(x) for x in a.nodes.split(","))
    rows = replica_study(nodes, a.mixes.split(","), step_time_s=a.step_time_s, params=a.params)
    c = NodeCluster(1, step_time_s=a.step_time_s, params=a.params)
    setup = (
        f"8 GPUs per node, {a.step_time_s * 1e3:.0f} ms per step at 1x, per-step noise sigma {c.noise}, a model of"
        f" {a.params / 1e6:.0f}M float32 parameters; intra-node {c.intra_bandwidth / 1e9:.0f} GB/s per GPU, one"
        f" {c.nic_bandwidth * 8 / 1e9:.0f} Gb/s NIC per GPU; half of the intra-node gradient all-reduce hidden"
        " behind backward. Command: `python -m benchmarks.simulator.replicas --out benchmarks/results`."
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulator_replicas.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    (out / "simulator_replicas.md").write_text(markdown(rows, setup))
    return rows


if __name__ == "__main__":
    main()
