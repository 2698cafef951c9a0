"""Sharded replicas at scale: a 7B-parameter model on nodes of 8 GPUs of two generations, oscars' balanced rounds
over FSDP2 replicas (``shard_replicas=True``, ``replica_size="node"``) against DDP replicas, against torchft-style
replicas that all take one fixed ``sync_every`` per round, and against synchronous training (ddp's schedule over
sharded replicas), on the strategy's own round controller (``engine.simulate``).

    python -m benchmarks.simulator.sharded --out benchmarks/results

Model (what the figures do and do not include), on top of ``replicas.py``'s:

* A sharded replica's step: the slowest of its ``k`` GPUs plus the part of FSDP2's three ring collectives inside the
  node (the parameters all-gathered for forward and again for backward, the gradients reduce-scattered; bf16 on the
  wire) that prefetching does not hide. A DDP replica's step: the slowest GPU plus the unhidden part of the
  gradient all-reduce (fp32).
* A round's averaging: sharded, each GPU all-reduces its ``1/k`` shard (fp32) across the nodes on its own NIC, with
  nothing inside the node; DDP replicas, the whole model hierarchically (``NodeCluster.allreduce_all_ranks``).
* Memory per GPU: parameters, gradients and Adam's two moments in fp32 (16 bytes per parameter), divided by ``k``
  when sharded. A DDP replica of a 7B model needs 112 GB per GPU: it does not fit an 80 GB GPU, and its throughput
  column is what it would do if it did.
* torchft-style: the same sharded replicas, every replica ``sync_every`` steps per round (the mean of oscars' solved
  steps, so that rounds are as long), the fast nodes waiting at each sync.
* Throughput is samples per second over the ideal (every GPU always computing). Statistical efficiency is not
  modelled; times are ring formulas, no congestion.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.simulator.cluster import Cluster, ring_allreduce_time
from benchmarks.simulator.engine import simulate_bsp, simulate_local_sgd, simulate_oscars
from benchmarks.simulator.replicas import NodeCluster
from benchmarks.tables import markdown_table

__all__ = ["ShardedCluster", "sharded_row"]

NODES = (16, 128)
MIXES = ("generations", "stragglers")
STATE_BYTES_PER_PARAM = 16.0  # fp32 parameters, gradients and Adam's two moments


@dataclass(frozen=True)
class ShardedCluster(NodeCluster):
    """A :class:`NodeCluster` training a large model: FSDP2's per-step collectives and the shard averaging."""

    params: float = 7e9
    step_time_s: float = 2.0  # a 7B model's step on the fast generation
    wire_bytes_per_param: float = 2.0  # bf16 all-gathers and reduce-scatters
    fsdp_overlap: float = 0.8  # share of FSDP2's collectives that prefetching hides behind compute

    def fsdp_step_cost(self) -> float:
        """Two all-gathers and one reduce-scatter inside the node, each half a ring all-reduce, less what is hidden."""
        ring = ring_allreduce_time(self.gpus, self.params * self.wire_bytes_per_param, self.intra_bandwidth, 0.0)
        latency = 3 * (self.gpus - 1) * self.intra_latency
        return (1.0 - self.fsdp_overlap) * (1.5 * ring + latency)

    def shard_averaging(self) -> float:
        """Each GPU's ``1/k`` shard all-reduced across the nodes on its own NIC."""
        return ring_allreduce_time(self.nodes, self.model_bytes / self.gpus, self.nic_bandwidth, self.inter_latency)

    def memory_gb(self, sharded: bool) -> float:
        return STATE_BYTES_PER_PARAM * self.params / (self.gpus if sharded else 1) / 1e9


