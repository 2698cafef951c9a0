"""Discrete-event simulator of a heterogeneous cluster: BSP (ddp) vs fixed-period local SGD vs oscars.

    python -m benchmarks.simulator --out benchmarks/results
    python -m benchmarks.simulator --validate benchmarks/results/heterogeneous.json --out benchmarks/results
    python -m benchmarks.simulator --validate benchmarks/results/heterogeneous.json --noop-s 0.001 --no-study

Writes ``simulator.json``, ``simulator.md`` (validation tables and scaling tables) and ``simulator.png`` (fraction
of the ideal throughput and utilisation vs number of ranks, one panel per speed mix) to ``--out``.

Why: the real benchmark (``benchmarks.heterogeneous``) has 2 CPU ranks. The simulator, checked against those
2-rank measurements, extrapolates the three paradigms to 8 .. 1,024 ranks, where the questions that matter are
whether the barrier waits, the per-step noise of many ranks and the all-reduce latency term eat the gain.

Model and assumptions (what the numbers do and do not include):

* Every rank ``i`` has a mean step time ``t_i`` (seconds per optimizer step, data loading included). A step's
  time is ``t_i * f_i(t) * e`` with ``e`` lognormal of mean 1 (``sigma`` = ``noise``), independent across steps
  and ranks, and ``f_i(t)`` an optional piecewise-constant slowdown profile ("rank r is k x slower from t s"),
  read at the start of each round (exact for BSP, whose rounds are one step). ``first_step_s`` is added to
  every rank's first step (start-up transient: allocator, first batch, first optimizer step). An optional
  load factor (mean-1 lognormal per rank, AR(1) in time) scales whole rounds: a shared machine's load, which
  unlike per-step noise moves the per-round medians the strategy re-solves on.
* A round: rank ``i`` runs ``tau_i`` local steps, then idles through ``max tau - tau_i`` no-op slots at
  ``noop_s`` each (the strategy's lock-step slots: Lightning still runs its loop around an empty batch; the
  scaling study takes 0, the 2-rank CPU benchmark about 1 ms), waits at the barrier for the last rank, then
  every rank pays one all-reduce of the model plus ``round_overhead_s`` of bookkeeping. BSP is the round with
  ``tau_i = 1`` whose all-reduce (of the gradients, same size) is hidden behind backward by ``overlap``.
* All-reduce cost: ring, ``2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency`` (0 for one rank); no topology,
  no congestion, the same every round, no overlap of local SGD's averaging with compute.
* Local SGD and oscars run on the strategy's own epoch plan (``lightning_oscars.partition.EpochPlan``): every
  rank iterates the same slots, a round takes the next ``sum tau_i`` units of the epoch, the last rounds of an
  epoch shrink to the data left. Validation every ``val_check_interval`` of the epoch's slots forces an extra
  averaging when it falls inside a round (the strategy averages before validating).
* Oscars mirrors ``OscarsStrategy``: a warm-up round of ``warmup_steps`` steps per rank; per averaging the
  median of each rank's step times, smoothed by an EMA (``smoothing``); the all-reduce cost the solver sees is
  the previous averaging's (0 at the first solve); step times within 5% of each other are snapped to their
  group's slowest before the exact solver runs (``snap_step_times``); re-balancing is the strategy's own
  function (``lightning_oscars.solver.rebalance``): a re-solve happens when a rank's smoothed time, or the
  all-reduce cost relative to the round (``|c_new - c_old| / (T + c_old)``), drifted by more than
  ``rebalance_threshold``, or when the cost first becomes known (the first solve saw 0), and is adopted only if
  predicted ``min_gain`` faster; a new schedule re-plans the
  epoch at the next round boundary. The first epoch is sized as an upper bound (``total_units`` slots, speeds
  unknown) and cut to the slots it needs as soon as the first schedule is solved.
* Validation (``--validate``, the ``{"meta", "profiles"}`` JSON of ``benchmarks.heterogeneous``): per profile
  the inputs come from the measured runs: per-rank step times and all-reduce cost from the strategy's round
  history (each local SGD / oscars configuration its own, ddp the profile's pooled ones), the no-op slot and
  per-averaging overhead from a fit of every round's wall time across all histories, the start-up transient
  from the first round, the load (per rank) and its correlation time from how the rounds' mean step times
  vary, the epoch turnover from ddp's validation times, and ddp's per-step overhead (gradient
  all-reduce, DDP hooks) fitted once on the homogeneous profile (on the profile itself when that is absent:
  then ddp's row is a fit, not a prediction). The simulator predicts train wall (validation excluded) and
  samples/s; a sensitivity table shows how the error moves with each input.
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from benchmarks.task import parse_profile
from lightning_oscars.partition import EpochPlan, planned_slots
from lightning_oscars.solver import Schedule, rebalance, snap_step_times, solve_schedule, solve_schedule_alg1

__all__ = [
    "Cluster",
    "FixedPolicy",
    "OscarsPolicy",
    "SimResult",
    "Slowdown",
    "StudyConfig",
    "ValidationInputs",
    "fit_ddp_overhead",
    "fit_round_costs",
    "machine_inputs",
    "mix_step_times",
    "parse_profile",
    "parse_slowdown",
    "predict",
    "ring_allreduce_time",
    "scaling_study",
    "simulate",
    "simulate_bsp",
    "simulate_config",
    "simulate_local_sgd",
    "simulate_oscars",
    "validate_against",
    "validation_inputs",
]

MIXES = ("generations", "stragglers", "generations+stragglers")
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
PARADIGMS = ("bsp", "local_sgd", "oscars")
# The strategy's tolerance for treating step times as equal (lightning_oscars.strategy._SNAP_TOLERANCE).
SNAP_TOLERANCE = 0.05

# Machine inputs of the validation when the results JSON has no round history to derive them from, measured on
# the 2-vCPU development box (torch 2.13 CPU, 1 thread per rank) while other jobs shared it (read them as +-50%):
# * no-op slot: between 0.6 ms (batch-end-to-batch-end minus hook time of a real step, 1 device) and 1.7 ms
#   (the slow rank's no-op slots in a 2-rank oscars run, contended);
# * round overhead: per averaging, round wall minus busiest compute minus all-reduce in a 2-rank oscars history
#   at 1:3 (bookkeeping after the all-reduce, hooks between the last step and the averaging), about 3 ms.
DEV_BOX_NOOP_S = 1.0e-3
DEV_BOX_ROUND_OVERHEAD_S = 3.0e-3
# Configurations of benchmarks.heterogeneous and how the simulator runs them.
CONFIG_PARADIGMS = {
    "ddp": "ddp",
    "local_sgd": "local_sgd",
    "oscars-exact-uniform": "oscars",
    "oscars-exact-samples": "oscars",
    "oscars-alg1-uniform": "oscars_alg1",
    "oscars-alg1-samples": "oscars_alg1",
}


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
        load: sigma of a per-rank, mean-1 lognormal load factor shared by all steps of a round (per rank or one
            value for all): other jobs on a shared machine, thermal throttling. It follows a stationary AR(1)
            in log space with correlation time ``load_time_s`` seconds (0: independent from round to round).
            Unlike ``noise`` it does not average out over a round's steps, so it moves the per-round medians
            the strategy re-solves on.
    """

    step_times: tuple[float, ...]
    noise: float = 0.0
    slowdowns: tuple[Slowdown, ...] = ()
    noop_s: float | tuple[float, ...] = 0.0
    load: float | tuple[float, ...] = 0.0
    load_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.step_times or any(not (t > 0 and math.isfinite(t)) for t in self.step_times):
            raise ValueError("step_times must be non-empty, finite and > 0")
        if self.noise < 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")
        if np.any(np.asarray(self.load) < 0) or self.load_time_s < 0:
            raise ValueError("load and load_time_s must be >= 0")
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

    def load_array(self) -> np.ndarray:
        return np.broadcast_to(np.asarray(self.load, dtype=float), (self.n,)).copy()


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
    """Chooses every rank's local steps for the next round from what the previous averagings showed."""

    name: str

    @property
    def solved(self) -> bool: ...

    def local_steps(self, n: int) -> np.ndarray: ...

    def observe(self, medians: np.ndarray, allreduce_s: float) -> bool: ...


@dataclass
class FixedPolicy:
    """The same ``steps`` local steps on every rank every round: BSP (1) or fixed-period local SGD (H)."""

    steps: int
    name: str = "local_sgd"
    adaptive = False

    @property
    def solved(self) -> bool:
        return True

    def local_steps(self, n: int) -> np.ndarray:
        return np.full(n, self.steps, dtype=np.int64)

    def observe(self, medians: np.ndarray, allreduce_s: float) -> bool:
        return False


