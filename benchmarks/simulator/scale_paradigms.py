"""Every paradigm at 64 and 1,024 ranks: ddp, oscars, the parameter server's staleness rules and Ripples.

    python -m benchmarks.simulator.scale_paradigms --out benchmarks/results/simulator_paradigms

Writes ``<out>.md`` and ``<out>.json``: throughput (optimizer steps per second summed over ranks, the samples/s
proxy) relative to ddp and the mean idle fraction of every paradigm on three clusters, medians of 3 seeds.

Clusters (1x step ``base_s`` = 0.1 s, lognormal mean-1 per-step jitter ``sigma`` = 0.05 on every rank):

* ``mixed``: issue 12's mix (``jitter.scale_cluster``): 47.5% of the ranks at 1x, 47.5% at 0.4x, 5% at 0.2x
  speed, in that rank order (a job gets its nodes class by class);
* ``homogeneous``: every rank at 1x;
* ``one_in_16``: every 16th rank (15, 31, ...) 5x slower, the rest 1x.

Costs (``allreduce_steps`` = 0.2 fast steps, the issue's figure, at every rank count: a bandwidth-bound ring
all-reduce of a large model costs ``2 (N-1)/N x bytes / bandwidth``, nearly independent of ``N``):

* ddp (``engine.simulate_bsp``): every step, a barrier and the all-reduce, no overlap with backward;
* oscars (``engine.simulate_oscars``, the strategy's own policy, default options, as ``study.py`` runs it):
  its warm-up round, solved local steps, re-solves on drift; one all-reduce per round;
* parameter server (``paradigms.simulate_paradigm`` under ``lightning_oscars.core.staleness``'s rules): every
  iteration pays ``push_s = push_factor x all-reduce`` (2x): with one server shard per rank on the workers' own
  machines, each rank's link carries its own push and pull of the model *and* serves its shard's share of every
  other worker's push and pull, twice a ring all-reduce's traffic; no contention beyond that;
* Ripples (``ripples.simulate_ripples`` on ``lightning_oscars.core.groups.GroupBoard``, groups of 4, buffer 2): one
  partial all-reduce among ``k`` members costs ``all-reduce x ln k / ln N`` (``ripples.log_scaled_exchange``: a
  latency-bound tree; a bandwidth-bound ring would charge ``(k-1)/k`` of it, 2-4x more). The board is *warm*:
  every worker's mean step time known from the start (``ripples.register_all``), the best case for ``smart``;
  the cold board's launch (paces learnt from the requests) is reported apart.

Windows: every figure is counted over a steady-state window ``[start, end]`` of simulated seconds (PS and Ripples
runs stop at ``end``; ddp and oscars run a fixed number of steps and are read from their per-averaging history),
so launch transients (oscars' warm-up, SSP's initial run-ahead of ``s`` clocks, the group generators' start-up)
do not count. 1,024 ranks use shorter windows than 64 (the parameter server's event loop and the
``smart`` generator cost O(N) per event); the windows are in the results.

Not modelled: convergence. Staleness (PS), the partial mixing of Ripples' groups and local SGD's drift change
the accuracy reached per step; these figures are systems throughput only. For that reason the results also give
the PS paradigms' mean staleness (updates applied between a worker's pull and its push) and, for Ripples, how
often a fast worker's group included a slow one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

# The model of every paradigm (scale_models), its fast staleness rules (scale_rules) and the report (scale_report)
# live in modules of their own; their names are re-exported here, where tests and callers import them from.
from benchmarks.simulator.scale_models import (  # noqa: F401
    CLUSTERS,
    PARADIGMS,
    PS_RULES,
    RIPPLES,
    ScaleConfig,
    StepDraws,
    Window,
    _cold_starts,
    _sync_window,
    cluster_times,
    default_windows,
    run_paradigm,
    slow_ranks,
)
from benchmarks.simulator.scale_report import LABELS, _render, _seed_spread, markdown  # noqa: F401
from benchmarks.simulator.scale_rules import (  # noqa: F401
    Windowed,
    _FastASP,
    _FastDASP,
    _FastDSSP,
    _FastSSP,
    _MinTracker,
    _span,
)

__all__ = [
    "CLUSTERS",
    "PARADIGMS",
    "ScaleConfig",
    "StepDraws",
    "cluster_times",
    "main",
    "markdown",
    "run_paradigm",
    "scale_study",
]


def _cell(cfg: ScaleConfig, cluster: str, n: int, progress: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """Every paradigm on one cluster and rank count, every seed; throughput relative to ddp of the same seed."""
    times = cluster_times(cluster, n, cfg.base_s)
    ideal = float(np.sum(1.0 / times))
    runs: dict[str, list[dict[str, Any]]] = {}
    for paradigm in ("ddp", *(p for p in cfg.paradigms if p != "ddp")):
        for seed in cfg.seeds:
            began = time.perf_counter()
            runs.setdefault(paradigm, []).append(run_paradigm(cfg, cluster, n, paradigm, seed))
            runs[paradigm][-1]["cpu_s"] = time.perf_counter() - began
        if progress:
            spent = sum(r["cpu_s"] for r in runs[paradigm])
            progress(f"{cluster:12s} N={n:5d} {paradigm:15s} {spent:6.1f} s")
    rows = []
    for paradigm in cfg.paradigms:
        seeds = runs[paradigm]
        ratios = [r["throughput"] / d["throughput"] for r, d in zip(seeds, runs["ddp"])]
        row: dict[str, Any] = {
            "ranks": n,
            "cluster": cluster,
            "paradigm": paradigm,
            "vs_ddp": statistics.median(ratios),
            "throughput": statistics.median(r["throughput"] for r in seeds),
            "of_ideal": statistics.median(r["throughput"] for r in seeds) / ideal,
            "idle": statistics.median(r["idle"] for r in seeds),
            "window_s": seeds[0]["window_s"],
            "seeds": seeds,
        }
        for key in ("staleness_mean", "staleness_max", "slow_groups_per_fast_worker", "slow_group_share"):
            if key in seeds[0]:
                row[key] = statistics.median(r[key] for r in seeds)
        rows.append(row)
    return rows


def scale_study(cfg: ScaleConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows for every rank count x cluster x paradigm (medians over ``cfg.seeds``)."""
    return [row for n in cfg.ranks for cluster in cfg.clusters for row in _cell(cfg, cluster, n, progress)]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/simulator_paradigms", help="path stem of the .md / .json")
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--paradigms", nargs="+", default=list(PARADIGMS), choices=PARADIGMS)
    p.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=CLUSTERS)
    p.add_argument("--render", action="store_true", help="only re-write the markdown from <out>.json")
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.render:
        out.with_suffix(".md").write_text(_render(out))
        return
    paradigms = ("ddp", *(x for x in a.paradigms if x != "ddp"))  # every ratio needs ddp
    cfg = ScaleConfig(ranks=tuple(a.ranks), clusters=tuple(a.clusters), paradigms=paradigms, seeds=tuple(a.seeds))
    began = time.perf_counter()
    rows = scale_study(cfg, progress=lambda line: print(line, flush=True))
    cold = {n: {**_cold_starts(cfg, n, (0.0, 20.0)), "window": "0-20"} for n in cfg.ranks}
    runtime = time.perf_counter() - began
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(cfg).items() if k != "windows"}
    config["windows"] = {n: cfg.windows(n) for n in cfg.ranks}
    payload = {"config": config, "runtime_s": runtime, "rows": rows, "cold_start": cold}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    report = _render(out)
    out.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
