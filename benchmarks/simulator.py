"""Discrete-event simulator of a heterogeneous cluster: BSP (ddp) vs fixed-period local SGD vs oscars.

    python -m benchmarks.simulator --out benchmarks/results
    python -m benchmarks.simulator --validate benchmarks/results/heterogeneous.json --out benchmarks/results
    python -m benchmarks.simulator --validate benchmarks/results/heterogeneous.json \\
        --step-times 0.00335,0.01005 --allreduce-s 0.0038 --ddp-overhead-s 0.0086

Writes ``simulator.json``, ``simulator.md`` (validation table and scaling tables) and ``simulator.png`` (fraction
of the ideal throughput and utilisation vs number of ranks, one panel per speed mix) to ``--out``.

Why: the real benchmark (``benchmarks.heterogeneous``) has 2 CPU ranks. The simulator, checked against those
2-rank measurements, extrapolates the three paradigms to 8 .. 1,024 ranks, where the questions that matter are
whether the barrier waits, the per-step noise of many ranks and the all-reduce latency term eat the gain.

Model and assumptions (what the numbers do and do not include):

* Every rank ``i`` has a mean step time ``t_i`` (seconds per optimizer step, data loading included). A step's
  time is ``t_i * f_i(t) * e`` with ``e`` lognormal of mean 1 (``sigma`` = ``noise``), independent across steps
  and ranks, and ``f_i(t)`` an optional piecewise-constant slowdown profile ("rank r is k x slower from t s"),
  read at the start of each round (exact for BSP, whose rounds are one step).
* A round: rank ``i`` runs ``tau_i`` local steps, then idles through ``max tau - tau_i`` no-op slots at
  ``noop_s`` each (the strategy's lock-step slots: Lightning still runs its loop around an empty batch; the
  scaling study takes 0, the 2-rank CPU benchmark about 1 ms), waits at the barrier for the last rank, then
  every rank pays one all-reduce of the model. BSP is the round with ``tau_i = 1`` whose all-reduce (of the
  gradients, same size) is hidden behind backward by ``overlap``.
* All-reduce cost: ring, ``2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency`` (0 for one rank); no topology,
  no congestion, the same every round, no overlap of local SGD's averaging with compute.
* Oscars mirrors ``OscarsStrategy``: a warm-up round of ``warmup_steps`` steps per rank; per round the median
  of each rank's step times, smoothed by an EMA (``smoothing``); the first solve happens after the warm-up
  with an all-reduce cost of 0 (the strategy has not timed an all-reduce yet), later re-solves only when a
  rank's smoothed time drifted by more than ``rebalance_threshold``, adopted only if predicted ``min_gain``
  faster. At the end of an epoch the last round is cut to the data left (proportionally to ``tau``); in the
  validation the first epoch is padded with no-op slots up to ``total_units`` slots, as the strategy sizes it
  before the speeds are known.
* Validation (``--validate``): per-rank step times, the averaging and DDP per-step costs, no-op slot, epoch and
  startup overheads are inputs (command line over optional JSON fields over dev-box defaults; every source
  is reported); the simulator predicts train time, wall time and samples/s, and a sensitivity table shows
  how the error moves with each input.
* Outputs are systems figures: optimizer steps per second summed over ranks (= samples/s / batch size),
  utilisation (compute time / (N x wall)) and per-rank idle fraction (barrier waits and no-op slots / wall).
  Statistical efficiency (accuracy per step of local SGD vs BSP) is not modelled.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lightning_oscars.solver import Schedule, solve_schedule

__all__ = [
    "Cluster",
    "FixedPolicy",
    "OscarsPolicy",
    "SimResult",
    "Slowdown",
    "StudyConfig",
    "ValidationInputs",
    "mix_step_times",
    "parse_slowdown",
    "predict",
    "ring_allreduce_time",
    "scaling_study",
    "simulate",
    "simulate_bsp",
    "simulate_local_sgd",
    "simulate_oscars",
    "validate_against",
    "validation_inputs",
]

MIXES = ("generations", "stragglers", "generations+stragglers")
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
PARADIGMS = ("bsp", "local_sgd", "oscars")

# Inputs of the 2-rank validation when neither the results JSON nor the command line gives them, measured on the
# 2-vCPU development box (torch 2.13 CPU, 1 thread per rank) while other jobs shared it (read them as +-20%):
# * step: median time between batch ends of a 1-device Lightning fit of benchmarks.task (data fetch included);
# * all-reduce: the strategy's own `allreduce_time` in a 2-rank oscars run at 1:3;
# * DDP overhead: a 2-rank ddp step at 1:1 (12.0 ms between batch ends) minus the local step;
# * no-op slot: between 0.6 ms (batch-end-to-batch-end minus hook time of a real step, 1 device) and 1.7 ms
#   (the slow rank's no-op slots in a 2-rank oscars run, contended); the weakest input, see the sensitivity table;
# * epoch overhead: a 1-device epoch minus its 256 steps (validation on 4,096 samples + epoch turnover).
DEV_BOX_STEP_S = 3.35e-3
DEV_BOX_ALLREDUCE_S = 3.8e-3
DEV_BOX_DDP_OVERHEAD_S = 8.6e-3
DEV_BOX_NOOP_S = 1.0e-3
DEV_BOX_EPOCH_OVERHEAD_S = 0.15


# ---------------------------------------------------------------------------------------------- cost model


def ring_allreduce_time(n_ranks: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of one ring all-reduce: a reduce-scatter and an all-gather, each ``N-1`` hops of ``bytes/N``."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if n_ranks == 1:
        return 0.0
    if bandwidth <= 0 or nbytes < 0 or latency < 0:
        raise ValueError("bandwidth must be > 0, nbytes and latency >= 0")
    return 2.0 * (n_ranks - 1) / n_ranks * nbytes / bandwidth + 2.0 * (n_ranks - 1) * latency


# ---------------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Slowdown:
    """Rank ``rank`` runs ``factor`` times slower from ``start_s`` seconds of training on (until a later entry)."""

    rank: int
    start_s: float
    factor: float


@dataclass(frozen=True)
class Cluster:
    """The simulated ranks.

    Attributes:
        step_times: mean seconds per optimizer step of every rank (before any slowdown profile).
        noise: sigma of the mean-1 lognormal factor drawn for every step.
        slowdowns: time-varying slowdown profiles.
        noop_s: seconds of one no-op slot, per rank or one value for all (local SGD with unequal ``tau``).
    """

    step_times: tuple[float, ...]
    noise: float = 0.0
    slowdowns: tuple[Slowdown, ...] = ()
    noop_s: float | tuple[float, ...] = 0.0

    def __post_init__(self) -> None:
        if not self.step_times or any(not (t > 0 and math.isfinite(t)) for t in self.step_times):
            raise ValueError("step_times must be non-empty, finite and > 0")
        if self.noise < 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")
        for s in self.slowdowns:
            if not 0 <= s.rank < len(self.step_times) or s.factor <= 0 or s.start_s < 0:
                raise ValueError(f"invalid slowdown {s}")

    @property
    def n(self) -> int:
        return len(self.step_times)

    @property
    def ideal_throughput(self) -> float:
        """Sum of the ranks' solo throughputs ``sum_i 1 / t_i``: no waits, no communication."""
        return float(np.sum(1.0 / np.asarray(self.step_times)))

    def noop_array(self) -> np.ndarray:
        return np.broadcast_to(np.asarray(self.noop_s, dtype=float), (self.n,)).copy()


