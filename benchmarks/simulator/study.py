"""The scaling study: BSP, fixed-period local SGD and oscars on 8 .. 1,024 ranks of named speed mixes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.simulator.cluster import Cluster, ring_allreduce_time
from benchmarks.simulator.engine import simulate_bsp, simulate_local_sgd, simulate_oscars
from benchmarks.simulator.policies import OscarsPolicy

__all__ = ["MIXES", "PARADIGMS", "RANKS", "StudyConfig", "mix_step_times", "scaling_study"]

MIXES = ("generations", "stragglers", "generations+stragglers")
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
PARADIGMS = ("bsp", "local_sgd", "oscars")


def mix_step_times(mix: str, n: int, base_s: float) -> tuple[tuple[float, ...], tuple[str, ...]]:
    """Mean step times and speed-class labels of ``n`` ranks for a named mix.

    * ``generations``: the first ``n // 2`` ranks a previous GPU generation at 0.4x speed, the rest 1x.
    * ``stragglers``: ``max(1, round(5% of n))`` ranks at 0.2x speed (degraded nodes), the rest 1x.
    * ``generations+stragglers``: both; the stragglers are taken from the 1x ranks.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose from {MIXES}")
    speed = np.ones(n)
    label = np.array(["1x"] * n, dtype=object)
    if "generations" in mix:
        speed[: n // 2], label[: n // 2] = 0.4, "0.4x"
    if "stragglers" in mix:
        count = max(1, round(0.05 * n))
        fast = np.flatnonzero(speed == 1.0)
        chosen = fast[len(fast) - count :]
        speed[chosen], label[chosen] = 0.2, "0.2x"
    return tuple(float(base_s / s) for s in speed), tuple(str(x) for x in label)


@dataclass(frozen=True)
class StudyConfig:
    """Knobs of the scaling study (all exposed on the command line)."""

    ranks: tuple[int, ...] = RANKS
    mixes: tuple[str, ...] = MIXES
    step_time_s: float = 0.1
    noise: float = 0.05
    params: float = 25e6
    bytes_per_param: float = 4.0
    bandwidth: float = 10e9
    latency: float = 5e-6
    local_period: int = 8
    overlap: float = 0.0
    steps_per_rank: int = 1000
    seed: int = 0

    def allreduce_s(self, n: int) -> float:
        return ring_allreduce_time(n, self.params * self.bytes_per_param, self.bandwidth, self.latency)


def _cell(cfg: StudyConfig, m: int, mix: str, n: int) -> dict[str, Any]:
    """One mix x rank count: every paradigm on the same seed (common random numbers, so differences are not noise)."""
    times, classes = mix_step_times(mix, n, cfg.step_time_s)
    cluster = Cluster(times, noise=cfg.noise)
    cost = cfg.allreduce_s(n)
    total = n * cfg.steps_per_rank
    seed = [cfg.seed, m, n]
    # oscars_oracle: the same rules, but solved up front from the true mean step times and all-reduce cost: how
    # much the strategy's profiling (warm-up medians, first solve at cost 0) leaves on the table.
    oracle = OscarsPolicy(initial_step_times=times, initial_allreduce_s=cost, name="oscars_oracle")
    runs = {
        "bsp": simulate_bsp(cluster, total, allreduce_s=cost, overlap=cfg.overlap, seed=seed),
        "local_sgd": simulate_local_sgd(cluster, total, allreduce_s=cost, period=cfg.local_period, seed=seed),
        "oscars": simulate_oscars(cluster, total, allreduce_s=cost, seed=seed),
        "oscars_oracle": simulate_oscars(cluster, total, allreduce_s=cost, seed=seed, policy=oracle),
    }
    row: dict[str, Any] = {"mix": mix, "ranks": n, "allreduce_s": cost, "ideal_throughput": cluster.ideal_throughput}
    for name, res in runs.items():
        row[name] = res.summary(cluster.ideal_throughput, classes)
    return row


def scaling_study(cfg: StudyConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every mix x rank count x paradigm, ``steps_per_rank`` x N optimizer steps each (the warm-up included).

    The three paradigms of one cell share a seed (common random numbers), so their differences are not noise.
    """
    rows = []
    for m, mix in enumerate(cfg.mixes):
        for n in cfg.ranks:
            row = _cell(cfg, m, mix, n)
            rows.append(row)
            if progress:
                progress(
                    f"{mix:24s} N={n:5d} "
                    + " ".join(f"{k} {row[k]['fraction_of_ideal']:.3f}" for k in PARADIGMS)
                    + f"  oscars tau {row['oscars']['final_local_steps']}"
                )
    return rows
