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
* parameter server (``paradigms.simulate_paradigm`` under ``lightning_oscars.staleness``'s rules): every
  iteration pays ``push_s = push_factor x all-reduce`` (2x): with one server shard per rank on the workers' own
  machines, each rank's link carries its own push and pull of the model *and* serves its shard's share of every
  other worker's push and pull, twice a ring all-reduce's traffic; no contention beyond that;
* Ripples (``ripples.simulate_ripples`` on ``lightning_oscars.groups.GroupBoard``, groups of 4, buffer 2): one
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.simulator.cluster import Cluster
from benchmarks.simulator.engine import SimResult, simulate_bsp, simulate_oscars
from benchmarks.simulator.jitter import scale_cluster
from benchmarks.simulator.ripples import log_scaled_exchange, simulate_ripples
from benchmarks.simulator.server import simulate_paradigm
from benchmarks.tables import markdown_table
from lightning_oscars.staleness import ASP, DASP, DSSP, SSP, StalenessRule, WorkerTimes

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

CLUSTERS = ("mixed", "homogeneous", "one_in_16")
PS_RULES: dict[str, Callable[[], StalenessRule]] = {  # the rules, with O(1) answers (see ``_MinTracker``)
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


def _span(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


class _MinTracker:
    """The minimum of a multiset of integers that enter, leave or grow by one: O(1) amortised per change.

    Why: ``simulate_paradigm`` asks the rule about every waiting worker after every push, and the rules' own
    answers scan all clocks (O(N)): O(N^2) per push, hours per run at 1,024 ranks.
    """

    def __init__(self, values: Sequence[int] = ()) -> None:
        self.count: dict[int, int] = {}
        self.low = min(values, default=0)
        for v in values:
            self.add(v)

    def add(self, v: int) -> None:
        self.count[v] = self.count.get(v, 0) + 1
        self.low = min(self.low, v) if len(self.count) > 1 else v

    def remove(self, v: int) -> None:
        self.count[v] -= 1
        if not self.count[v]:
            del self.count[v]

    def move(self, old: int, new: int) -> None:
        self.remove(old)
        self.add(new)

    def min(self) -> int:
        if self.count:
            while self.low not in self.count:  # the minimum only rises between additions below it
                self.low += 1
        return self.low


class _FastASP(ASP):
    """ASP: nobody waits (the base class builds two O(N) lists to find that out)."""

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        return True


class _FastSSP(SSP):
    """SSP answering from a tracked minimum clock. Exact: ``required = clock - s <= clock``, so the slowest of the
    *others* reaches it iff the slowest of all does."""

    def __init__(self, staleness: int = 3) -> None:
        super().__init__(staleness)
        self.slowest: _MinTracker | None = None

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        super().pushed(worker, clocks, times, now)
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        self.slowest.move(clocks[worker] - 1, clocks[worker])

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        low = self.slowest.min() if self.slowest is not None else min(clocks)
        return low >= clocks[worker] - self.staleness


class _FastDSSP(DSSP):
    """DSSP with the laggards found in one pass and refusals remembered. ``DSSP._extra`` evaluates ``min(clocks)``
    once per worker it scans (O(N^2) per grant). A refused worker holds a grant made at the current slowest clock
    (a worker within ``s_low`` always starts), and its threshold stays until that clock moves: while it does not,
    the answer is the same. Same formula and answers otherwise (a test compares the runs)."""

    def __init__(self, s_low: int = 3, s_range: int = 12) -> None:
        super().__init__(s_low, s_range)
        self.slowest: _MinTracker | None = None
        self.refused: dict[int, int] = {}

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        super().pushed(worker, clocks, times, now)
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        self.slowest.move(clocks[worker] - 1, clocks[worker])
        self.refused.pop(worker, None)

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        low = self.slowest.min() if self.slowest is not None else min(clocks)
        if self.refused.get(worker) == low:
            return False
        if low >= self.required_clock(worker, clocks, times, now):  # ``required <= clock``: as for SSP
            return True
        self.refused[worker] = low
        return False

    def _extra(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> int:
        own = times.iteration_s[worker]
        slowest = min(clocks)
        laggards = [w for w, c in enumerate(clocks) if c == slowest]
        if own <= 0.0 or any(times.iteration_s[w] <= 0.0 for w in laggards):
            return 0
        arrival = max(times.last_push[w] + times.iteration_s[w] for w in laggards)
        return min(range(self.s_range + 1), key=lambda r: (abs(now + r * own - arrival), r))


class _FastDASP(DASP):
    """DASP answering from the tracked slowest synchronous round. Exact: a synchronous worker's requirement is its
    own round, so the slowest of the *other* synchronous workers reaches it iff the slowest of all of them does; an
    asynchronous worker waits for nobody. The tracker follows the pusher (the only worker a push can move)."""

    def __init__(self, leave: float = 1.5, rejoin: float = 1.2, patience: int = 2) -> None:
        super().__init__(leave, rejoin, patience)
        self.slowest: _MinTracker | None = None

    def _round(self, worker: int, clocks: Sequence[int]) -> int:
        return clocks[worker] - self._offset.get(worker, 0)

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        was_sync = worker not in self.asynchronous
        before = self._round(worker, clocks) - 1
        super().pushed(worker, clocks, times, now)
        is_sync = worker not in self.asynchronous
        if was_sync:
            self.slowest.remove(before)
        if is_sync:
            self.slowest.add(self._round(worker, clocks))

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        if worker in self.asynchronous:
            return True
        low = self.slowest.min() if self.slowest is not None else min(clocks)
        return low >= self._round(worker, clocks)


class Windowed(StalenessRule):
    """A staleness rule as ``simulate_paradigm`` runs it, counted over a steady-state window ``[start_s, end_s]``:
    pushes, waits, and the index of the window's first update (for its staleness).

    The throughput is read between the first and the last time the slowest clock moves inside the window: under
    SSP and DSSP every worker's clock is tied to the slowest one's, so a window cut mid-cycle would count a
    fraction of a cycle's burst of pushes as a whole one (+-1 slow iteration per window otherwise).
    """

    def __init__(self, rule: StalenessRule, start_s: float, end_s: float) -> None:
        self.rule, self.name = rule, rule.name
        self.start_s, self.end_s = start_s, end_s
        self.pushes = self.before = 0
        self.since: dict[int, float] = {}
        self.waited_s = 0.0
        self.slowest: _MinTracker | None = None
        self.cycles: list[tuple[float, int]] = []  # (time, pushes so far) when the slowest clock moved

    def __getattr__(self, name: str) -> Any:  # the rule's traces (DASP's ``switches``)
        return getattr(self.rule, name)

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        if not self.rule.may_start(worker, clocks, times, now):
            return False
        self.waited_s += _span(self.since.pop(worker, now), now, self.start_s, self.end_s)
        return True

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        self.rule.pushed(worker, clocks, times, now)
        if now < self.start_s:
            self.before += 1
        else:
            self.pushes += 1
        self.since[worker] = now
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        low = self.slowest.min()
        self.slowest.move(clocks[worker] - 1, clocks[worker])
        if self.slowest.min() != low and now >= self.start_s:
            self.cycles.append((now, self.pushes))

    def throughput(self) -> float:
        """Pushes per second between the window's first and last moves of the slowest clock (the whole window when
        it moved fewer than twice)."""
        if len(self.cycles) >= 2 and self.cycles[-1][0] > self.cycles[0][0]:
            (t0, p0), (t1, p1) = self.cycles[0], self.cycles[-1]
            return (p1 - p0) / (t1 - t0)
        return self.pushes / (self.end_s - self.start_s)

    def idle(self, n: int) -> float:
        """Mean share of the window spent waiting, the waits still open at its end included."""
        open_s = sum(_span(s, self.end_s, self.start_s, self.end_s) for s in self.since.values())
        return (self.waited_s + open_s) / (n * (self.end_s - self.start_s))


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


LABELS = {"mixed": "mixed", "homogeneous": "homogeneous", "one_in_16": "1 in 16 at 5x"}


def markdown(rows: Sequence[dict[str, Any]], cfg: ScaleConfig, cold: dict[str, dict[str, float]] | None = None) -> str:
    """The report: per rank count a table of throughput vs ddp (fraction of ideal) and idle per cluster, then the
    staleness / slow-group figures and the notes."""
    lines = [
        "# Paradigms at scale (simulated)",
        "",
        f"1x step {cfg.base_s} s, lognormal per-step jitter sigma {cfg.sigma}, all-reduce {cfg.allreduce_steps} fast"
        f" steps ({cfg.allreduce_s() * 1e3:.0f} ms), PS push {cfg.push_factor:g} x all-reduce per iteration, Ripples"
        f" groups of {cfg.group_size} (buffer {cfg.buffer_size}), partial all-reduce = all-reduce x ln k / ln N;"
        f" medians of seeds {', '.join(map(str, cfg.seeds))}. Cell: throughput vs ddp (fraction of ideal"
        " sum 1/t_i); idle: mean share of the window a rank waits (communication is not idle).",
        "",
        "**Throughput is not convergence.** Staleness (PS), partial mixing (Ripples) and local SGD's drift (oscars)"
        " change the accuracy reached per step; none of that is modelled here, so a paradigm ahead in this table may"
        " still be behind in time to accuracy.",
        "",
        "Model notes:",
        "",
        "* ddp: a barrier and an all-reduce every step; oscars: the strategy's policy (warm-up, solved local steps,"
        " re-solves), one all-reduce per round; both from ``benchmarks.simulator.engine``.",
        "* Parameter server (``simulate_paradigm``): every iteration pays the push cost on top of the step (one server"
        " shard per rank on the workers' machines: each link carries its own push and pull plus its shard's share of"
        " everyone else's, twice a ring all-reduce's traffic); no server contention beyond that. Its throughput is"
        " read between the first and the last move of the slowest clock inside the window (SSP / DSSP move in bursts"
        " tied to it). Staleness: updates the server applied between a worker's pull and its push, so it grows with"
        " N (about N - 1 for one iteration of every other worker).",
        "* Ripples (``simulate_ripples`` on ``lightning_oscars.groups.GroupBoard``): the board is warm (every"
        " worker's mean step time known at launch), the best case; a cold board's launch is in the last"
        " table. Slow groups: groups of two or more performed by a worker of a faster class that included a worker"
        " of the slowest class, per fast worker over the window. Static groups cut *consecutive* ranks, so on"
        " ``mixed`` (ranks in class order) most of them stay within one speed class: the layout matters to static.",
        "* Every figure is counted over a steady-state window (below), launch transients excluded; the step times of"
        " a seed are common to PS and Ripples (per worker and iteration), ddp and oscars draw their own.",
    ]
    for n in cfg.ranks:
        here = [r for r in rows if r["ranks"] == n]
        clusters = [c for c in cfg.clusters if any(r["cluster"] == c for r in here)]
        headers = ["paradigm"] + [h for c in clusters for h in (f"{LABELS[c]}: vs ddp", "idle")]
        table = []
        for paradigm in cfg.paradigms:
            cells = [paradigm]
            for c in clusters:
                r = next(r for r in here if r["cluster"] == c and r["paradigm"] == paradigm)
                cells += [f"{r['vs_ddp']:.2f}x ({r['of_ideal']:.2f})", f"{r['idle']:.2f}"]
            table.append(cells)
        by_window: dict[Window, list[str]] = {}
        for paradigm in cfg.paradigms:
            by_window.setdefault(tuple(cfg.window(n, paradigm)), []).append(paradigm)  # type: ignore[arg-type]
        spans = "; ".join(f"{', '.join(names)}: {a:g}-{b:g} s" for (a, b), names in by_window.items())
        lines += ["", f"## {n} ranks", "", f"Windows (simulated seconds): {spans}.", ""]
        lines += markdown_table(headers, table, "l" + "rr" * len(clusters))
        lines += _seed_spread(here)
    lines += ["", "## Staleness (PS) and slow workers in Ripples' groups", ""]
    extra_headers = ["ranks", "cluster", "paradigm", "mean staleness", "max staleness", "slow groups / fast worker"]
    extra_headers += ["share of fast workers' groups with a slow one"]
    extra = []
    for r in rows:
        if "staleness_mean" in r:
            extra.append([r["ranks"], LABELS[r["cluster"]], r["paradigm"], f"{r['staleness_mean']:.1f}"])
            extra[-1] += [str(r["staleness_max"]), "-", "-"]
        elif "slow_group_share" in r and r["cluster"] != "homogeneous":
            extra.append([r["ranks"], LABELS[r["cluster"]], r["paradigm"], "-", "-"])
            extra[-1] += [f"{r['slow_groups_per_fast_worker']:.2f}", f"{r['slow_group_share']:.3f}"]
    lines += markdown_table(extra_headers, extra, "rllrrrr")
    if cold:
        lines += ["", "## Ripples from a cold board (homogeneous cluster, seed 0)", ""]
        lines += ["Workers join the board at their first request (as ``GroupBoard`` starts, and as every round starts"]
        lines += ["after ``end_round``); fraction of ideal over the window, counted from the launch.", ""]
        table = [[n, c["window"], *(f"{c[p]:.3f}" for p in RIPPLES)] for n, c in cold.items()]
        lines += markdown_table(["ranks", "window s", *RIPPLES], table, "rr" + "r" * len(RIPPLES))
    return "\n".join(lines) + "\n"


def _seed_spread(rows: Sequence[dict[str, Any]], factor: float = 1.5) -> list[str]:
    """Lines naming the configurations whose seeds disagree by more than ``factor`` in throughput, with every
    seed's throughput vs ddp: there the median is one regime (e.g. a run still in its launch transient)."""
    ddp = {r["cluster"]: r for r in rows if r["paradigm"] == "ddp"}
    out = []
    for r in rows:
        values = [s["throughput"] for s in r["seeds"]]
        if min(values) <= 0 or max(values) / min(values) > factor:
            base = ddp[r["cluster"]]["seeds"]
            ratios = ", ".join(f"{s['throughput'] / d['throughput']:.2f}x" for s, d in zip(r["seeds"], base))
            out.append(f"* {LABELS[r['cluster']]}, {r['paradigm']}: per seed {ratios} vs ddp.")
    return ["", "Seeds that disagree (the median is one of them):", "", *out] if out else []


def _render(stem: Path) -> str:
    """The markdown of a study already run, from its JSON (to re-render the report without re-running it)."""
    payload = json.loads(stem.with_suffix(".json").read_text())
    config = dict(payload["config"])
    windows = {int(n): {k: tuple(v) for k, v in w.items()} for n, w in config.pop("windows").items()}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    cfg = ScaleConfig(**fields, windows=lambda n: windows[n])
    cold = {int(n): c for n, c in payload.get("cold_start", {}).items()}
    return markdown(payload["rows"], cfg, cold) + f"\nStudy runtime: {payload['runtime_s']:.0f} s.\n"


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