class _Timeline:
    """Per-rank slowdown factors as the simulated clock advances (monotone queries only: O(events) in total)."""

    def __init__(self, n: int, slowdowns: Sequence[Slowdown]) -> None:
        self.factors = np.ones(n)
        self._events = sorted(slowdowns, key=lambda s: s.start_s)
        self._next = 0

    def at(self, now: float) -> np.ndarray:
        while self._next < len(self._events) and self._events[self._next].start_s <= now:
            event = self._events[self._next]
            self.factors[event.rank] = event.factor
            self._next += 1
        return self.factors


def _lognormal(rng: np.random.Generator, shape: tuple[int, ...], sigma: float) -> np.ndarray:
    """Mean-1 multiplicative noise (``exp(sigma z - sigma^2 / 2)``): noise does not change the mean step time."""
    if sigma == 0.0:
        return np.ones(shape)
    return np.exp(sigma * rng.standard_normal(shape) - 0.5 * sigma * sigma)


def _row_medians(draws: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Median of the first ``steps[i]`` entries of every row (NaN where a rank took no step), vectorised."""
    width = draws.shape[1]
    masked = np.where(np.arange(width)[None, :] < steps[:, None], draws, np.inf)
    ordered = np.sort(masked, axis=1)
    lo = np.clip((steps - 1) // 2, 0, width - 1)
    hi = np.clip(steps // 2, 0, width - 1)
    rows = np.arange(len(steps))
    medians = 0.5 * (ordered[rows, lo] + ordered[rows, hi])
    return np.where(steps > 0, medians, np.nan)


def _fit_to_remaining(steps: np.ndarray, remaining: int) -> np.ndarray:
    """Cut a round to the ``remaining`` units of the epoch, in proportion to ``steps`` (largest remainders).

    Why: the strategy's epoch plan shrinks the last round of an epoch the same way, so every sample is used
    once and the epoch ends with an averaging.
    """
    if steps.sum() <= remaining:
        return steps
    share = steps * (remaining / steps.sum())
    cut = np.floor(share).astype(np.int64)
    missing = remaining - int(cut.sum())
    if missing > 0:
        order = np.argsort(-(share - cut), kind="stable")
        cut[order[:missing]] += 1
    return cut


# ---------------------------------------------------------------------------------------------- policies


class Policy(Protocol):
    """Chooses every rank's local steps for the next round from what the previous rounds showed."""

    name: str

    def local_steps(self, n: int) -> np.ndarray: ...

    def observe(self, medians: np.ndarray, allreduce_s: float) -> bool: ...


@dataclass
class FixedPolicy:
    """The same ``steps`` local steps on every rank every round: BSP (1) or fixed-period local SGD (H)."""

    steps: int
    name: str = "local_sgd"

    def local_steps(self, n: int) -> np.ndarray:
        return np.full(n, self.steps, dtype=np.int64)

    def observe(self, medians: np.ndarray, allreduce_s: float) -> bool:
        return False


@dataclass
class OscarsPolicy:
    """Oscars as ``OscarsStrategy`` runs it (see the module docstring); ``initial_step_times`` skips profiling.

    Attributes:
        resolve: re-solve on drift (the strategy's behaviour); ``False`` keeps the first schedule.
        initial_step_times / initial_allreduce_s: solve before the first round from these (an oracle, or the
            strategy's pinned ``step_times``) instead of a warm-up round.
    """

    warmup_steps: int = 4
    max_spread: int = 8
    max_local_steps: int = 16
    tolerance: float = 0.05
    rebalance_threshold: float = 0.2
    min_gain: float = 0.03
    smoothing: float = 0.5
    resolve: bool = True
    initial_step_times: Sequence[float] | None = None
    initial_allreduce_s: float = 0.0
    name: str = "oscars"
    schedule: Schedule | None = field(default=None, init=False)
    solves: int = field(default=0, init=False)
    _estimate: np.ndarray | None = field(default=None, init=False, repr=False)
    _measured_allreduce: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.initial_step_times is not None:
            self.schedule = self._solve(tuple(self.initial_step_times), self.initial_allreduce_s)

    def _solve(self, times: Sequence[float], allreduce_s: float) -> Schedule:
        self.solves += 1
        return solve_schedule(
            times,
            allreduce_s,
            max_spread=self.max_spread,
            max_local_steps=self.max_local_steps,
            tolerance=self.tolerance,
        )

    def local_steps(self, n: int) -> np.ndarray:
        if self.schedule is None:
            return np.full(n, self.warmup_steps, dtype=np.int64)
        return np.asarray(self.schedule.local_steps, dtype=np.int64)

    def observe(self, medians: np.ndarray, allreduce_s: float) -> bool:
        # The control vector of averaging k carries the all-reduce time of averaging k-1: the solver after the
        # warm-up sees 0, later ones the previous round's cost.
        known_cost = self._measured_allreduce
        self._measured_allreduce = allreduce_s
        seen = ~np.isnan(medians)
        if self._estimate is None:
            self._estimate = np.where(seen, medians, np.nan)
        else:
            fresh = np.isnan(self._estimate)
            blended = self.smoothing * medians + (1.0 - self.smoothing) * self._estimate
            self._estimate = np.where(seen, np.where(fresh, medians, blended), self._estimate)
        if np.isnan(self._estimate).any():
            return False
        times = tuple(float(x) for x in self._estimate)
        if self.schedule is None:
            self.schedule = self._solve(times, known_cost)
            return True
        if not self.resolve:
            return False
        reference = np.asarray(self.schedule.step_times)
        if float(np.max(np.abs(self._estimate - reference) / reference)) <= self.rebalance_threshold:
            return False
        current = self.schedule.evaluated_at(times, known_cost)
        candidate = self._solve(times, known_cost)
        if candidate.local_steps != current.local_steps and candidate.throughput > current.throughput * (
            1.0 + self.min_gain
        ):
            self.schedule = candidate
            return True
        self.schedule = current  # new reference times: no re-solve until they drift again
        return False


# ---------------------------------------------------------------------------------------------- engine


@dataclass
class SimResult:
    """What one simulated run did. Times in seconds; arrays are per rank."""

    paradigm: str
    wall_s: float
    units: int
    rounds: int
    compute_s: np.ndarray
    idle_s: np.ndarray
    comm_s: float
    other_s: float
    round_utilization: float
    schedule_changes: list[tuple[int, tuple[int, ...]]]
    epoch_end_s: list[float]

    @property
    def throughput(self) -> float:
        """Optimizer steps per second summed over ranks (samples/s divided by the batch size)."""
        return self.units / self.wall_s

    @property
    def utilization(self) -> float:
        """Compute time over the cluster's time: ``sum_i compute_i / (N x wall)``."""
        return float(self.compute_s.sum() / (len(self.compute_s) * self.wall_s))

    @property
    def idle_fraction(self) -> np.ndarray:
        """Per rank: share of the wall time spent waiting at barriers or in no-op slots."""
        return self.idle_s / self.wall_s

    @property
    def final_local_steps(self) -> tuple[int, ...] | None:
        return self.schedule_changes[-1][1] if self.schedule_changes else None

    def summary(self, ideal: float | None = None, classes: Sequence[str] | None = None) -> dict[str, Any]:
        """JSON-ready figures; per-rank arrays are reduced to mean/min/max (and per-class means if given)."""
        idle = self.idle_fraction
        out: dict[str, Any] = {
            "paradigm": self.paradigm,
            "wall_s": self.wall_s,
            "steps": self.units,
            "rounds": self.rounds,
            "throughput": self.throughput,
            "utilization": self.utilization,
            "round_utilization": self.round_utilization,
            "comm_fraction": self.comm_s / self.wall_s,
            "idle_mean": float(idle.mean()),
            "idle_min": float(idle.min()),
            "idle_max": float(idle.max()),
            "final_local_steps": _compress_steps(self.final_local_steps, classes),
            "schedule_changes": len(self.schedule_changes),
        }
        if ideal:
            out["fraction_of_ideal"] = self.throughput / ideal
        if classes is not None:
            labels = np.asarray(classes)
            out["idle_by_class"] = {str(c): float(idle[labels == c].mean()) for c in dict.fromkeys(classes)}
        return out


def _compress_steps(steps: tuple[int, ...] | None, classes: Sequence[str] | None) -> Any:
    """Local steps per speed class (``{"1x": [16], ...}``) for large clusters, the plain tuple for small ones."""
    if steps is None:
        return None
    if classes is None or len(steps) <= 8:
        return list(steps)
    out: dict[str, list[int]] = {}
    for c, tau in zip(classes, steps):
        out.setdefault(str(c), [])
        if tau not in out[str(c)]:
            out[str(c)].append(tau)
    return {c: sorted(v) for c, v in out.items()}


def simulate(
    cluster: Cluster,
    policy: Policy,
    total_units: int,
    *,
    allreduce_s: float,
    units_per_epoch: int | None = None,
    epoch_overhead_s: float = 0.0,
    first_epoch_slots: int | None = None,
    seed: int | np.random.SeedSequence | Sequence[int] = 0,
) -> SimResult:
    """Run rounds until ``total_units`` optimizer steps (summed over ranks) are done.

    Each round draws every rank's step times at once (a ranks x steps matrix), so the cost is one NumPy pass
    per round whatever the number of ranks. ``allreduce_s`` is the exposed communication per round. Every
    ``units_per_epoch`` units the round is cut short, averaged, and ``epoch_overhead_s`` (validation) is added.
    ``first_epoch_slots``: the first epoch runs this many slots even when its data is used up earlier, the rest
    as no-ops on every rank (``OscarsStrategy`` sizes the first epoch to ``total_units`` slots, an upper bound,
    because speeds are unknown when it starts).
    """
    n = cluster.n
    rng = np.random.default_rng(seed)
    means = np.asarray(cluster.step_times, dtype=float)
    noop = cluster.noop_array()
    timeline = _Timeline(n, cluster.slowdowns)
    epoch_units = units_per_epoch or total_units
    now = comm = other = util_sum = 0.0
    compute, idle = np.zeros(n), np.zeros(n)
    done = in_epoch = slots_in_epoch = rounds = 0
    changes: list[tuple[int, tuple[int, ...]]] = []
    epoch_ends: list[float] = []
    last_steps: tuple[int, ...] | None = None
    while done < total_units:
        planned = policy.local_steps(n)
        steps = _fit_to_remaining(planned, min(epoch_units - in_epoch, total_units - done))
        if tuple(planned) != last_steps:
            last_steps = tuple(int(x) for x in planned)
            changes.append((rounds, last_steps))
        width = int(steps.max())
        draws = means[:, None] * timeline.at(now)[:, None] * _lognormal(rng, (n, width), cluster.noise)
        taken = np.arange(width)[None, :] < steps[:, None]
        busy = np.where(taken, draws, 0.0).sum(axis=1)
        period = float(np.max(busy + noop * (width - steps)))
        compute += busy
        idle += period - busy
        comm += allreduce_s
        wall_round = period + allreduce_s
        util_sum += busy.sum() / (n * (busy.max() + allreduce_s)) if wall_round > 0 else 0.0
        now += wall_round
        done += int(steps.sum())
        in_epoch += int(steps.sum())
        slots_in_epoch += width
        rounds += 1
        policy.observe(_row_medians(draws, steps), allreduce_s)
        if in_epoch >= epoch_units or done >= total_units:
            if first_epoch_slots and not epoch_ends and slots_in_epoch < first_epoch_slots:
                padding = (first_epoch_slots - slots_in_epoch) * float(noop.max())
                now += padding
                idle += padding
            slots_in_epoch = 0
            now += epoch_overhead_s
            other += epoch_overhead_s
            epoch_ends.append(now)
            in_epoch = 0
    return SimResult(
        paradigm=policy.name,
        wall_s=now,
        units=done,
        rounds=rounds,
        compute_s=compute,
        idle_s=idle,
        comm_s=comm,
        other_s=other,
        round_utilization=util_sum / max(rounds, 1),
        schedule_changes=changes,
        epoch_end_s=epoch_ends,
    )


def simulate_bsp(
    cluster: Cluster, total_units: int, *, allreduce_s: float, overlap: float = 0.0, **kw: Any
) -> SimResult:
    """BSP / DDP: one step per rank, wait for the slowest, then the part of the all-reduce not hidden."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must lie in [0, 1], got {overlap}")
    return simulate(cluster, FixedPolicy(1, name="bsp"), total_units, allreduce_s=(1.0 - overlap) * allreduce_s, **kw)


def simulate_local_sgd(
    cluster: Cluster, total_units: int, *, allreduce_s: float, period: int = 8, **kw: Any
) -> SimResult:
    """Fixed-period local SGD: ``period`` local steps on every rank, barrier, one model all-reduce."""
    return simulate(cluster, FixedPolicy(period), total_units, allreduce_s=allreduce_s, **kw)


def simulate_oscars(
    cluster: Cluster, total_units: int, *, allreduce_s: float, policy: OscarsPolicy | None = None, **kw: Any
) -> SimResult:
    """Oscars: warm-up round, solved ``tau_i`` per rank, re-solves on drift (see :class:`OscarsPolicy`)."""
    return simulate(cluster, policy or OscarsPolicy(), total_units, allreduce_s=allreduce_s, **kw)


# ---------------------------------------------------------------------------------------------- scaling study


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


def scaling_study(cfg: StudyConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every mix x rank count x paradigm, ``steps_per_rank`` x N optimizer steps each (the warm-up included).

    The three paradigms of one cell share a seed (common random numbers), so their differences are not noise.
    """
    rows = []
    for m, mix in enumerate(cfg.mixes):
        for n in cfg.ranks:
            times, classes = mix_step_times(mix, n, cfg.step_time_s)
            cluster = Cluster(times, noise=cfg.noise)
            cost = cfg.allreduce_s(n)
            total = n * cfg.steps_per_rank
            seed = [cfg.seed, m, n]
            runs = {
                "bsp": simulate_bsp(cluster, total, allreduce_s=cost, overlap=cfg.overlap, seed=seed),
                "local_sgd": simulate_local_sgd(cluster, total, allreduce_s=cost, period=cfg.local_period, seed=seed),
                "oscars": simulate_oscars(cluster, total, allreduce_s=cost, seed=seed),
                # Same rules, but solved up front from the true mean step times and all-reduce cost: how much the
                # strategy's profiling (warm-up medians, first solve at cost 0) leaves on the table.
                "oscars_oracle": simulate_oscars(
                    cluster,
                    total,
                    allreduce_s=cost,
                    seed=seed,
                    policy=OscarsPolicy(initial_step_times=times, initial_allreduce_s=cost, name="oscars_oracle"),
                ),
            }
            row: dict[str, Any] = {
                "mix": mix,
                "ranks": n,
                "allreduce_s": cost,
                "ideal_throughput": cluster.ideal_throughput,
            }
            for name, res in runs.items():
                row[name] = res.summary(cluster.ideal_throughput, classes)
            rows.append(row)
            if progress:
                progress(
                    f"{mix:24s} N={n:5d} "
                    + " ".join(f"{k} {row[k]['fraction_of_ideal']:.3f}" for k in PARADIGMS)
                    + f"  oscars tau {row['oscars']['final_local_steps']}"
                )
    return rows


# ---------------------------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class ValidationInputs:
    """Step-level inputs of the 2-rank validation; the simulator predicts the end-to-end figures from them.

    Attributes:
        step_times: per-rank seconds per local optimizer step as the rank runs (emulated slowdown included,
            barrier waits excluded).
        slowdown: per-rank emulated factor ``k_i`` (1 for normal ranks).
        allreduce_s: seconds of one oscars averaging (flat buffer of parameters, buffers and control data).
        ddp_overhead_s: seconds a DDP step adds over a local step at equal speeds (exposed gradient all-reduce
            and DDP bookkeeping).
        emulator_scales_ddp_comm: ``HeterogeneityEmulator`` sleeps ``(k-1)`` x the rank's whole batch, and a DDP
            batch contains its gradient all-reduce, so the slow rank's DDP step is ``k x (step + overhead)``.
        noop_s: seconds of one no-op slot (Lightning's loop around an empty batch; not scaled by the emulator,
            which sleeps in proportion to the near-empty hook time only).
        epoch_overhead_s: validation + epoch turnover per epoch.
        startup_s: seconds of ``trainer.fit`` outside the training loop (process group, setup, teardown).
        samples, batch_size, epochs: the run's data.
        noise: per-step lognormal sigma. seeds: simulated runs averaged per prediction.
        sources: where every input came from (``cli``, ``json``, ``default``).
    """

    step_times: tuple[float, ...]
    slowdown: tuple[float, ...]
    allreduce_s: float
    ddp_overhead_s: float
    emulator_scales_ddp_comm: bool = True
    noop_s: float = DEV_BOX_NOOP_S
    epoch_overhead_s: float = DEV_BOX_EPOCH_OVERHEAD_S
    startup_s: float = 0.0
    samples: int = 65536
    batch_size: int = 64
    epochs: int = 4
    noise: float = 0.1
    seeds: int = 5
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def units_per_epoch(self) -> int:
        return self.samples // self.epochs // self.batch_size

    def ddp_step_times(self) -> tuple[float, ...]:
        """Per-rank seconds of a DDP step before the barrier: the local step plus the (maybe emulated) overhead."""
        scale = self.slowdown if self.emulator_scales_ddp_comm else (1.0,) * len(self.step_times)
        return tuple(t + k * self.ddp_overhead_s for t, k in zip(self.step_times, scale))


def parse_slowdown(spec: str | Mapping[Any, Any], n: int) -> tuple[float, ...]:
    """``"1:3"`` or ``{1: 3}`` -> ``(1.0, 3.0)`` for 2 ranks.

    A time profile (``"1:1@0,3@10"``, as ``benchmarks.train_job`` takes it) counts with its last factor: the
    validation models a constant slowdown.
    """
    factors = [1.0] * n
    if isinstance(spec, Mapping):
        for rank, factor in spec.items():
            factors[int(rank)] = float(factor)
        return tuple(factors)
    for part in filter(None, str(spec).split(";")):
        rank, profile = part.split(":")
        last = profile.split(",")[-1]
        factors[int(rank)] = float(last.split("@")[0])
    return tuple(factors)


def _lookup(sources: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Any:
    """First non-null value of any of ``names`` in ``sources``, the median across runs for per-run fields."""
    for src in sources:
        runs = src.get("runs") if isinstance(src.get("runs"), list) else None
        for name in names:
            if runs:
                values = [r[name] for r in runs if isinstance(r, Mapping) and r.get(name) is not None]
                if values:
                    return _median_value(values)
            if src.get(name) is not None:
                return src[name]
    return None


def _median_value(values: list[Any]) -> Any:
    """Median of numbers, or elementwise median of equal-length lists; the first value otherwise."""
    if all(isinstance(v, (int, float)) for v in values):
        return statistics.median(values)
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        try:
            return [statistics.median(col) for col in zip(*values)]
        except TypeError:
            return values[0]
    return values[0]


def _curve_times(run: Mapping[str, Any]) -> list[float]:
    """Seconds since the start of training at every validation (``curve`` rows start with it); [] if malformed."""
    curve = run.get("curve")
    if not isinstance(curve, list):
        return []
    try:
        return [float(point[0]) for point in curve]
    except (TypeError, ValueError, IndexError):
        return []


def _measured(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The measured end-to-end figures of one strategy (medians over runs); missing fields become None."""
    runs = [r for r in summary.get("runs", []) if isinstance(r, Mapping)]
    curves = [(r, _curve_times(r)) for r in runs]
    curves = [(r, c) for r, c in curves if c]
    walls = [float(r["wall_s"]) for r in runs if isinstance(r.get("wall_s"), (int, float))]
    util = [r["mean_utilization"] for r in runs if isinstance(r.get("mean_utilization"), (int, float))]
    return {
        "wall_s": summary.get("median_wall_s") or (statistics.median(walls) if walls else None),
        "samples_per_s": summary.get("median_samples_per_s"),
        "train_s": statistics.median(c[-1] for _, c in curves) if curves else None,
        "epoch_end_s": _median_value([c for _, c in curves]) if curves else None,
        "startups": [float(r["wall_s"]) - c[-1] for r, c in curves if isinstance(r.get("wall_s"), (int, float))],
        "schedules": [r.get("schedule") for r in runs if r.get("schedule")],
        "mean_utilization": statistics.median(util) if util else None,
        "samples": _lookup([summary], ["samples"]),
        "epochs": len(curves[0][1]) if curves else None,
    }


def validation_inputs(
    results: Mapping[str, Any], overrides: Mapping[str, Any], default_slowdown: str = "1:3"
) -> ValidationInputs:
    """Merge inputs: command line (``overrides``) over the results JSON over the dev-box defaults.

    Optional JSON fields (looked up per run, then per strategy, then in a top-level ``setup`` dict):
    ``step_time_s`` (a number: the unslowed step time; a list: per-rank step times as run), ``allreduce_s``,
    ``ddp_overhead_s``, ``noop_s``, ``epoch_overhead_s``, ``slowdown`` (``"1:3"``), ``batch_size``.
    """
    oscars = next((v for k, v in results.items() if k.startswith("oscars") and isinstance(v, Mapping)), {})
    ddp = results.get("ddp", {}) if isinstance(results.get("ddp"), Mapping) else {}
    setup = results.get("setup", {}) if isinstance(results.get("setup"), Mapping) else {}
    everywhere = [oscars, ddp, setup]
    sources: dict[str, str] = {}

    def pick(key: str, json_names: Sequence[str], default: Any, where: Sequence[Mapping[str, Any]]) -> Any:
        if overrides.get(key) is not None:
            sources[key] = "cli"
            return overrides[key]
        value = _lookup(where, json_names)
        if value is not None:
            sources[key] = "json"
            return value
        sources[key] = "default"
        return default

    raw_times = pick("step_times", ["step_time_s", "step_times_s"], DEV_BOX_STEP_S, [oscars, setup, ddp])
    n = len(raw_times) if isinstance(raw_times, (list, tuple)) else 2
    slowdown = parse_slowdown(pick("slowdown", ["slowdown"], default_slowdown, everywhere), n)
    if isinstance(raw_times, (list, tuple)):
        step_times = tuple(float(t) for t in raw_times)
    else:
        step_times = tuple(float(raw_times) * k for k in slowdown)
    measured = _measured(oscars or ddp)
    startups = _measured(oscars)["startups"] + _measured(ddp)["startups"]
    startup_default = statistics.median(startups) if startups else 0.0
    return ValidationInputs(
        step_times=step_times,
        slowdown=slowdown,
        allreduce_s=float(pick("allreduce_s", ["allreduce_s", "allreduce_time_s"], DEV_BOX_ALLREDUCE_S, everywhere)),
        emulator_scales_ddp_comm=bool(overrides.get("emulator_scales_ddp_comm", True)),
        ddp_overhead_s=float(
            pick("ddp_overhead_s", ["ddp_overhead_s", "ddp_allreduce_s"], DEV_BOX_DDP_OVERHEAD_S, [ddp, setup])
        ),
        noop_s=float(pick("noop_s", ["noop_s"], DEV_BOX_NOOP_S, everywhere)),
        epoch_overhead_s=float(pick("epoch_overhead_s", ["epoch_overhead_s"], DEV_BOX_EPOCH_OVERHEAD_S, everywhere)),
        startup_s=float(pick("startup_s", ["startup_s"], startup_default, everywhere)),
        samples=int(measured["samples"] or 65536),
        batch_size=int(pick("batch_size", ["batch_size"], 64, everywhere)),
        epochs=int(measured["epochs"] or 4),
        noise=float(overrides.get("noise") or 0.0) if overrides.get("noise") is not None else 0.1,
        seeds=int(overrides.get("seeds") or 5),
        sources=sources,
    )


def predict(inputs: ValidationInputs, paradigm: str) -> dict[str, Any]:
    """Mean over ``inputs.seeds`` simulated runs of one paradigm on the 2-rank benchmark."""
    total = inputs.samples // inputs.batch_size
    common: dict[str, Any] = {"units_per_epoch": inputs.units_per_epoch, "epoch_overhead_s": inputs.epoch_overhead_s}
    runs = []
    for seed in range(inputs.seeds):
        if paradigm == "ddp":
            # The overhead is part of every rank's step (and scaled by the emulator), so no separate cost.
            cluster = Cluster(inputs.ddp_step_times(), noise=inputs.noise)
            runs.append(simulate_bsp(cluster, total, allreduce_s=0.0, seed=seed, **common))
        else:
            cluster = Cluster(inputs.step_times, noise=inputs.noise, noop_s=inputs.noop_s)
            runs.append(
                simulate_oscars(
                    cluster,
                    total,
                    allreduce_s=inputs.allreduce_s,
                    seed=seed,
                    first_epoch_slots=inputs.units_per_epoch,
                    **common,
                )
            )
    train = statistics.mean(r.wall_s for r in runs)
    return {
        "train_s": train,
        "wall_s": train + inputs.startup_s,
        "samples_per_s": inputs.samples / (train + inputs.startup_s),
        "train_samples_per_s": inputs.samples / train,
        "epoch_end_s": [statistics.mean(col) for col in zip(*(r.epoch_end_s for r in runs))],
        "utilization": statistics.mean(r.utilization for r in runs),
        "round_utilization": statistics.mean(r.round_utilization for r in runs),
        "final_local_steps": [list(r.final_local_steps or ()) for r in runs],
    }


def _epoch_split(ends: Sequence[float] | None) -> tuple[float | None, float | None]:
    """First epoch's seconds and the mean of the later ones: start-up transients vs the steady state."""
    if not ends:
        return None, None
    later = [b - a for a, b in zip(ends[:-1], ends[1:])]
    return float(ends[0]), (statistics.mean(later) if later else None)


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0


def validate_against(results_json_path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Predict the 2-rank benchmark's ddp and oscars figures and compare them with the measured ones.

    ``overrides`` holds command-line inputs (keys of :class:`ValidationInputs`, ``step_times`` a list); anything
    absent is read from the JSON if present there, else taken from the dev-box defaults (see ``sources``).
    Train time is ``on_train_start`` to the end of the last validation (the last ``curve`` point); wall time
    and samples/s add the constant ``startup_s``.
    """
    results = json.loads(Path(results_json_path).read_text())
    inputs = validation_inputs(results, overrides or {})
    rows: list[dict[str, Any]] = []
    for name, paradigm in (("ddp", "ddp"), ("oscars", "oscars")):
        summary = results.get(name)
        if not isinstance(summary, Mapping):
            continue
        measured = _measured(summary)
        predicted = predict(inputs, paradigm)
        for figures in (measured, predicted):
            figures["first_epoch_s"], figures["steady_epoch_s"] = _epoch_split(figures.get("epoch_end_s"))
        rows.append(
            {
                "strategy": name,
                "predicted": predicted,
                "measured": {k: v for k, v in measured.items() if k != "startups"},
                "error": {
                    "train_s": _rel(predicted["train_s"], measured["train_s"]),
                    "wall_s": _rel(predicted["wall_s"], measured["wall_s"]),
                    "samples_per_s": _rel(predicted["samples_per_s"], measured["samples_per_s"]),
                    "utilization": _rel(predicted["round_utilization"], measured["mean_utilization"]),
                    "first_epoch_s": _rel(predicted["first_epoch_s"], measured["first_epoch_s"]),
                    "steady_epoch_s": _rel(predicted["steady_epoch_s"], measured["steady_epoch_s"]),
                },
            }
        )
    speedups = {}
    by_name: dict[str, dict[str, Any]] = {r["strategy"]: r for r in rows}
    if "ddp" in by_name and "oscars" in by_name:
        for key in ("train_s", "wall_s"):
            p = by_name["ddp"]["predicted"][key] / by_name["oscars"]["predicted"][key]
            m_d, m_o = by_name["ddp"]["measured"][key], by_name["oscars"]["measured"][key]
            m = m_d / m_o if m_d and m_o else None
            speedups[key] = {"predicted": p, "measured": m, "error": _rel(p, m)}
    inputs_out = {k: getattr(inputs, k) for k in inputs.__dataclass_fields__ if k != "sources"}
    inputs_out["ddp_step_times"] = inputs.ddp_step_times()
    return {"inputs": inputs_out, "sources": dict(inputs.sources), "rows": rows, "speedup_vs_ddp": speedups}


def sensitivity(results_json_path: str | Path, overrides: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Train-time error of ddp and oscars when one input moves: how much the agreement owes to each input.

    Why: several inputs (no-op slot cost, step time under contention) were measured on a shared 2-vCPU box;
    an error that flips sign within their plausible range says the inputs, not the model, limit the check.
    """
    results = json.loads(Path(results_json_path).read_text())
    base = dict(overrides or {})
    inputs = validation_inputs(results, base)
    measured = {name: _measured(results[name])["train_s"] for name in ("ddp", "oscars") if name in results}
    unslowed = inputs.step_times[0] / inputs.slowdown[0]
    variants: list[tuple[str, dict[str, Any]]] = [("as above", {})]
    variants += [(f"no-op slot {x * 1e3:.1f} ms", {"noop_s": x}) for x in (0.0, 0.6e-3, 1.7e-3)]
    variants += [(f"step time x{f}", {"step_times": [t * f for t in inputs.step_times]}) for f in (0.9, 1.1)]
    variants += [
        ("slow rank 3.3x", {"step_times": [unslowed * (3.3 if k > 1 else k) for k in inputs.slowdown]}),
        (f"all-reduce x2 ({2e3 * inputs.allreduce_s:.1f} ms)", {"allreduce_s": 2 * inputs.allreduce_s}),
        ("epoch overhead 0", {"epoch_overhead_s": 0.0}),
    ]
    rows = []
    for label, change in variants:
        varied = validation_inputs(results, {**base, **change})
        row: dict[str, Any] = {"variant": label}
        for name, paradigm in (("ddp", "ddp"), ("oscars", "oscars")):
            if name in measured:
                row[name] = _rel(predict(varied, paradigm)["train_s"], measured[name])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- reports


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def validation_markdown(report: Mapping[str, Any]) -> list[str]:
    """The validation table: predicted vs measured per strategy and the relative error."""
    inp = report["inputs"]
    lines = [
        "## Validation against the 2-rank benchmark",
        "",
        f"Inputs: step times {[round(t * 1e3, 2) for t in inp['step_times']]} ms (ddp steps "
        f"{[round(t * 1e3, 2) for t in inp['ddp_step_times']]} ms), averaging all-reduce "
        f"{inp['allreduce_s'] * 1e3:.2f} ms, no-op slot {inp['noop_s'] * 1e3:.2f} ms, epoch overhead "
        f"{inp['epoch_overhead_s']:.3f} s, startup {inp['startup_s']:.2f} s, noise sigma {inp['noise']}, "
        f"{inp['seeds']} seeds. Sources: " + ", ".join(f"{k}={v}" for k, v in report["sources"].items()) + ".",
        "",
        "| strategy | quantity | predicted | measured | error |",
        "|---|---|---:|---:|---:|",
    ]
    for row in report["rows"]:
        p, m, e = row["predicted"], row["measured"], row["error"]
        lines += [
            f"| {row['strategy']} | train s (fit start to last validation) | {p['train_s']:.2f} | "
            f"{_num(m['train_s'])} | {_pct(e['train_s'])} |",
            f"| {row['strategy']} | first epoch s | {_num(p['first_epoch_s'])} | {_num(m['first_epoch_s'])} | "
            f"{_pct(e['first_epoch_s'])} |",
            f"| {row['strategy']} | later epochs s (mean) | {_num(p['steady_epoch_s'])} | "
            f"{_num(m['steady_epoch_s'])} | {_pct(e['steady_epoch_s'])} |",
            f"| {row['strategy']} | wall s | {p['wall_s']:.2f} | {_num(m['wall_s'])} | {_pct(e['wall_s'])} |",
            f"| {row['strategy']} | samples/s | {p['samples_per_s']:.0f} | {_num(m['samples_per_s'], '.0f')} | "
            f"{_pct(e['samples_per_s'])} |",
        ]
        if row["strategy"] != "ddp":
            lines.append(
                f"| {row['strategy']} | round utilisation | {p['round_utilization']:.3f} | "
                f"{_num(m['mean_utilization'], '.3f')} | {_pct(e['utilization'])} |"
            )
            lines.append(
                f"| {row['strategy']} | final local steps | {p['final_local_steps'][0]} | {m['schedules']} | |"
            )
    for key, s in report["speedup_vs_ddp"].items():
        lines.append(
            f"| oscars/ddp | speed-up ({key}) | {s['predicted']:.2f}x | {_num(s['measured'])}x | {_pct(s['error'])} |"
        )
    return lines


def sensitivity_markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Train-time error per input variant (see :func:`sensitivity`)."""
    lines = [
        "Sensitivity: train-time error when one input changes.",
        "",
        "| variant | ddp | oscars |",
        "|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['variant']} | {_pct(r.get('ddp'))} | {_pct(r.get('oscars'))} |")
    return lines


def scaling_markdown(rows: Sequence[Mapping[str, Any]], cfg: StudyConfig) -> list[str]:
    """One table per mix: throughput (share of ideal), utilisation and mean idle fraction per paradigm."""
    lines = [
        "## Scaling study",
        "",
        f"Step time {cfg.step_time_s * 1e3:.0f} ms at 1x, per-step lognormal noise sigma {cfg.noise}, model "
        f"{cfg.params / 1e6:.0f}M params x {cfg.bytes_per_param:.0f} B, ring all-reduce at "
        f"{cfg.bandwidth / 1e9:.0f} GB/s and {cfg.latency * 1e6:.0f} us per hop, BSP overlap {cfg.overlap}, "
        f"local SGD H={cfg.local_period}, oscars with the strategy's defaults (M=8, max 16 local steps, "
        f"tolerance 0.05, warm-up 4). {cfg.steps_per_rank} x N optimizer steps per run. thr = optimizer steps/s "
        "summed over ranks (% of the ideal sum_i 1/t_i); util = compute / (N x wall); idle = mean share of "
        "wall a rank waits at the barrier or in no-op slots; tau = final local steps per speed class; oracle = "
        "oscars solved up front from the true mean step times and all-reduce cost (no warm-up).",
    ]
    for mix in dict.fromkeys(r["mix"] for r in rows):
        lines += [
            "",
            f"### {mix}",
            "",
            "| N | all-reduce ms | ideal steps/s | BSP thr | BSP util | BSP idle | local thr | local util | "
            "local idle | oscars thr | oscars util | oscars idle | oscars tau | oracle thr | oracle tau |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
        ]
        for r in (r for r in rows if r["mix"] == mix):
            cells = [str(r["ranks"]), f"{r['allreduce_s'] * 1e3:.1f}", f"{r['ideal_throughput']:.0f}"]
            for name in PARADIGMS:
                s = r[name]
                cells += [
                    f"{s['throughput']:.0f} ({100 * s['fraction_of_ideal']:.0f}%)",
                    f"{s['utilization']:.3f}",
                    f"{s['idle_mean']:.3f}",
                ]
            cells.append(_tau_text(r["oscars"]["final_local_steps"]))
            oracle = r.get("oscars_oracle")
            if oracle:
                cells += [
                    f"{oracle['throughput']:.0f} ({100 * oracle['fraction_of_ideal']:.0f}%)",
                    _tau_text(oracle["final_local_steps"]),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _tau_text(tau: Any) -> str:
    return ", ".join(f"{k}: {v}" for k, v in tau.items()) if isinstance(tau, dict) else str(tau)


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Fraction of the ideal throughput (solid) and utilisation (dashed) vs N, one panel per mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(dict.fromkeys(r["mix"] for r in rows))
    fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), sharey=True, squeeze=False)
    colors = {"bsp": "tab:red", "local_sgd": "tab:blue", "oscars": "tab:green"}
    for ax, mix in zip(axes[0], mixes):
        sel = [r for r in rows if r["mix"] == mix]
        n = [r["ranks"] for r in sel]
        for name in PARADIGMS:
            ax.plot(n, [r[name]["fraction_of_ideal"] for r in sel], "-o", color=colors[name], label=f"{name} thr/ideal")
            ax.plot(n, [r[name]["utilization"] for r in sel], "--", color=colors[name], label=f"{name} utilisation")
        if all("oscars_oracle" in r for r in sel):
            oracle = [r["oscars_oracle"]["fraction_of_ideal"] for r in sel]
            ax.plot(n, oracle, ":", color="black", label="oscars, solved from true times and cost")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("ranks")
        ax.set_title(mix)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("fraction")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--validate", metavar="JSON", help="results of benchmarks.heterogeneous to validate against")
    v = p.add_argument_group("validation inputs (override the JSON and the dev-box defaults)")
    v.add_argument("--step-times", type=_floats, help="per-rank seconds per step as run, e.g. 0.0034,0.0101")
    v.add_argument("--step-time", type=float, help="unslowed seconds per step; rank i gets it x its slowdown")
    v.add_argument("--slowdown", help="emulated factors as benchmarks.train_job takes them (default 1:3)")
    v.add_argument("--allreduce-s", type=float, help="seconds of one oscars averaging all-reduce")
    v.add_argument("--ddp-overhead-s", type=float, help="seconds a DDP step adds over a local step at 1x")
    v.add_argument("--no-emulated-ddp-comm", action="store_true", help="the emulator does not scale DDP's comm")
    v.add_argument("--noop-s", type=float, help="seconds of one no-op slot (any rank)")
    v.add_argument("--epoch-overhead-s", type=float, help="validation + epoch turnover seconds per epoch")
    v.add_argument("--startup-s", type=float, help="fit seconds outside the training loop")
    v.add_argument("--batch-size", type=int)
    v.add_argument("--val-noise", type=float, default=0.1, help="per-step lognormal sigma in the validation")
    v.add_argument("--val-seeds", type=int, default=5)
    s = p.add_argument_group("scaling study")
    s.add_argument("--ranks", type=_ints, default=RANKS)
    s.add_argument("--mixes", default=",".join(MIXES))
    s.add_argument("--base-step-s", type=float, default=0.1, help="seconds per step of a 1x rank")
    s.add_argument("--noise", type=float, default=0.05)
    s.add_argument("--params", type=float, default=25e6)
    s.add_argument("--bytes-per-param", type=float, default=4.0)
    s.add_argument("--bandwidth", type=float, default=10e9, help="bytes/s")
    s.add_argument("--latency", type=float, default=5e-6, help="seconds per hop")
    s.add_argument("--local-period", type=int, default=8, help="H of fixed-period local SGD")
    s.add_argument("--overlap", type=float, default=0.0, help="share of BSP's all-reduce hidden behind backward")
    s.add_argument("--steps-per-rank", type=int, default=1000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-study", action="store_true")
    a = p.parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    lines = ["# Cluster simulator (benchmarks/simulator.py)", ""]
    if a.validate:
        step_times = a.step_times if a.step_times is not None else a.step_time
        overrides = {
            "step_times": step_times,
            "slowdown": a.slowdown,
            "allreduce_s": a.allreduce_s,
            "ddp_overhead_s": a.ddp_overhead_s,
            "noop_s": a.noop_s,
            "epoch_overhead_s": a.epoch_overhead_s,
            "startup_s": a.startup_s,
            "batch_size": a.batch_size,
            "noise": a.val_noise,
            "seeds": a.val_seeds,
            "emulator_scales_ddp_comm": not a.no_emulated_ddp_comm,
        }
        report["validation"] = validate_against(a.validate, overrides)
        report["validation"]["sensitivity"] = sensitivity(a.validate, overrides)
        text = (
            validation_markdown(report["validation"]) + [""] + sensitivity_markdown(report["validation"]["sensitivity"])
        )
        lines += text + [""]
        print("\n".join(text), flush=True)
    if not a.no_study:
        cfg = StudyConfig(
            ranks=tuple(a.ranks),
            mixes=tuple(x for x in a.mixes.split(",") if x),
            step_time_s=a.base_step_s,
            noise=a.noise,
            params=a.params,
            bytes_per_param=a.bytes_per_param,
            bandwidth=a.bandwidth,
            latency=a.latency,
            local_period=a.local_period,
            overlap=a.overlap,
            steps_per_rank=a.steps_per_rank,
            seed=a.seed,
        )
        started = time.perf_counter()
        rows = scaling_study(cfg, progress=lambda line: print(line, flush=True))
        elapsed = time.perf_counter() - started
        report["scaling"] = {"config": cfg.__dict__, "seconds": elapsed, "rows": rows}
        lines += scaling_markdown(rows, cfg)
        lines += ["", f"Scaling study simulated in {elapsed:.1f} s."]
        plot(rows, out / "simulator.png")
        print(f"scaling study: {elapsed:.1f} s", flush=True)
    (out / "simulator.json").write_text(json.dumps(report, indent=1, default=_jsonable))
    (out / "simulator.md").write_text("\n".join(lines) + "\n")
    return report


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)


if __name__ == "__main__":
    main()