@dataclass
class OscarsPolicy:
    """Oscars as ``OscarsStrategy`` runs it (see the module docstring); ``initial_step_times`` skips profiling.

    Attributes:
        solver: ``"exact"`` (step times snapped within ``snap_tolerance``, then the exact solver) or ``"alg1"``
            (the paper's Algorithm 1 on the raw times, blind to the all-reduce cost), as the strategy's option.
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
    snap_tolerance: float = SNAP_TOLERANCE
    solver: str = "exact"
    resolve: bool = True
    initial_step_times: Sequence[float] | None = None
    initial_allreduce_s: float = 0.0
    name: str = "oscars"
    adaptive = True
    schedule: Schedule | None = field(default=None, init=False)
    solves: int = field(default=0, init=False)
    _estimate: np.ndarray | None = field(default=None, init=False, repr=False)
    _measured_allreduce: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.solver not in ("exact", "alg1"):
            raise ValueError(f"solver must be 'exact' or 'alg1', got {self.solver!r}")
        if self.initial_step_times is not None:
            self.schedule = self._solve(tuple(self.initial_step_times), self.initial_allreduce_s)
            self._measured_allreduce = self.initial_allreduce_s  # an oracle knows the cost from the start

    @property
    def solved(self) -> bool:
        return self.schedule is not None

    def _solve(self, times: Sequence[float], allreduce_s: float) -> Schedule:
        """``OscarsStrategy._solve``: Algorithm 1 on the raw times, or the exact solver on snapped times."""
        self.solves += 1
        if self.solver == "alg1":
            solved = solve_schedule_alg1(times, self.max_spread, max_local_steps=self.max_local_steps)
            return Schedule(solved.local_steps, solved.step_times, allreduce_s)
        return solve_schedule(
            snap_step_times(times, self.snap_tolerance),
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
        """One averaging: fold the medians into the estimate, maybe re-solve; True if the local steps changed."""
        # The control vector of averaging k carries the all-reduce time of averaging k-1: the solver after the
        # warm-up sees 0, later ones the previous averaging's cost.
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
        # OscarsStrategy._update_schedule: the same rule, the same function.
        self.schedule, changed = rebalance(
            self.schedule, times, known_cost, self._solve, self.rebalance_threshold, self.min_gain
        )
        return changed


# ---------------------------------------------------------------------------------------------- engine


@dataclass
class SimResult:
    """What one simulated run did. Times in seconds; arrays are per rank. ``rounds`` counts averagings.

    ``validation_s``: simulated train time at every validation; ``history``: per-averaging records (if asked).
    """

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
    validation_s: list[float] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)

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


def _val_check_batch(total_slots: int, interval: float | None) -> int | None:
    """Lightning's ``val_check_batch`` for a float ``val_check_interval`` (the strategy re-sizes it with the epoch)."""
    return max(1, int(total_slots * interval)) if interval else None


class _Engine:
    """Clock and accumulators of one simulated run; :meth:`round` runs a round and its averaging(s)."""

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        allreduce_s: float,
        round_overhead_s: float,
        first_step_s: float,
        seed: int | np.random.SeedSequence | Sequence[int],
        record_batch_size: int | None = None,
    ) -> None:
        n = cluster.n
        self.n, self.policy = n, policy
        self.rng = np.random.default_rng(seed)
        self.means = np.asarray(cluster.step_times, dtype=float)
        self.noise = cluster.noise
        self.noop = cluster.noop_array()
        self.timeline = _Timeline(n, cluster.slowdowns)
        self.load, self.load_time_s = cluster.load_array(), cluster.load_time_s
        self._log_load = self.load * self.rng.standard_normal(n) if self.load.any() else np.zeros(n)
        self._load_at = 0.0
        self.allreduce_s, self.round_overhead_s, self.first_step_s = allreduce_s, round_overhead_s, first_step_s
        self.now = self.comm = self.other = self.util_sum = 0.0
        self.compute, self.idle = np.zeros(n), np.zeros(n)
        self.averagings = self.slots = self.epoch = 0
        self.changes: list[tuple[int, tuple[int, ...]]] = []
        self.epoch_ends: list[float] = []
        self.validations: list[float] = []
        self.record_batch_size = record_batch_size
        self.history: list[dict[str, Any]] = []
        self._started = False
        self._planned: np.ndarray | None = None

    def note_schedule(self) -> None:
        planned = self.policy.local_steps(self.n)
        if self._planned is None or not np.array_equal(planned, self._planned):
            self._planned = planned.copy()
            self.changes.append((self.averagings, tuple(int(x) for x in planned)))

    def round(self, quotas: np.ndarray, width: int, cuts: Sequence[int] = (), validate_at_end: bool = False) -> bool:
        """``width`` slots, rank ``i`` real in its first ``quotas[i]``; average at every cut and at the end.

        A cut is a validation inside the round (the strategy averages before validating); ``validate_at_end``
        marks a validation right after the round. Returns whether the policy changed the schedule at any of
        these averagings. Each averaging folds the medians of the steps since the previous one into the policy,
        as the strategy does at every averaging.
        """
        n = self.n
        factors = self.timeline.at(self.now) * self._load_factors()
        draws = self.means[:, None] * factors[:, None] * _lognormal(self.rng, (n, width), self.noise)
        if not self._started:
            draws[:, 0] += self.first_step_s
            self._started = True
        taken = np.arange(width)[None, :] < quotas[:, None]
        changed = False
        for a, b in zip((0, *cuts), (*cuts, width)):
            real = np.clip(quotas - a, 0, b - a)
            busy = np.where(taken[:, a:b], draws[:, a:b], 0.0).sum(axis=1)
            period = float(np.max(busy + self.noop * ((b - a) - real)))
            self.compute += busy
            self.idle += period - busy
            self.comm += self.allreduce_s
            self.other += self.round_overhead_s
            if period + self.allreduce_s > 0:
                self.util_sum += busy.sum() / (n * (busy.max() + self.allreduce_s))
            self.now += period + self.allreduce_s + self.round_overhead_s
            self.averagings += 1
            medians = _row_medians(draws[:, a:b], real) if getattr(self.policy, "adaptive", True) else real * np.nan
            if self.record_batch_size is not None:
                self._record(real, busy, self.slots + b)
            changed = self.policy.observe(medians, self.allreduce_s) or changed
            if b < width or validate_at_end:
                self.validations.append(self.now)
        self.slots += width
        return changed

    def _record(self, real: np.ndarray, busy: np.ndarray, global_step: int) -> None:
        """A history record as ``OscarsStrategy`` writes it (the all-reduce time is the previous averaging's)."""
        self.history.append(
            {
                "round": self.averagings,
                "time": self.now,
                "epoch": self.epoch,
                "global_step": global_step,
                "local_steps": [int(x) for x in self.policy.local_steps(self.n)],
                "samples": [int(x) * int(self.record_batch_size or 1) for x in real],
                "compute_times": [float(x) for x in busy],
                "allreduce_time": self.allreduce_s if self.averagings > 1 else 0.0,
            }
        )

    def _load_factors(self) -> np.ndarray:
        """This round's mean-1 load factors: the log-AR(1) advanced by the time since the previous round."""
        if not self.load.any():
            return np.ones(self.n)
        elapsed, self._load_at = self.now - self._load_at, self.now
        rho = math.exp(-elapsed / self.load_time_s) if self.load_time_s > 0 else 0.0
        fresh = self.load * self.rng.standard_normal(self.n)
        self._log_load = rho * self._log_load + math.sqrt(1.0 - rho * rho) * fresh
        return np.exp(self._log_load - 0.5 * self.load * self.load)

    def idle_slots(self, slots: int, validations: int = 0) -> None:
        """Slots without data on any rank (the tail of an epoch sized too long): no-ops everywhere, no averaging."""
        seconds = slots * float(self.noop.max())
        self.now += seconds
        self.idle += seconds
        self.slots += slots
        self.validations += [self.now] * validations

    def end_epoch(self, overhead_s: float) -> None:
        self.now += overhead_s
        self.other += overhead_s
        self.epoch_ends.append(self.now)
        self.epoch += 1


