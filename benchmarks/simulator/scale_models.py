"""The model of every paradigm at scale (see ``scale_paradigms``' docstring): the named clusters, the study's knobs
and windows, the per-worker step draws every event-driven paradigm shares, and one run of one paradigm on one
cluster and seed (ddp and oscars on ``engine``, the parameter server on ``server``, Ripples on ``ripples``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.simulator.cluster import Cluster
from benchmarks.simulator.engine import SimResult, simulate_bsp, simulate_oscars
from benchmarks.simulator.jitter import scale_cluster
from benchmarks.simulator.ripples import log_scaled_exchange, simulate_ripples
from benchmarks.simulator.scale_rules import Windowed, _FastASP, _FastDASP, _FastDSSP, _FastSSP
from benchmarks.simulator.server import simulate_paradigm
from lightning_oscars.core.staleness import StalenessRule

__all__ = [
    "CLUSTERS",
    "PARADIGMS",
    "ScaleConfig",
    "StepDraws",
    "cluster_times",
    "run_paradigm",
]

CLUSTERS = ("mixed", "homogeneous", "one_in_16")
PS_RULES: dict[str, Callable[[], StalenessRule]] = {  # the rules, with O(1) answers (see ``scale_rules._MinTracker``)
    "asp": lambda: _FastASP(),
    "ssp3": lambda: _FastSSP(3),
    "ssp15": lambda: _FastSSP(15),
    "dssp": lambda: _FastDSSP(),
    "dasp": lambda: _FastDASP(),
}
RIPPLES = {"ripples_static": "static", "ripples_random": "random", "ripples_smart": "smart"}
PARADIGMS = ("ddp", "oscars", *PS_RULES, *RIPPLES)
Window = tuple[float, float]


def default_windows(n: int) -> dict[str, Window]:
    """Steady-state windows ``(start_s, end_s)``: per family (``sync``, ``ps``, ``ripples``), or per paradigm where
    its launch transient is longer: SSP s=15's run-ahead (the 0.4x ranks need ~9 s to get 15 clocks ahead of the
    0.2x ones). 1,024 ranks
    get shorter windows: the parameter server's event loop visits every waiting worker at every push."""
    if n <= 256:
        return {"sync": (10.0, 60.0), "ps": (12.0, 42.0), "ripples": (20.0, 50.0)}
    return {
        "sync": (10.0, 40.0),
        "ps": (3.0, 6.0),
        "ssp15": (11.0, 13.5),
        "ripples": (10.0, 20.0),
        "ripples_smart": (6.0, 10.0),  # the smart generator costs O(N) per request
    }


@dataclass(frozen=True)
class ScaleConfig:
    """Knobs of the study (see the module docstring)."""

    ranks: tuple[int, ...] = (64, 1024)
    clusters: tuple[str, ...] = CLUSTERS
    paradigms: tuple[str, ...] = PARADIGMS
    seeds: tuple[int, ...] = (0, 1, 2)
    base_s: float = 0.1
    sigma: float = 0.05
    allreduce_steps: float = 0.2
    push_factor: float = 2.0
    group_size: int = 4
    buffer_size: int = 2
    windows: Callable[[int], dict[str, Window]] = field(default=default_windows, compare=False)

    def allreduce_s(self) -> float:
        return self.allreduce_steps * self.base_s

    def window(self, n: int, paradigm: str) -> Window:
        family = "sync" if paradigm in ("ddp", "oscars") else "ps" if paradigm in PS_RULES else "ripples"
        table = self.windows(n)
        return table.get(paradigm, table[family])


def cluster_times(name: str, n: int, base_s: float) -> np.ndarray:
    """Mean step times of ``n`` ranks of a named cluster (see the module docstring)."""
    if name == "mixed":
        return scale_cluster(n, base_s)
    if name == "homogeneous":
        return np.full(n, base_s)
    if name == "one_in_16":
        return np.where(np.arange(n) % 16 == 15, 5.0 * base_s, base_s)
    raise ValueError(f"unknown cluster {name!r}; choose from {CLUSTERS}")


def slow_ranks(times: np.ndarray) -> list[int]:
    """The ranks of the slowest class (none on a homogeneous cluster)."""
    if np.ptp(times) == 0:
        return []
    return [int(i) for i in np.flatnonzero(times == times.max())]


