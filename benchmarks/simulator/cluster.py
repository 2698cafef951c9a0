"""The simulated cluster: ranks' step times, noise, load and slowdowns, and the cost of a ring all-reduce."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Cluster", "Slowdown", "ring_allreduce_time"]


def ring_allreduce_time(n_ranks: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of one ring all-reduce: a reduce-scatter and an all-gather, each ``N-1`` hops of ``bytes/N``."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if n_ranks == 1:
        return 0.0
    if bandwidth <= 0 or nbytes < 0 or latency < 0:
        raise ValueError("bandwidth must be > 0, nbytes and latency >= 0")
    return 2.0 * (n_ranks - 1) / n_ranks * nbytes / bandwidth + 2.0 * (n_ranks - 1) * latency


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


class Timeline:
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


class Load:
    """Per-rank mean-1 lognormal load factors of successive rounds: a log-AR(1) in simulated time."""

    def __init__(self, sigma: np.ndarray, correlation_s: float, rng: np.random.Generator) -> None:
        self.sigma, self.correlation_s, self.rng = sigma, correlation_s, rng
        n = len(sigma)
        self._log = sigma * rng.standard_normal(n) if sigma.any() else np.zeros(n)
        self._at = 0.0

    def factors(self, now: float) -> np.ndarray:
        """This round's factors: the AR(1) advanced by the time since the previous round."""
        if not self.sigma.any():
            return np.ones(len(self.sigma))
        elapsed, self._at = now - self._at, now
        rho = math.exp(-elapsed / self.correlation_s) if self.correlation_s > 0 else 0.0
        fresh = self.sigma * self.rng.standard_normal(len(self.sigma))
        self._log = rho * self._log + math.sqrt(1.0 - rho * rho) * fresh
        return np.exp(self._log - 0.5 * self.sigma * self.sigma)


def lognormal(rng: np.random.Generator, shape: tuple[int, ...], sigma: float) -> np.ndarray:
    """Mean-1 multiplicative noise (``exp(sigma z - sigma^2 / 2)``): noise does not change the mean step time."""
    if sigma == 0.0:
        return np.ones(shape)
    return np.exp(sigma * rng.standard_normal(shape) - 0.5 * sigma * sigma)


def row_medians(draws: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Median of the first ``steps[i]`` entries of every row (NaN where a rank took no step), vectorised."""
    width = draws.shape[1]
    masked = np.where(np.arange(width)[None, :] < steps[:, None], draws, np.inf)
    ordered = np.sort(masked, axis=1)
    lo = np.clip((steps - 1) // 2, 0, width - 1)
    hi = np.clip(steps // 2, 0, width - 1)
    rows = np.arange(len(steps))
    medians = 0.5 * (ordered[rows, lo] + ordered[rows, hi])
    return np.where(steps > 0, medians, np.nan)


def fit_to_remaining(steps: np.ndarray, remaining: int) -> np.ndarray:
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