def sharded_row(c: ShardedCluster, steps_per_replica: int = 300, seed: int = 0) -> dict[str, Any]:
    node_times = c.node_step_times()
    ideal = float(np.sum(c.gpus / node_times))  # GPU steps per second, every GPU always computing
    slowest = c.expected_max_factor(seed)
    sharded = Cluster(tuple(float(t * slowest + c.fsdp_step_cost()) for t in node_times), noise=c.noise / 2)
    ddp_replicas = Cluster(tuple(float(t * slowest + c.replica_step_cost()) for t in node_times), noise=c.noise / 2)
    units = c.nodes * steps_per_replica
    averaging = c.shard_averaging()
    oscars = simulate_oscars(sharded, units, allreduce_s=averaging, seed=seed)
    period = max(1, round(float(np.mean(oscars.final_local_steps or [1]))))
    fixed = simulate_local_sgd(sharded, units, allreduce_s=averaging, period=period, seed=seed)
    ddp = simulate_oscars(ddp_replicas, units, allreduce_s=c.allreduce_all_ranks(), seed=seed)
    synchronous = simulate_bsp(sharded, units, allreduce_s=averaging, overlap=0.5, seed=seed)
    share = {
        name: c.gpus * r.throughput / ideal
        for name, r in {"sharded": oscars, "fixed": fixed, "ddp_replicas": ddp, "sync": synchronous}.items()
    }
    return {
        "mix": c.mix,
        "nodes": c.nodes,
        "gpus": c.nodes * c.gpus,
        "oscars, sharded replicas": share["sharded"],
        "oscars, sharded tau": _span(oscars.final_local_steps),
        "fixed sync_every (torchft-style)": share["fixed"],
        "sync_every": period,
        "oscars, DDP replicas": share["ddp_replicas"],
        "synchronous, sharded": share["sync"],
        "fsdp_step_ms": 1e3 * c.fsdp_step_cost(),
        "shard_averaging_ms": 1e3 * averaging,
        "ddp_replica_averaging_ms": 1e3 * c.allreduce_all_ranks(),
        "memory_gb_sharded": c.memory_gb(True),
        "memory_gb_ddp_replica": c.memory_gb(False),
    }


def _span(steps: Any) -> str:
    return "-" if not steps else f"{min(steps)}-{max(steps)}"


def markdown(rows: list[dict[str, Any]], setup: str) -> str:
    headers = [
        "mix",
        "nodes x 8",
        "oscars, sharded (tau)",
        "fixed sync_every (H)",
        "oscars, DDP replicas*",
        "synchronous, sharded",
        "GB per GPU sharded / DDP",
    ]
    body = [
        [
            r["mix"],
            str(r["nodes"]),
            f"{r['oscars, sharded replicas']:.3f} ({r['oscars, sharded tau']})",
            f"{r['fixed sync_every (torchft-style)']:.3f} ({r['sync_every']})",
            f"{r['oscars, DDP replicas']:.3f}",
            f"{r['synchronous, sharded']:.3f}",
            f"{r['memory_gb_sharded']:.0f} / {r['memory_gb_ddp_replica']:.0f}",
        ]
        for r in rows
    ]
    table = "\n".join(markdown_table(headers, body))
    return f"# Sharded replicas at scale (simulated)\n\n{setup}\n\n{table}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    rows = []
    for mix in MIXES:
        for nodes in NODES:
            row = sharded_row(ShardedCluster(nodes, mix=mix))
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
    setup = (
        "Fraction of ideal throughput (every GPU always computing). A 7B-parameter model, nodes of 8 GPUs (NVLink-class"
        " inside, one 200 Gb/s NIC per GPU), two GPU generations (`generations`: half the nodes at 0.4x speed;"
        " `stragglers`: 5% of nodes at 0.2x), 2 s per step on the fast generation, FSDP2 collectives in bf16 of which"
        " 80% are hidden. *A DDP replica of this model needs 112 GB per GPU and does not fit an 80 GB GPU: its column"
        " is what it would do if it did. Command: `python -m benchmarks.simulator.sharded --out benchmarks/results`."
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulator_sharded.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    (out / "simulator_sharded.md").write_text(markdown(rows, setup))


if __name__ == "__main__":
    main()