class StepDraws:
    """``(worker, iteration, now) -> seconds``: the mean step time times a mean-1 lognormal draw, one stream per
    worker, so a step's time depends on (seed, worker, iteration) only: every event-driven paradigm of a seed sees
    the same steps (common random numbers) whatever order it asks in."""

    def __init__(self, times: Sequence[float], sigma: float, seed: int, chunk: int = 256) -> None:
        self.times, self.sigma, self.chunk = [float(t) for t in times], sigma, chunk
        self.rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(self.times))]
        self.rows: list[list[float]] = [[] for _ in self.times]

    def __call__(self, worker: int, iteration: int, now: float) -> float:
        row = self.rows[worker]
        while iteration >= len(row):
            z = self.rngs[worker].standard_normal(self.chunk)
            row.extend((self.times[worker] * np.exp(self.sigma * z - 0.5 * self.sigma**2)).tolist())
        return row[iteration]


def _sync_window(res: SimResult, allreduce_s: float, n: int, start_s: float) -> dict[str, float]:
    """Throughput and idle fraction of a ddp / oscars run over its averagings that start at ``start_s`` or later
    (from its history: records carry their end time, samples and compute times)."""
    records = res.history
    begin = [0.0] + [r["time"] for r in records[:-1]]
    kept = [(b, r) for b, r in zip(begin, records) if b >= start_s] or list(zip(begin, records))
    first = kept[0][0]
    seconds = res.wall_s - first
    steps = sum(sum(r["samples"]) for _, r in kept)
    idle = sum(n * (r["time"] - b - allreduce_s) - sum(r["compute_times"]) for b, r in kept)
    return {"throughput": steps / seconds, "idle": idle / (n * seconds), "window_s": [first, res.wall_s]}


def run_paradigm(cfg: ScaleConfig, cluster: str, n: int, paradigm: str, seed: int) -> dict[str, Any]:
    """One paradigm on one cluster and seed: throughput (steps/s summed over ranks), mean idle fraction, extras."""
    times = cluster_times(cluster, n, cfg.base_s)
    start, end = cfg.window(n, paradigm)
    allreduce = cfg.allreduce_s()
    if paradigm in ("ddp", "oscars"):
        sim = Cluster(tuple(float(t) for t in times), noise=cfg.sigma)
        total = int(np.sum(1.0 / times) * end)  # about ``end`` seconds of the cluster at its ideal throughput
        run = simulate_bsp if paradigm == "ddp" else simulate_oscars
        res = run(sim, total, allreduce_s=allreduce, seed=[seed, n], record_batch_size=1)
        return _sync_window(res, allreduce, n, start)
    draws = StepDraws(times, cfg.sigma, seed)
    if paradigm in PS_RULES:
        rule = Windowed(PS_RULES[paradigm](), start, end)
        ps = simulate_paradigm(rule, draws, end, push_s=cfg.push_factor * allreduce, world_size=n)
        staleness = ps.staleness[rule.before :]
        return {
            "throughput": rule.throughput(),
            "idle": rule.idle(n),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness_max": int(max(staleness, default=0)),
            "window_s": [start, end],
        }
    slow = slow_ranks(times)
    run = simulate_ripples(
        draws,
        n,
        duration_s=end,
        warmup_s=start,
        group_size=cfg.group_size,
        generator=RIPPLES[paradigm],  # type: ignore[arg-type]
        exchange_s=log_scaled_exchange(allreduce, n),
        buffer_size=cfg.buffer_size,
        seed=seed,
        slow=slow,
        warm_start=True,
        paces=times.tolist(),
    )
    fast = [i for i in range(n) if i not in set(slow)]
    groups = sum(run.groups[i] for i in fast)
    with_slow = sum(run.slow_groups[i] for i in fast)
    return {
        "throughput": run.updates_per_s,
        "idle": run.idle_fraction,
        "groups_per_worker": float(np.mean(run.groups)),
        "slow_groups_per_fast_worker": with_slow / len(fast),
        "slow_group_share": with_slow / groups if groups else 0.0,
        "window_s": [start, end],
    }


def _cold_starts(cfg: ScaleConfig, n: int, window: Window) -> dict[str, float]:
    """Ripples on a cold board (workers join at their first request), homogeneous cluster, seed 0: fraction of
    ideal over ``window`` from the launch."""
    times = cluster_times("homogeneous", n, cfg.base_s)
    out = {}
    for paradigm, generator in RIPPLES.items():
        run = simulate_ripples(
            StepDraws(times, cfg.sigma, 0),
            n,
            duration_s=window[1],
            warmup_s=window[0],
            group_size=cfg.group_size,
            generator=generator,  # type: ignore[arg-type]
            exchange_s=log_scaled_exchange(cfg.allreduce_s(), n),
            buffer_size=cfg.buffer_size,
        )
        out[paradigm] = run.updates_per_s / float(np.sum(1.0 / times))
    return out