def simulate(
    cluster: Cluster,
    policy: Policy,
    total_units: int,
    *,
    allreduce_s: float,
    units_per_epoch: int | None = None,
    epoch_overhead_s: float = 0.0,
    round_overhead_s: float = 0.0,
    first_step_s: float = 0.0,
    val_check_interval: float | None = None,
    planned: bool = True,
    record_batch_size: int | None = None,
    seed: int | np.random.SeedSequence | Sequence[int] = 0,
) -> SimResult:
    """Run epochs until ``total_units`` optimizer steps (summed over ranks) are done.

    Each round draws every rank's step times at once (a ranks x slots matrix), so the cost is one NumPy pass
    per round whatever the number of ranks. ``allreduce_s`` is the exposed communication per averaging,
    ``round_overhead_s`` the bookkeeping around it, ``epoch_overhead_s`` the epoch turnover (validation itself
    takes no simulated time: the benchmark excludes it; its times are in ``SimResult.validation_s``).

    ``planned`` (local SGD, oscars): rounds follow the strategy's ``EpochPlan``; an epoch that starts before the
    policy has a schedule is sized as an upper bound (``units`` slots) and cut (``replan(shrink=True)``) when
    the first schedule is adopted; later changes re-plan at the next round boundary; a validation (every
    ``val_check_interval`` of the epoch's slots) inside a round forces an averaging. Otherwise (BSP) rounds of
    ``local_steps`` run until the epoch's units are used, the last one cut in proportion (a
    ``DistributedSampler``'s even split). ``record_batch_size``: keep a per-averaging history as the strategy
    writes it, with samples counted at this batch size.
    """
    n = cluster.n
    engine = _Engine(cluster, policy, allreduce_s, round_overhead_s, first_step_s, seed, record_batch_size)
    epoch_units = units_per_epoch or total_units
    done = 0
    while done < total_units:
        units = min(epoch_units, total_units - done)
        if planned:
            _planned_epoch(engine, units, val_check_interval)
        else:
            per_rank = -(-units // n)  # a DistributedSampler's batches per rank: the slots of the epoch
            check = _val_check_batch(per_rank, val_check_interval)
            left, slot = units, 0
            while left > 0:
                engine.note_schedule()
                steps = _fit_to_remaining(policy.local_steps(n), left)
                width = int(steps.max())
                engine.round(steps, width, validate_at_end=bool(check) and (slot + width) // check > slot // check)
                left -= int(steps.sum())
                slot += width
        done += units
        engine.end_epoch(epoch_overhead_s)
    return SimResult(
        paradigm=policy.name,
        wall_s=engine.now,
        units=done,
        rounds=engine.averagings,
        compute_s=engine.compute,
        idle_s=engine.idle,
        comm_s=engine.comm,
        other_s=engine.other,
        round_utilization=engine.util_sum / max(engine.averagings, 1),
        schedule_changes=engine.changes,
        epoch_end_s=engine.epoch_ends,
        validation_s=engine.validations,
        history=engine.history,
    )


def _planned_epoch(engine: _Engine, units: int, val_check_interval: float | None) -> None:
    """One epoch on ``EpochPlan`` as ``OscarsStrategy.start_epoch`` / ``average`` drive it."""
    n, policy = engine.n, engine.policy
    steps = tuple(int(x) for x in policy.local_steps(n))
    upper_bound = not policy.solved  # speeds unknown: every unit could need its own slot
    plan = EpochPlan(n, units, units if upper_bound else planned_slots(steps, units), steps)
    check = _val_check_batch(plan.total_slots, val_check_interval)
    slot, pending = 0, False
    while slot < plan.total_slots:
        rnd = plan.round_at(slot)
        if rnd.is_empty:
            engine.idle_slots(rnd.end_slot - slot, (rnd.end_slot // check - slot // check) if check else 0)
            slot = rnd.end_slot
            continue
        engine.note_schedule()
        cuts = [c - slot for c in range(slot + 1, rnd.end_slot) if check and c % check == 0]
        at_end = bool(check) and rnd.end_slot % check == 0
        pending = engine.round(np.asarray(rnd.quotas, dtype=np.int64), rnd.length, cuts, at_end) or pending
        slot = rnd.end_slot
        if pending and slot < plan.total_slots:
            plan.replan(slot, tuple(int(x) for x in policy.local_steps(n)), shrink=upper_bound)
            pending = False
            if upper_bound:
                upper_bound = False
                check = _val_check_batch(plan.total_slots, val_check_interval)


def simulate_bsp(
    cluster: Cluster, total_units: int, *, allreduce_s: float, overlap: float = 0.0, **kw: Any
) -> SimResult:
    """BSP / DDP: one step per rank, wait for the slowest, then the part of the all-reduce not hidden."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must lie in [0, 1], got {overlap}")
    kw.setdefault("planned", False)
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


def parse_slowdown(spec: str | Mapping[Any, Any], n: int, at_s: float = math.inf) -> tuple[float, ...]:
    """Per-rank emulated factors in force at ``at_s`` seconds (default: the last ones): ``"1:3"`` -> ``(1.0, 3.0)``."""
    factors = [1.0] * n
    if isinstance(spec, Mapping):
        for rank, factor in spec.items():
            factors[int(rank)] = float(factor)
        return tuple(factors)
    for rank, entries in parse_profile(spec).items():
        for start, factor in entries:
            if start <= at_s:
                factors[rank] = factor
    return tuple(factors)


def _profile_spec(results: Mapping[str, Any], profile: str) -> str:
    """The slowdown string of ``profile``: the results' ``meta``, else ``benchmarks.heterogeneous.PROFILES``."""
    meta = results.get("meta") if isinstance(results.get("meta"), Mapping) else {}
    specs = meta.get("profiles") if isinstance(meta.get("profiles"), Mapping) else {}
    if isinstance(specs.get(profile), str):
        return specs[profile]
    try:
        from benchmarks.heterogeneous import PROFILES
    except ImportError:  # pragma: no cover - run from outside the repository
        PROFILES = {}
    if profile in PROFILES:
        return PROFILES[profile]
    raise ValueError(f"profile {profile!r}: no slowdown string in the results' meta nor in benchmarks.heterogeneous")


def _is_time_varying(spec: str) -> bool:
    return any(len(entries) > 1 or entries[0][0] > 0 for entries in parse_profile(spec).values())


def _runs(config: Any) -> list[Mapping[str, Any]]:
    if not isinstance(config, Mapping) or not isinstance(config.get("runs"), list):
        return []
    return [r for r in config["runs"] if isinstance(r, Mapping)]


def _history(run: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    history = run.get("history")
    return [r for r in history if isinstance(r, Mapping)] if isinstance(history, list) else []


def _curve(run: Mapping[str, Any]) -> list[float]:
    """Training seconds (validation excluded) at every validation; [] if absent or malformed."""
    curve = run.get("curve")
    try:
        return [float(point[0]) for point in curve] if isinstance(curve, list) else []
    except (TypeError, ValueError, IndexError):
        return []


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _elementwise_median(rows: Sequence[Sequence[float] | None]) -> tuple[float, ...] | None:
    rows = [r for r in rows if r]
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    return tuple(float(statistics.median(col)) for col in zip(*rows))


def run_step_times(run: Mapping[str, Any], batch_size: int) -> list[float] | None:
    """Per-rank mean seconds per real step of one local SGD / oscars run.

    From the round history: compute time over real steps, the first round (profiling, start-up transient) left
    out. Without a history: the run's last smoothed step times (``step_time_s``).
    """
    rounds = _history(run)[1:]
    try:
        compute = np.sum([r["compute_times"] for r in rounds], axis=0, dtype=float)
        steps = np.sum([r["samples"] for r in rounds], axis=0, dtype=float) / batch_size
        if rounds and compute.ndim == 1 and np.all(steps > 0) and np.all(compute > 0):
            return [float(x) for x in compute / steps]
    except (KeyError, TypeError, ValueError):
        pass
    times = run.get("step_time_s")
    if isinstance(times, list) and times and all((_number(t) or 0.0) > 0 for t in times):
        return [float(t) for t in times]
    return None


def run_allreduce(run: Mapping[str, Any]) -> float | None:
    """Median averaging cost of one run (the history's per-round ``allreduce_time``), else its last one."""
    costs = [_number(r.get("allreduce_time")) for r in _history(run)[1:]]
    costs = [c for c in costs if c]
    if costs:
        return float(statistics.median(costs))
    cost = _number(run.get("allreduce_s"))
    return cost if cost else None


def _validation_records(history: Sequence[Mapping[str, Any]], validations_per_epoch: int) -> set[int]:
    """Indices of the records right before a validation: their epoch-local ``global_step`` is a multiple of
    Lightning's ``val_check_batch`` (``int(slots of the epoch / validations per epoch)``)."""
    ends: dict[int, int] = {}
    for r in history:
        ends[int(r["epoch"])] = max(ends.get(int(r["epoch"]), 0), int(r["global_step"]))
    out = set()
    for index, r in enumerate(history):
        epoch = int(r["epoch"])
        base = max((g for e, g in ends.items() if e < epoch), default=0)
        check = max(1, int((ends[epoch] - base) / validations_per_epoch))
        if (int(r["global_step"]) - base) % check == 0:
            out.add(index)
    return out


def round_residuals(run: Mapping[str, Any], batch_size: int) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Per clean round of a history: (wall - all-reduce - busiest compute, compute per rank, no-op slots per rank).

    Left out: rounds across an epoch turnover, and rounds right after a validation (the history's clock runs
    through validation; the benchmark's train wall does not).
    """
    history = _history(run)
    epochs = {r.get("epoch") for r in history}
    per_epoch = round(len(_curve(run)) / len(epochs)) if epochs else 0
    try:
        after_validation = {i + 1 for i in _validation_records(history, per_epoch)} if per_epoch else set()
    except (KeyError, TypeError, ValueError):
        after_validation = set()
    rows = []
    for index, (a, b) in enumerate(zip(history[:-1], history[1:]), start=1):
        try:
            if a["epoch"] != b["epoch"] or index in after_validation:
                continue
            wall = float(b["time"]) - float(a["time"])
            slots = int(b["global_step"]) - int(a["global_step"])
            compute = np.asarray(b["compute_times"], dtype=float)
            real = np.asarray(b["samples"], dtype=float) / batch_size
            cost = float(b["allreduce_time"])
        except (KeyError, TypeError, ValueError):
            continue
        if slots > 0 and wall > 0 and compute.ndim == 1 and compute.size:
            rows.append((wall - cost - float(compute.max()), compute, np.maximum(slots - real, 0.0)))
    return rows


def fit_round_costs(
    rows: Sequence[tuple[float, np.ndarray, np.ndarray]], max_noop_s: float = 5e-3
) -> tuple[float, float] | None:
    """(no-op slot s, per-averaging overhead s) that best explain the rounds' residuals (least absolute error).

    A round's wall beyond its busiest compute and all-reduce is ``max_i(c_i + noop k_i) - max_i c_i + overhead``
    (``k_i`` no-op slots of rank ``i``). Grid over ``noop`` (0.05 ms steps), the median residual as overhead.
    Equal-speed rounds (no no-ops) pin the overhead; rounds where a rank with no-ops finishes last pin ``noop``.
    """
    rows = [r for r in rows if len(r[1]) == len(rows[0][1])] if rows else []
    if len(rows) < 5:
        return None
    residual = np.array([r[0] for r in rows])
    compute = np.stack([r[1] for r in rows])
    noops = np.stack([r[2] for r in rows])
    best: tuple[float, float, float] | None = None
    for noop in np.arange(0.0, max_noop_s + 1e-12, 5e-5):
        extra = (compute + noop * noops).max(axis=1) - compute.max(axis=1)
        gap = residual - extra
        overhead = float(np.median(gap))
        score = float(np.mean(np.abs(gap - overhead)))
        if best is None or score < best[0] - 1e-12:
            best = (score, float(noop), overhead)
    assert best is not None
    return best[1], max(best[2], 0.0)


def first_round_transient(run: Mapping[str, Any], step_times: Sequence[float] | None, batch_size: int) -> float | None:
    """Extra seconds of the start-up in the first round: ``max_i(compute_i - steps_i x t_i)``."""
    history = _history(run)
    if not history or not step_times:
        return None
    try:
        compute = np.asarray(history[0]["compute_times"], dtype=float)
        steps = np.asarray(history[0]["samples"], dtype=float) / batch_size
        return float(np.max(compute - steps * np.asarray(step_times)))
    except (KeyError, TypeError, ValueError):
        return None


def curve_transient(run: Mapping[str, Any]) -> float | None:
    """ddp's start-up transient: the first validation's time minus the typical gap between validations."""
    times = _curve(run)
    if len(times) < 3:
        return None
    return times[0] - float(np.median(np.diff(times)))


def curve_turnover(run: Mapping[str, Any], epochs: int) -> float | None:
    """Epoch turnover of a ddp run: median gap across an epoch end minus median gap within epochs."""
    times = _curve(run)
    per = len(times) // epochs if epochs else 0
    if per < 2 or len(times) != per * epochs or epochs < 2:
        return None
    gaps = np.diff(times)
    crossing = [g for j, g in enumerate(gaps) if (j + 1) % per == 0]
    within = [g for j, g in enumerate(gaps) if (j + 1) % per != 0]
    return float(np.median(crossing) - np.median(within))


def run_load(run: Mapping[str, Any], batch_size: int, noise: float = 0.0) -> tuple[list[float], float | None] | None:
    """Per-rank load sigma and the load's correlation time (s) of one run, from its rounds' mean step times.

    A round's mean step time ``x = compute / real steps`` varies with the machine's load (and with the per-step
    noise, ``noise^2 / steps`` of the variance, subtracted). The correlation time comes from the lag-1
    autocorrelation ``rho`` of ``log x`` at the median round spacing ``dt``: ``-dt / ln(rho)``.
    """
    rounds = _history(run)[1:]
    try:
        compute = np.asarray([r["compute_times"] for r in rounds], dtype=float)
        real = np.asarray([r["samples"] for r in rounds], dtype=float) / batch_size
        times = np.asarray([float(r["time"]) for r in rounds])
    except (KeyError, TypeError, ValueError):
        return None
    if compute.ndim != 2 or len(rounds) < 8:
        return None
    sigmas, taus = [], []
    for i in range(compute.shape[1]):
        ok = real[:, i] >= 2
        if ok.sum() < 8:
            return None
        logs = np.log(compute[ok, i] / real[ok, i])
        logs -= logs.mean()
        sigmas.append(math.sqrt(max(0.0, float(logs.var()) - noise * noise / float(np.median(real[ok, i])))))
        rho = float(np.corrcoef(logs[:-1], logs[1:])[0, 1]) if logs.std() > 0 else 0.0
        dt = float(np.median(np.diff(times[ok])))
        if 0.0 < rho < 1.0 and dt > 0:
            taus.append(-dt / math.log(rho))
    return sigmas, (float(statistics.median(taus)) if taus else None)


@dataclass(frozen=True)
class ValidationInputs:
    """Inputs of one simulated 2-rank configuration; the simulator predicts the end-to-end figures from them.

    Attributes:
        profile, spec: the benchmark's profile name and slowdown string.
        step_times: per-rank seconds per real step at the start, as the strategy measures them (emulated sleep,
            data loading and Lightning's per-step work included; barrier waits excluded).
        events: ``(rank, start_s, step time)``: a rank's step time from ``start_s`` on (time-varying profiles).
        factors: emulated factor per rank at the start.
        allreduce_s: one averaging all-reduce (parameters, buffers and control data).
        ddp_overhead_s: seconds a DDP step adds over the local step (gradient all-reduce, DDP hooks); not
            scaled by the emulator (it sleeps inside ``training_step``), unless ``emulator_scales_ddp_comm``
            (the old emulator, which slept in proportion to the whole batch).
        noop_s: one no-op slot. round_overhead_s: bookkeeping per averaging beyond the all-reduce.
        first_step_s: start-up transient added to every rank's first step.
        epoch_overhead_s: epoch turnover (validation is excluded from the measured train wall).
        load, load_time_s: per-rank sigma and correlation time of the machine's load (see :class:`Cluster`).
        samples, batch_size, epochs, val_check_interval, local_sgd_steps: the run's set-up.
        noise: per-step lognormal sigma. seeds: simulated runs averaged per prediction.
        sources: where every input came from.
    """

    profile: str
    spec: str
    step_times: tuple[float, ...]
    allreduce_s: float
    ddp_overhead_s: float
    events: tuple[tuple[int, float, float], ...] = ()
    factors: tuple[float, ...] = ()
    noop_s: float = DEV_BOX_NOOP_S
    round_overhead_s: float = DEV_BOX_ROUND_OVERHEAD_S
    first_step_s: float = 0.0
    epoch_overhead_s: float = 0.0
    load: tuple[float, ...] = ()
    load_time_s: float = 0.0
    emulator_scales_ddp_comm: bool = False
    samples: int = 65536
    batch_size: int = 64
    epochs: int = 4
    val_check_interval: float | None = 0.25
    local_sgd_steps: int = 16
    noise: float = 0.1
    seeds: int = 5
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def total_units(self) -> int:
        return self.samples // self.batch_size

    @property
    def units_per_epoch(self) -> int:
        return self.total_units // self.epochs

    def ddp_step_times(self) -> tuple[float, ...]:
        """Per-rank seconds of a DDP step before the barrier: the local step plus the per-step overhead."""
        scale = self.factors if self.emulator_scales_ddp_comm and self.factors else (1.0,) * len(self.step_times)
        return tuple(t + k * self.ddp_overhead_s for t, k in zip(self.step_times, scale))

    def cluster(self, paradigm: str) -> Cluster:
        """The simulated 2 ranks: ddp's steps carry its overhead; local SGD / oscars pay no-op slots."""
        ddp = paradigm == "ddp"
        times = self.ddp_step_times() if ddp else self.step_times
        extra = self.ddp_overhead_s if ddp else 0.0
        slowdowns = tuple(Slowdown(rank, start, (target + extra) / times[rank]) for rank, start, target in self.events)
        return Cluster(
            times,
            noise=self.noise,
            slowdowns=slowdowns,
            noop_s=0.0 if ddp else self.noop_s,
            load=self.load or 0.0,
            load_time_s=self.load_time_s,
        )

    def scaled(self, step: float = 1.0, allreduce: float = 1.0) -> ValidationInputs:
        """The same inputs with every step time (and scheduled change) x ``step``, the all-reduce x ``allreduce``."""
        return replace(
            self,
            step_times=tuple(t * step for t in self.step_times),
            events=tuple((r, s, t * step) for r, s, t in self.events),
            allreduce_s=self.allreduce_s * allreduce,
        )


def _results_profiles(results: Mapping[str, Any]) -> Mapping[str, Any]:
    profiles = results.get("profiles")
    if not isinstance(profiles, Mapping):
        raise ValueError(
            "the results JSON has no 'profiles': it predates the {'meta', 'profiles'} format of"
            " benchmarks.heterogeneous; re-run python -m benchmarks.heterogeneous"
        )
    return profiles


def _configs(summary: Any) -> Mapping[str, Any]:
    configs = summary.get("configs") if isinstance(summary, Mapping) else None
    return configs if isinstance(configs, Mapping) else {}


def _strategy_runs(results: Mapping[str, Any], profiles: Sequence[str] | None = None) -> list[Mapping[str, Any]]:
    """Every local SGD / oscars run (the strategy's own round history) of the given profiles (default: all)."""
    out = []
    for profile, summary in _results_profiles(results).items():
        if profiles is None or profile in profiles:
            for name, config in _configs(summary).items():
                if name != "ddp":
                    out += _runs(config)
    return out


def _setup(results: Mapping[str, Any]) -> dict[str, Any]:
    """Samples, epochs and validations per epoch, read from the runs (benchmarks.train_job's defaults else)."""
    meta = results.get("meta") if isinstance(results.get("meta"), Mapping) else {}
    runs = [r for s in _results_profiles(results).values() for c in _configs(s).values() for r in _runs(c)]
    samples = [_number(r.get("samples")) for r in runs]
    samples = [int(s) for s in samples if s]
    epochs = _number(meta.get("epochs")) or next((_number(r.get("epochs")) for r in runs if r.get("epochs")), None)
    epochs = int(epochs or 4)
    curves = [len(_curve(r)) for r in runs if _curve(r)]
    per_epoch = statistics.median(curves) / epochs if curves else 4
    return {
        "samples": int(statistics.median(samples)) if samples else 65536,
        "epochs": epochs,
        "val_check_interval": 1.0 / per_epoch if per_epoch >= 1 else None,
    }


def machine_inputs(results: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Inputs shared by every profile (the machine and Lightning, not the slowdown), with their sources.

    Command line (``overrides``) over what the round histories and ddp's validation times give over defaults.
    ddp's per-step overhead is fitted on the homogeneous profile (``None`` when absent: each profile's ddp is
    then fitted to itself).
    """
    overrides = dict(overrides or {})
    batch = int(overrides.get("batch_size") or 64)
    setup = _setup(results)
    values: dict[str, Any] = {"batch_size": batch, **setup}
    sources: dict[str, str] = {}
    strategy_runs = _strategy_runs(results)
    ddp_runs = [r for s in _results_profiles(results).values() for r in _runs(_configs(s).get("ddp"))]

    rows = [row for run in strategy_runs for row in round_residuals(run, batch)]
    fitted = fit_round_costs(rows)
    for key, index, default in (("noop_s", 0, DEV_BOX_NOOP_S), ("round_overhead_s", 1, DEV_BOX_ROUND_OVERHEAD_S)):
        if overrides.get(key) is not None:
            values[key], sources[key] = float(overrides[key]), "cli"
        elif fitted is not None:
            values[key] = fitted[index]
            sources[key] = f"fit of {len(rows)} rounds of {sum(1 for r in strategy_runs if _history(r))} histories"
        else:
            values[key], sources[key] = default, "default (no round history)"

    transients = [first_round_transient(r, run_step_times(r, batch), batch) for r in strategy_runs]
    transients = [t for t in transients if t is not None]
    ddp_transients = [t for t in (curve_transient(r) for r in ddp_runs) if t is not None]
    if overrides.get("first_step_s") is not None:
        values["first_step_s"], sources["first_step_s"] = float(overrides["first_step_s"]), "cli"
    elif transients:
        values["first_step_s"] = max(0.0, statistics.median(transients))
        sources["first_step_s"] = f"first round of {len(transients)} histories"
    elif ddp_transients:
        values["first_step_s"] = max(0.0, statistics.median(ddp_transients))
        sources["first_step_s"] = f"ddp's first validation, {len(ddp_transients)} runs"
    else:
        values["first_step_s"], sources["first_step_s"] = 0.0, "default"

    turnovers = [t for t in (curve_turnover(r, setup["epochs"]) for r in ddp_runs) if t is not None]
    if overrides.get("epoch_overhead_s") is not None:
        values["epoch_overhead_s"], sources["epoch_overhead_s"] = float(overrides["epoch_overhead_s"]), "cli"
    elif turnovers:
        values["epoch_overhead_s"] = max(0.0, statistics.median(turnovers))
        sources["epoch_overhead_s"] = f"ddp's validation gaps across epoch ends, {len(turnovers)} runs"
    else:
        values["epoch_overhead_s"], sources["epoch_overhead_s"] = 0.0, "default"

    values["noise"] = float(overrides["noise"]) if overrides.get("noise") is not None else 0.1
    loads = [run_load(r, batch, values["noise"]) for r in _strategy_runs(results, _constant_profiles(results))]
    load_times = [x[1] for x in loads if x and x[1] is not None]
    if overrides.get("load") is not None:
        values["load"], sources["load"] = float(overrides["load"]), "cli"
    else:
        values["load"] = None  # per profile and rank, from the runs
        sources["load"] = "per profile and rank, from the rounds' step times" if any(loads) else "none (no history)"
    if overrides.get("load_time_s") is not None:
        values["load_time_s"], sources["load_time_s"] = float(overrides["load_time_s"]), "cli"
    elif load_times:
        values["load_time_s"] = statistics.median(load_times)
        sources["load_time_s"] = f"lag-1 autocorrelation of the rounds' step times, {len(load_times)} runs"
    else:
        values["load_time_s"], sources["load_time_s"] = 0.0, "default"
    values["seeds"] = int(overrides.get("seeds") or 5)
    values["emulator_scales_ddp_comm"] = bool(overrides.get("emulator_scales_ddp_comm", False))
    values["allreduce_s"] = overrides.get("allreduce_s")
    values["ddp_overhead_s"] = None
    if overrides.get("ddp_overhead_s") is not None:
        values["ddp_overhead_s"], sources["ddp_overhead_s"] = float(overrides["ddp_overhead_s"]), "cli"
    else:
        homogeneous = _results_profiles(results).get("homogeneous")
        measured = _number(_configs(homogeneous).get("ddp", {}).get("median_train_wall_s"))
        if measured:
            base = validation_inputs(results, "homogeneous", {**values, "ddp_overhead_s": 0.0}, config="ddp")
            values["ddp_overhead_s"] = fit_ddp_overhead(base, measured)
            sources["ddp_overhead_s"] = "fit to the homogeneous ddp runs"
        else:
            sources["ddp_overhead_s"] = "fit to each profile's own ddp runs (no homogeneous profile): not a prediction"
    values["sources"] = sources
    return values


def _constant_profiles(results: Mapping[str, Any]) -> list[str]:
    out = []
    for profile in _results_profiles(results):
        try:
            if not _is_time_varying(_profile_spec(results, profile)):
                out.append(profile)
        except ValueError:
            continue
    return out


def _step_time_model(results: Mapping[str, Any], batch: int) -> tuple[float, float] | None:
    """``t(k) = a + b (k - 1)``: step time of a ``k``x rank, least squares over the constant profiles' ranks."""
    ks, ts = [], []
    for profile, summary in _results_profiles(results).items():
        try:
            spec = _profile_spec(results, profile)
        except ValueError:
            continue
        if _is_time_varying(spec):
            continue
        runs = [r for name, c in _configs(summary).items() if name != "ddp" for r in _runs(c)]
        times = _elementwise_median([run_step_times(r, batch) for r in runs])
        if times:
            ks += list(parse_slowdown(spec, len(times), at_s=0.0))
            ts += list(times)
    if len(set(ks)) < 2:
        return None
    b, a = np.polyfit(np.asarray(ks) - 1.0, np.asarray(ts), 1)
    return float(a), float(b)


def _solo_times(runs: Sequence[Mapping[str, Any]]) -> tuple[float, ...] | None:
    """Per-rank median of the runs' calibrated pure-compute step time (``cluster[i]["solo_step_s"]``)."""
    rows = []
    for run in runs:
        cluster = run.get("cluster")
        if isinstance(cluster, list) and cluster and all(isinstance(c, Mapping) for c in cluster):
            solo = [_number(c.get("solo_step_s")) for c in cluster]
            if all(solo):
                rows.append(solo)
    return _elementwise_median(rows)


def _regime_step_times(
    runs: Sequence[Mapping[str, Any]],
    batch: int,
    entries: Mapping[int, Sequence[tuple[float, float]]],
    guess: Callable[[float], float],
    n: int,
) -> dict[tuple[int, float], float]:
    """Mean step time of every (rank, emulated factor) of a time-varying profile, from the round histories.

    Each round's mean step time of a rank is assigned to the nearest (in log) of ``guess(k)`` over the factors
    the rank takes in the profile; the rounds of the first averaging (start-up) are left out.
    """
    sums: dict[tuple[int, float], list[float]] = {}
    for run in runs:
        for record in _history(run)[1:]:
            try:
                compute = [float(x) for x in record["compute_times"]]
                real = [float(x) / batch for x in record["samples"]]
            except (KeyError, TypeError, ValueError):
                continue
            for i in range(min(n, len(compute), len(real))):
                if real[i] < 2 or compute[i] <= 0:
                    continue
                ks = {k for _, k in entries.get(i, [])}
                if not entries.get(i) or min(s for s, _ in entries[i]) > 0:
                    ks.add(1.0)
                x = compute[i] / real[i]
                k = min(ks, key=lambda k: abs(math.log(x / guess(k))))
                acc = sums.setdefault((i, k), [0.0, 0.0])
                acc[0] += compute[i]
                acc[1] += real[i]
    return {key: c / steps for key, (c, steps) in sums.items() if steps > 0}


def validation_inputs(
    results: Mapping[str, Any],
    profile: str,
    machine: Mapping[str, Any] | None = None,
    config: str | None = None,
) -> ValidationInputs:
    """Inputs of one configuration of one profile (``machine``: :func:`machine_inputs`, computed if absent).

    Step times and all-reduce cost: the configuration's own round histories (local SGD, oscars), else the
    median over the profile's local SGD / oscars runs (ddp, whose emulated sleep is re-scaled to its own
    runs' calibration), else the machine-wide all-reduce. A time-varying profile (``volatile``) splits the
    histories' rounds by speed regime (nearest of ``t(k) = a + b (k - 1)``, fitted on the constant profiles).
    """
    machine = dict(machine) if machine is not None else machine_inputs(results)
    batch = int(machine.get("batch_size") or 64)
    sources = dict(machine.get("sources", {}))
    spec = _profile_spec(results, profile)
    configs = _configs(_results_profiles(results).get(profile))
    pooled = [r for name, c in configs.items() if name != "ddp" for r in _runs(c)]
    own = _runs(configs.get(config)) if config and config != "ddp" else []
    entries = parse_profile(spec)
    if _is_time_varying(spec):
        model = _step_time_model(results, batch)
        if model is None:
            raise ValueError(f"profile {profile!r} varies in time and no constant profiles give t(k)")
        a, b = model
        regimes = _regime_step_times(own or pooled, batch, entries, lambda k: a + b * (k - 1.0), 2)
        factors = parse_slowdown(spec, 2, at_s=0.0)
        changes = [(rank, start, k) for rank, es in entries.items() for start, k in es if start > 0]
        if regimes:
            where = "own runs" if own else "profile's local SGD / oscars runs"
            sources["step_times"] = f"{where}, rounds split by speed regime (nearest of t(k) = a + b (k-1))"
        else:
            sources["step_times"] = f"t(k) = {a * 1e3:.2f} + {b * 1e3:.2f} (k-1) ms, fitted on the constant profiles"
    else:
        regimes, changes = {}, []
        times = _elementwise_median([run_step_times(r, batch) for r in own])
        sources["step_times"] = "own runs"
        if times is None:
            times = _elementwise_median([run_step_times(r, batch) for r in pooled])
            sources["step_times"] = "profile's local SGD / oscars runs"
        if not any(_history(r) for r in (own or pooled)):
            sources["step_times"] += " (no history: last round's smoothed times)"
        if times is None:
            raise ValueError(f"profile {profile!r}: no local SGD / oscars run gives step times")
        factors = parse_slowdown(spec, len(times), at_s=0.0)
        a, b = 0.0, 0.0
        regimes = {(i, k): t for i, (t, k) in enumerate(zip(times, factors))}
    # ddp has no step times of its own: the strategy runs' ones, with the emulated sleep ((k-1) x the rank's
    # calibrated compute time) re-scaled to the ddp runs' own calibration.
    gap = (0.0,) * len(factors)
    if config == "ddp":
        ddp_solo, pooled_solo = _solo_times(_runs(configs.get("ddp"))), _solo_times(pooled)
        if ddp_solo and pooled_solo and len(ddp_solo) == len(factors) == len(pooled_solo):
            gap = tuple(d - p for d, p in zip(ddp_solo, pooled_solo))
            slowed = [i for i in range(len(gap)) if any(k != 1.0 for _, k in entries.get(i, []))]
            shifts = ", ".join(f"rank {i} {1e3 * gap[i]:+.2f} ms" for i in slowed)
            sources["step_times"] += f"; sleep per (k-1) re-scaled to ddp's calibration ({shifts or 'no slow rank'})"

    def step(rank: int, k: float) -> float:
        return regimes.get((rank, k), a + b * (k - 1.0)) + (k - 1.0) * gap[rank]

    times = tuple(step(i, k) for i, k in enumerate(factors))
    events = tuple((rank, start, step(rank, k)) for rank, start, k in changes)
    noise = float(machine.get("noise", 0.1))
    if machine.get("load") is not None:
        load: tuple[float, ...] = (float(machine["load"]),) * len(times)
    else:
        constant = profile in _constant_profiles(results)
        load = (constant and _elementwise_median([(run_load(r, batch, noise) or ([], None))[0] for r in own])) or ()
        if constant and not load:
            load = _elementwise_median([(run_load(r, batch, noise) or ([], None))[0] for r in pooled]) or ()
        if not load:  # time-varying profile, or no history here: the median over every constant profile's ranks
            every = [
                (run_load(r, batch, noise) or ([], None))[0]
                for r in _strategy_runs(results, _constant_profiles(results))
            ]
            flat = [x for row in every for x in row]
            load = (float(statistics.median(flat)),) * len(times) if flat else ()
    if machine.get("allreduce_s") is not None:
        allreduce, sources["allreduce_s"] = float(machine["allreduce_s"]), "cli"
    else:
        costs = [c for c in (run_allreduce(r) for r in own) if c]
        sources["allreduce_s"] = "own runs"
        if not costs:
            costs = [c for c in (run_allreduce(r) for r in pooled) if c]
            sources["allreduce_s"] = "profile's local SGD / oscars runs"
        if not costs:
            costs = [c for c in (run_allreduce(r) for r in _strategy_runs(results)) if c]
            sources["allreduce_s"] = "all profiles' runs"
        if not costs:
            raise ValueError("no run gives an all-reduce cost; pass --allreduce-s")
        allreduce = float(statistics.median(costs))
    inputs = ValidationInputs(
        profile=profile,
        spec=spec,
        step_times=tuple(float(t) for t in times),
        allreduce_s=allreduce,
        ddp_overhead_s=0.0,
        events=events,
        factors=tuple(factors),
        noop_s=float(machine.get("noop_s", DEV_BOX_NOOP_S)),
        round_overhead_s=float(machine.get("round_overhead_s", DEV_BOX_ROUND_OVERHEAD_S)),
        first_step_s=float(machine.get("first_step_s", 0.0)),
        epoch_overhead_s=float(machine.get("epoch_overhead_s", 0.0)),
        load=tuple(float(x) for x in load),
        load_time_s=float(machine.get("load_time_s") or 0.0),
        emulator_scales_ddp_comm=bool(machine.get("emulator_scales_ddp_comm", False)),
        samples=int(machine.get("samples", 65536)),
        batch_size=batch,
        epochs=int(machine.get("epochs", 4)),
        val_check_interval=machine.get("val_check_interval", 0.25),
        noise=noise,
        seeds=int(machine.get("seeds", 5)),
        sources=sources,
    )
    overhead = machine.get("ddp_overhead_s")
    if overhead is None:  # no homogeneous profile: fit this profile's ddp to itself
        measured = _number(configs.get("ddp", {}).get("median_train_wall_s")) if config == "ddp" else None
        overhead = fit_ddp_overhead(inputs, measured) if measured else 0.0
    return replace(inputs, ddp_overhead_s=float(overhead))


def fit_ddp_overhead(inputs: ValidationInputs, measured_s: float) -> float:
    """ddp's per-step overhead that makes the simulated train wall equal ``measured_s`` (>= 0; one secant step).

    The wall grows almost linearly with the overhead, slightly faster than ``steps x overhead`` because the load
    factor scales the whole step and each step waits for the slower rank.
    """
    per_rank = inputs.total_units / len(inputs.step_times)
    at_zero = predict(replace(inputs, ddp_overhead_s=0.0), "ddp")["train_s"]
    guess = max(0.0, (measured_s - at_zero) / per_rank)
    if guess == 0.0:
        return 0.0
    slope = (predict(replace(inputs, ddp_overhead_s=guess), "ddp")["train_s"] - at_zero) / guess
    return max(0.0, (measured_s - at_zero) / slope) if slope > 0 else guess


def simulate_config(
    inputs: ValidationInputs, paradigm: str, seed: int = 0, record_batch_size: int | None = None
) -> SimResult:
    """One simulated run of the 2-rank benchmark: ``paradigm`` is ddp, local_sgd, oscars or oscars_alg1.

    ddp's per-step overhead is part of every rank's step (no separate cost); local SGD and oscars run on the
    strategy's epoch plan with forced averagings at validation and ``round_overhead_s`` per averaging.
    """
    common: dict[str, Any] = {
        "units_per_epoch": inputs.units_per_epoch,
        "epoch_overhead_s": inputs.epoch_overhead_s,
        "first_step_s": inputs.first_step_s,
        "val_check_interval": inputs.val_check_interval,
        "record_batch_size": record_batch_size,
        "seed": seed,
    }
    cluster = inputs.cluster(paradigm)
    total = inputs.total_units
    if paradigm == "ddp":
        return simulate_bsp(cluster, total, allreduce_s=0.0, **common)
    common["round_overhead_s"] = inputs.round_overhead_s
    if paradigm == "local_sgd":
        return simulate_local_sgd(
            cluster, total, allreduce_s=inputs.allreduce_s, period=inputs.local_sgd_steps, **common
        )
    if paradigm in ("oscars", "oscars_alg1"):
        policy = OscarsPolicy(solver="alg1" if paradigm == "oscars_alg1" else "exact", name=paradigm)
        return simulate_oscars(cluster, total, allreduce_s=inputs.allreduce_s, policy=policy, **common)
    raise ValueError(f"unknown paradigm {paradigm!r}")


def predict(inputs: ValidationInputs, paradigm: str) -> dict[str, Any]:
    """Mean over ``inputs.seeds`` simulated runs of ``paradigm`` (ddp, local_sgd, oscars, oscars_alg1)."""
    runs = [simulate_config(inputs, paradigm, seed) for seed in range(inputs.seeds)]
    train = statistics.mean(r.wall_s for r in runs)
    return {
        "train_s": train,
        "samples_per_s": inputs.samples / train,
        "rounds": statistics.mean(r.rounds for r in runs),
        "utilization": statistics.mean(r.utilization for r in runs),
        "round_utilization": statistics.mean(r.round_utilization for r in runs),
        "final_local_steps": [list(s) for s in dict.fromkeys(r.final_local_steps for r in runs if r.final_local_steps)],
    }


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0


def _measured(config: Mapping[str, Any]) -> dict[str, Any]:
    """The measured figures of one configuration (medians over runs); missing fields become None."""
    runs = _runs(config)
    walls = [w for w in (_number(r.get("train_wall_s")) for r in runs) if w]
    rates = [x for x in (_number(r.get("samples_per_s")) for r in runs) if x]
    rounds = [len(_history(r)) or _number(r.get("rounds")) for r in runs]
    rounds = [x for x in rounds if x]
    return {
        "train_s": _number(config.get("median_train_wall_s")) or (statistics.median(walls) if walls else None),
        "walls": walls,
        "samples_per_s": _number(config.get("median_samples_per_s")) or (statistics.median(rates) if rates else None),
        "rounds": statistics.median(rounds) if rounds else None,
        "schedules": [r.get("schedule") for r in runs if r.get("schedule")],
    }


def _profile_names(results: Mapping[str, Any], wanted: Sequence[str] | None) -> list[str]:
    names = list(_results_profiles(results))
    return [p for p in names if p in wanted] if wanted else names


def validate_against(results_json_path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Predict every profile's ddp, local SGD and oscars train wall and samples/s; compare with the measurements.

    ``overrides``: command-line inputs (keys of :func:`machine_inputs`, ``allreduce_s`` for every profile) and
    ``profiles`` (a subset to validate). Train wall excludes validation, as the benchmark measures it.
    """
    results = json.loads(Path(results_json_path).read_text())
    overrides = dict(overrides or {})
    machine = machine_inputs(results, overrides)
    out: dict[str, Any] = {
        "machine": {k: v for k, v in machine.items() if k != "sources"},
        "sources": machine["sources"],
    }
    out["profiles"] = {}
    for profile in _profile_names(results, overrides.get("profiles")):
        configs = _configs(_results_profiles(results)[profile])
        rows = []
        for name, paradigm in CONFIG_PARADIGMS.items():
            if name not in configs:
                continue
            inputs = validation_inputs(results, profile, machine, config=name)
            predicted = predict(inputs, paradigm)
            measured = _measured(configs[name])
            rows.append(
                {
                    "config": name,
                    "paradigm": paradigm,
                    "inputs": {
                        "step_times": list(inputs.step_times),
                        "allreduce_s": inputs.allreduce_s,
                        "ddp_overhead_s": inputs.ddp_overhead_s,
                        "events": [list(e) for e in inputs.events],
                        "sources": {k: inputs.sources[k] for k in ("step_times", "allreduce_s")},
                    },
                    "predicted": predicted,
                    "measured": measured,
                    "error": {
                        "train_s": _rel(predicted["train_s"], measured["train_s"]),
                        "samples_per_s": _rel(predicted["samples_per_s"], measured["samples_per_s"]),
                        "rounds": _rel(predicted["rounds"], measured["rounds"]) if paradigm != "ddp" else None,
                    },
                }
            )
        by_name = {r["config"]: r for r in rows}
        speedups = {}
        for name in ("local_sgd", "oscars-exact-uniform"):
            if "ddp" in by_name and name in by_name:
                p = by_name["ddp"]["predicted"]["train_s"] / by_name[name]["predicted"]["train_s"]
                m_d, m_o = by_name["ddp"]["measured"]["train_s"], by_name[name]["measured"]["train_s"]
                m = m_d / m_o if m_d and m_o else None
                speedups[name] = {"predicted": p, "measured": m, "error": _rel(p, m)}
        out["profiles"][profile] = {"spec": _profile_spec(results, profile), "rows": rows, "speedup_vs_ddp": speedups}
    errors = [
        abs(r["error"]["train_s"])
        for p in out["profiles"].values()
        for r in p["rows"]
        if r["error"]["train_s"] is not None and not (r["paradigm"] == "ddp" and _ddp_is_fit(out, p))
    ]
    out["max_abs_train_error"] = max(errors) if errors else None
    return out


def _ddp_is_fit(report: Mapping[str, Any], profile_report: Mapping[str, Any]) -> bool:
    """ddp's row is a fit, not a prediction: on the homogeneous profile, or everywhere without one."""
    source = report["sources"].get("ddp_overhead_s", "")
    if source.startswith("fit to each profile"):
        return True
    return source.startswith("fit to the homogeneous") and profile_report.get("spec") == ""


def sensitivity(
    results_json_path: str | Path, overrides: Mapping[str, Any] | None = None, profile: str | None = None
) -> dict[str, Any]:
    """Train-wall error of ddp, local SGD and oscars on one profile when one input moves.

    Why: the inputs were measured on a shared 2-vCPU box; an error that flips sign within their plausible range
    says the inputs, not the model, limit the check.
    """
    results = json.loads(Path(results_json_path).read_text())
    overrides = dict(overrides or {})
    names = _profile_names(results, overrides.get("profiles"))
    if profile is None:
        profile = next((p for p in ("1x/3x", "1x/5x", "1x/2x") if p in names), names[0] if names else None)
    if profile is None:
        return {"profile": None, "rows": []}
    machine = machine_inputs(results, overrides)
    configs = _configs(_results_profiles(results)[profile])
    chosen = [c for c in ("ddp", "local_sgd", "oscars-exact-uniform") if c in configs]
    base = {c: validation_inputs(results, profile, machine, config=c) for c in chosen}
    measured = {c: _measured(configs[c])["train_s"] for c in chosen}
    noop, over = base[chosen[0]].noop_s, base[chosen[0]].round_overhead_s
    variants: list[tuple[str, Callable[[ValidationInputs], ValidationInputs]]] = [
        ("as above", lambda i: i),
        ("no-op slot 0", lambda i: replace(i, noop_s=0.0)),
        (f"no-op slot x2 ({2e3 * noop:.2f} ms)", lambda i: replace(i, noop_s=2 * i.noop_s)),
        ("round overhead 0", lambda i: replace(i, round_overhead_s=0.0)),
        (f"round overhead x2 ({2e3 * over:.2f} ms)", lambda i: replace(i, round_overhead_s=2 * i.round_overhead_s)),
        ("step times x0.9", lambda i: i.scaled(step=0.9)),
        ("step times x1.1", lambda i: i.scaled(step=1.1)),
        ("all-reduce x2", lambda i: i.scaled(allreduce=2.0)),
        ("start-up transient 0", lambda i: replace(i, first_step_s=0.0)),
        ("epoch turnover +0.05 s", lambda i: replace(i, epoch_overhead_s=i.epoch_overhead_s + 0.05)),
        ("load 0", lambda i: replace(i, load=())),
        ("noise sigma 0", lambda i: replace(i, noise=0.0)),
        ("noise sigma 0.2", lambda i: replace(i, noise=0.2)),
        ("ddp overhead x0.5", lambda i: replace(i, ddp_overhead_s=0.5 * i.ddp_overhead_s)),
        ("ddp overhead x1.5", lambda i: replace(i, ddp_overhead_s=1.5 * i.ddp_overhead_s)),
    ]
    rows = []
    for label, change in variants:
        row: dict[str, Any] = {"variant": label}
        for c in chosen:
            row[c] = _rel(predict(change(base[c]), CONFIG_PARADIGMS[c])["train_s"], measured[c])
        rows.append(row)
    return {"profile": profile, "configs": chosen, "rows": rows}


# ---------------------------------------------------------------------------------------------- reports


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ms(times: Sequence[float]) -> str:
    return "/".join(f"{1e3 * t:.2f}" for t in times)


def validation_markdown(report: Mapping[str, Any]) -> list[str]:
    """Machine inputs, a summary of train-wall errors, then one table per profile."""
    m, src = report["machine"], report["sources"]
    ddp_ov = m.get("ddp_overhead_s")
    lines = [
        "## Validation against the 2-rank benchmark",
        "",
        f"Machine inputs (every profile): no-op slot {m['noop_s'] * 1e3:.2f} ms, per-averaging overhead "
        f"{m['round_overhead_s'] * 1e3:.2f} ms, start-up transient {m['first_step_s']:.3f} s, epoch turnover "
        f"{m['epoch_overhead_s']:.3f} s, ddp per-step overhead "
        + ("fitted per profile" if ddp_ov is None else f"{ddp_ov * 1e3:.2f} ms")
        + f"; per-step noise sigma {m['noise']}, {m['seeds']} seeds per prediction; {m['samples']} samples, "
        f"{m['epochs']} epochs, batch {m['batch_size']}, validation every {_num(m['val_check_interval'])} epoch "
        "(excluded from train wall, its forced averagings simulated). Sources: "
        + "; ".join(f"{k}: {v}" for k, v in src.items())
        + ". Step times and all-reduce per configuration: its own round histories (ddp: the profile's local SGD /"
        " oscars runs). Train wall = training time without validation, from after the start-up calibration.",
        "",
    ]
    configs = [c for c in CONFIG_PARADIGMS if any(c in _row_names(p) for p in report["profiles"].values())]
    err = report.get("max_abs_train_error")
    lines += [
        "Train-wall error per profile (predicted / measured - 1; `fit` = ddp fitted there, not predicted). "
        f"Largest |error| of the predictions: {_pct(err).lstrip('+')} (target 15%).",
        "",
        "| profile | " + " | ".join(configs) + " | oscars/ddp speed-up predicted (measured) |",
        "|---|" + "---:|" * len(configs) + "---:|",
    ]
    for profile, p in report["profiles"].items():
        rows = {r["config"]: r for r in p["rows"]}
        cells = []
        for c in configs:
            if c not in rows:
                cells.append("-")
                continue
            text = _pct(rows[c]["error"]["train_s"])
            cells.append(text + (" fit" if c == "ddp" and _ddp_is_fit(report, p) else ""))
        s = p["speedup_vs_ddp"].get("oscars-exact-uniform")
        speed = f"{s['predicted']:.2f}x ({_num(s['measured'])}x)" if s else "-"
        lines.append(f"| {profile} | " + " | ".join(cells) + f" | {speed} |")
    for profile, p in report["profiles"].items():
        lines += [
            "",
            f"### {profile} (`{p['spec'] or 'equal speeds'}`)",
            "",
            "| config | step times ms | all-reduce ms | train s predicted | train s measured (runs) | error | "
            "samples/s predicted | measured | error | averagings predicted | measured | final tau predicted | "
            "measured |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in p["rows"]:
            pr, me, er, inp = r["predicted"], r["measured"], r["error"], r["inputs"]
            steps = _ms(inp["step_times"])
            if inp["events"]:
                steps += " then " + ", ".join(f"r{rank}: {1e3 * t:.2f} at {s:g} s" for rank, s, t in inp["events"])
            if r["paradigm"] == "ddp":
                steps += f" + {inp['ddp_overhead_s'] * 1e3:.2f}"
            walls = ", ".join(f"{w:.2f}" for w in me["walls"])
            is_ddp = r["paradigm"] == "ddp"
            cost = "-" if is_ddp else f"{inp['allreduce_s'] * 1e3:.2f}"
            rounds = "-" if is_ddp else f"{pr['rounds']:.0f}"
            measured_rounds = "-" if is_ddp else _num(me["rounds"], ".0f")
            lines.append(
                f"| {r['config']} | {steps} | {cost} | {pr['train_s']:.2f} | {_num(me['train_s'])} ({walls}) | "
                f"{_pct(er['train_s'])} | {pr['samples_per_s']:.0f} | {_num(me['samples_per_s'], '.0f')} | "
                f"{_pct(er['samples_per_s'])} | {rounds} | {measured_rounds} | {_tau_list(pr['final_local_steps'])} | "
                f"{_tau_list(me['schedules'])} |"
            )
        notes = {f"{r['config']}: step times from {r['inputs']['sources']['step_times']}" for r in p["rows"]}
        notes |= {
            f"{r['config']}: all-reduce from {r['inputs']['sources']['allreduce_s']}"
            for r in p["rows"]
            if r["paradigm"] != "ddp"
        }
        lines += ["", "Sources: " + "; ".join(sorted(notes)) + "."]
    return lines


def _row_names(profile_report: Mapping[str, Any]) -> set[str]:
    return {r["config"] for r in profile_report["rows"]}


def _tau_list(schedules: Sequence[Any]) -> str:
    distinct = list(dict.fromkeys(tuple(s) for s in schedules if s))
    return " ".join(str(list(s)) for s in distinct) if distinct else "-"


def sensitivity_markdown(sens: Mapping[str, Any]) -> list[str]:
    """Train-wall error per input variant (see :func:`sensitivity`)."""
    if not sens.get("rows"):
        return []
    configs = sens["configs"]
    lines = [
        f"Sensitivity ({sens['profile']}): train-wall error when one input changes.",
        "",
        "| variant | " + " | ".join(configs) + " |",
        "|---|" + "---:|" * len(configs),
    ]
    for r in sens["rows"]:
        lines.append(f"| {r['variant']} | " + " | ".join(_pct(r.get(c)) for c in configs) + " |")
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
        "tolerance 0.05, warm-up 4, step times within 5% snapped, re-solve on 20% drift of a step time or of the "
        "all-reduce cost relative to the round, first epoch cut once solved). "
        f"{cfg.steps_per_rank} x N optimizer steps per run. thr = optimizer steps/s "
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


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--validate", metavar="JSON", help="results of benchmarks.heterogeneous to validate against")
    v = p.add_argument_group("validation inputs (override what the results JSON gives)")
    v.add_argument("--profiles", help="comma-separated subset of the JSON's profiles (default: all)")
    v.add_argument("--allreduce-s", type=float, help="seconds of one oscars averaging all-reduce (every profile)")
    v.add_argument("--ddp-overhead-s", type=float, help="seconds a DDP step adds over the local step")
    v.add_argument(
        "--emulated-ddp-comm",
        action="store_true",
        help="results of the old emulator, which slowed DDP's in-step all-reduce down by k on a k-times rank",
    )
    v.add_argument("--noop-s", type=float, help="seconds of one no-op slot")
    v.add_argument("--round-overhead-s", type=float, help="bookkeeping seconds per averaging beyond the all-reduce")
    v.add_argument("--first-step-s", type=float, help="start-up transient added to every rank's first step")
    v.add_argument("--epoch-overhead-s", type=float, help="epoch turnover seconds (validation is excluded)")
    v.add_argument("--load", type=float, help="sigma of the per-round load factor, every rank (0: none)")
    v.add_argument("--load-time-s", type=float, help="correlation time of the load, seconds")
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
        started = time.perf_counter()
        overrides = {
            "profiles": [x for x in a.profiles.split(",") if x] if a.profiles else None,
            "allreduce_s": a.allreduce_s,
            "ddp_overhead_s": a.ddp_overhead_s,
            "noop_s": a.noop_s,
            "round_overhead_s": a.round_overhead_s,
            "first_step_s": a.first_step_s,
            "epoch_overhead_s": a.epoch_overhead_s,
            "load": a.load,
            "load_time_s": a.load_time_s,
            "batch_size": a.batch_size,
            "noise": a.val_noise,
            "seeds": a.val_seeds,
            "emulator_scales_ddp_comm": a.emulated_ddp_comm,
        }
        report["validation"] = validate_against(a.validate, overrides)
        report["validation"]["sensitivity"] = sensitivity(a.validate, overrides)
        elapsed = time.perf_counter() - started
        report["validation"]["seconds"] = elapsed
        text = validation_markdown(report["validation"]) + [""]
        text += sensitivity_markdown(report["validation"]["sensitivity"])
        text += ["", f"Validation simulated in {elapsed:.1f} s."]
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
