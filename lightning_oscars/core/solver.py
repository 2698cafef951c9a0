"""Choosing the round period ``T*`` and the local steps ``tau_i`` of every rank.

Pure functions (NumPy only; no torch, no torch.distributed). Every rank calls them with the same inputs (the step times
agreed through the round's all-reduce) and so derives the same schedule without another collective.

Two solvers are offered:

* :func:`solve_schedule_alg1` follows Algorithm 1 of the Oscars paper: scan ``T`` upward from the slowest
  step time in fixed increments while the local-step spread bound ``M`` holds, and keep the ``T`` whose
  largest per-rank wait ``max_i mod(T, t_i)`` is smallest. Its cost grows with ``N * T_end / dt`` (vectorised over
  ranks, so it stays usable for thousands of ranks).
* :func:`solve_schedule` is exact and communication-aware. A round of compute length ``T`` lets rank ``i``
  take ``floor(T / t_i)`` steps and then pays the all-reduce cost ``c``; its throughput is
  ``sum_i floor(T / t_i) / (T' + c)`` with ``T' = max_i floor(T / t_i) t_i``. That function only changes at
  the breakpoints ``k * t_i``, so the solver evaluates exactly those, takes the best throughput reachable
  under the bounds, and returns the *shortest* round within ``tolerance`` of it: as frequent averaging as the
  cluster can afford. Cost: ``O(K log K)`` with ``K <= N * (max_local_steps + 1)`` breakpoints, vectorised
  with NumPy (about 0.5 ms for 1,024 ranks; see ``benchmarks/solver.py``).

When the speeds are too far apart for the bounds (the fastest rank takes ``max_spread`` or more steps beyond the
slowest, or more than ``max_local_steps``, already in the shortest round ``T = max t``; longer rounds only widen the
gap), no round fills every rank. Both solvers then solve a *capped* problem instead of giving every rank one step:
in a round of length ``T`` rank ``i`` takes ``tau_i(T) = min(floor(T / t_i), floor(T / max t) + max_spread - 1,
max_local_steps)`` steps, so the fast ranks stop at the spread bound and idle for the rest of the round. The round
is picked as in :func:`solve_schedule` (best throughput, then the shortest round within ``tolerance``; Algorithm 1
uses no all-reduce cost and no tolerance), and a ``RuntimeWarning`` says so once per process.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from lightning_oscars.core.schedule import (
    Schedule,
    rebalance,
    schedule_drift,
    schedule_from_local_steps,
    snap_step_times,
    validate_step_times,
)

__all__ = [
    "DEFAULT_MAX_SPREAD",
    "Schedule",
    "rebalance",
    "schedule_drift",
    "schedule_from_local_steps",
    "snap_step_times",
    "solve_schedule",
    "solve_schedule_alg1",
    "validate_step_times",
]

# The default spread bound M. At 16 it never binds below the default cap of 16 local steps, so rounds between
# ranks up to 16x apart are as long as the cap allows: at 8, a 1x/3x pair was held to rounds of [10, 3], too short
# to amortise the all-reduce where steps are short (+9.5% throughput at 1x/3x, +8.7% at 1x/5x in the CPU-bound
# regime, accuracy within 0.2 points: docs/benchmarks.md's decisions table). Users who lower max_local_steps keep it.
DEFAULT_MAX_SPREAD = 16

# Relative slack when flooring T / t_i, so that T = k * t_i computed in floating point still counts k steps.
_EPS = 1e-9
# Periods Algorithm 1 evaluates per vectorised chunk (bounds memory at chunk x ranks floats).
_ALG1_CHUNK = 256

# Whether the capped fallback has warned in this process: strategies re-solve every few rounds, and a cluster
# whose speeds break the bounds would otherwise repeat the same warning each time.
_fallback_warned = False


def _check_bounds(max_spread: int, max_local_steps: int) -> None:
    if isinstance(max_spread, bool) or not isinstance(max_spread, int) or max_spread < 1:
        raise ValueError(f"max_spread must be an integer >= 1, got {max_spread!r}")
    if isinstance(max_local_steps, bool) or not isinstance(max_local_steps, int) or max_local_steps < 1:
        raise ValueError(f"max_local_steps must be an integer >= 1, got {max_local_steps!r}")


def _steps_in(period: float, step_time: float) -> int:
    return int(math.floor(period / step_time + _EPS))


def _reset_fallback_warning() -> None:
    """Let the next capped fallback warn again (the once-per-process guard would hide it from later tests)."""
    global _fallback_warned
    _fallback_warned = False


def _capped_steps(period: float, times: Sequence[float], max_spread: int, max_local_steps: int) -> tuple[int, ...]:
    """``tau_i(T)`` of the capped problem: fill the round, but no rank beyond the spread bound or the cap."""
    slowest = _steps_in(period, max(times))
    most = min(slowest + max_spread - 1, max_local_steps)
    return tuple(max(1, min(_steps_in(period, x), most)) for x in times)


def _capped_period(
    t: np.ndarray, allreduce_time: float, max_spread: int, max_local_steps: int, tolerance: float
) -> float:
    """Round length ``T`` of the capped problem: best throughput, then the shortest round within ``tolerance``.

    Candidates: write ``s = floor(T / t_max)`` (the slowest rank's steps, ``1 .. max_local_steps``; from
    ``s = max_local_steps`` on every rank sits at the cap) and ``c_s = min(s + max_spread - 1, max_local_steps)``.
    On ``[s t_max, (s + 1) t_max)`` the steps ``min(floor(T / t_i), c_s)`` change only at ``T = s t_max`` and at
    the breakpoints ``k t_i`` with ``k <= c_s``; at each of those some rank exactly fills ``T``, so ``T`` is also
    the round's period. Totals without an ``N x K`` evaluation: the total at ``s t_max`` directly (an ``s x N``
    table), plus the breakpoints of the interval not yet counted there, up to ``T`` (their sorted position).
    ``K <= N * max_local_steps`` breakpoints, ``O(K log K)`` like the exact solver.
    """
    t_max = float(t.max())
    slowest = np.arange(1, max_local_steps + 1)
    most = np.minimum(slowest + max_spread - 1, max_local_steps)
    starts = slowest * t_max
    start_totals = np.minimum(np.floor(starts[:, None] / t + _EPS), most[:, None]).sum(axis=1)

    # A breakpoint k * t_i with k <= floor(t_max / t_i) is counted at the first start already: take k above that.
    # The float is clipped before the cast: a fast rank can fill t_max with ~1e15 steps.
    filled = np.minimum(np.floor(t_max / t + _EPS), max_local_steps).astype(np.int64)
    counts = max_local_steps - filled
    ranks = np.repeat(np.arange(len(t)), counts)
    k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + filled[ranks] + 1
    values = k * t[ranks]
    # The interval of each breakpoint (>= 1 as k * t_i > t_max; <= the cap as k <= cap and t_i <= t_max).
    interval = np.minimum(np.floor(values / t_max + _EPS), max_local_steps).astype(np.int64) - 1
    # Keep k within the interval's cap, and k not yet taken at the interval's start (otherwise it ties with it).
    new = (k <= most[interval]) & (k > np.floor(starts[interval] / t[ranks] + _EPS))
    order = np.argsort(values[new], kind="stable")
    values, interval = values[new][order], interval[new][order]
    # Sorting by value keeps every interval contiguous (the interval is a monotone function of the value).
    seen = np.arange(1, len(values) + 1) - np.searchsorted(interval, interval, side="left")
    totals = start_totals[interval] + seen
    # Equal breakpoints: the last of them carries the full count. (Built in place: there may be none at all.)
    last_of_equal = np.ones(len(values), dtype=bool)
    last_of_equal[:-1] = (values[1:] > values[:-1] * (1.0 + _EPS)) | (interval[1:] != interval[:-1])

    periods = np.concatenate([starts, values[last_of_equal]])
    totals = np.concatenate([start_totals, totals[last_of_equal]])
    order = np.argsort(periods, kind="stable")
    periods, totals = periods[order], totals[order]
    rates = totals / (periods + allreduce_time)
    return float(periods[int(np.argmax(rates >= (1.0 - tolerance) * rates.max()))])


def _capped_schedule(
    times: tuple[float, ...], allreduce_time: float, max_spread: int, max_local_steps: int, tolerance: float
) -> Schedule:
    """The fallback of both solvers when no round satisfies the bounds; warns once per process."""
    global _fallback_warned
    period = _capped_period(np.asarray(times), allreduce_time, max_spread, max_local_steps, tolerance)
    steps = _capped_steps(period, times, max_spread, max_local_steps)
    schedule = Schedule(steps, times, allreduce_time)
    if not _fallback_warned:
        _fallback_warned = True
        t_min, t_max = min(times), max(times)
        fastest = _steps_in(t_max, t_min)
        broken = [f"max_spread={max_spread}"] if fastest - 1 >= max_spread else []
        broken += [f"max_local_steps={max_local_steps}"] if fastest > max_local_steps else []
        warnings.warn(
            f"oscars: step times from {t_min:.4g} s to {t_max:.4g} s break {' and '.join(broken)}: the fastest rank"
            f" would take {fastest} steps while the slowest takes one. Using capped rounds of {schedule.period:.4g} s"
            f" instead, local steps {min(steps)} (slowest) to {max(steps)} (fastest); faster ranks idle for the rest"
            f" of the round. Raise {' and '.join(b.split('=')[0] for b in broken)} to let the fast ranks do more."
            " Warned once per process.",
            RuntimeWarning,
            stacklevel=3,
        )
    return schedule


def solve_schedule_alg1(
    step_times: Sequence[float],
    max_spread: int = DEFAULT_MAX_SPREAD,
    *,
    max_local_steps: int = 64,
    increment: float | None = None,
) -> Schedule:
    """The paper's Algorithm 1: a fixed-increment scan of ``T`` minimising the largest wait ``max_i mod(T, t_i)``.

    The scan starts at ``T = max_i t_i`` and continues while
    ``floor(T / min t) - floor(T / max t) < max_spread`` (the spread bound ``M``). On equal speeds that bound
    never fails, so the scan also stops once the fastest rank would exceed ``max_local_steps``: a guard the
    paper does not need to state but a terminating implementation does. ``increment`` defaults to 1% of
    the fastest step time. Ties (waits within ``1e-9 * min t``) keep the smallest ``T``.

    If the bounds fail already at ``T = max t`` (and so at every ``T``), the capped fallback of the module
    docstring is used, with no all-reduce cost and no tolerance (the same schedule as
    ``solve_schedule(step_times, 0.0, tolerance=0.0)`` with these bounds), and a ``RuntimeWarning`` is issued once
    per process.
    """
    times = validate_step_times(step_times)
    _check_bounds(max_spread, max_local_steps)
    t_min, t_max = min(times), max(times)
    dt = t_min / 100.0 if increment is None else float(increment)
    if not math.isfinite(dt) or dt <= 0.0:
        raise ValueError(f"increment must be a finite number of seconds > 0, got {increment!r}")

    t = np.asarray(times)
    # Waits closer than this are ties (they differ by rounding only, which grows with the magnitude of T).
    tie = _EPS * t_min
    best_period, best_wait = t_max, math.inf
    start = 0
    while True:  # scan T = t_max + j * dt in vectorised chunks, stopping where the paper's loop would
        periods = t_max + dt * np.arange(start, start + _ALG1_CHUNK)
        fastest = np.floor(periods / t_min + _EPS)
        running = (fastest - np.floor(periods / t_max + _EPS) < max_spread) & (fastest <= max_local_steps)
        stop = int(np.argmin(running)) if not running.all() else len(periods)
        if stop > 0:
            span = periods[:stop, None]
            waits = (span - np.floor(span / t + _EPS) * t).max(axis=1)
            j = 0
            while True:  # the next T whose wait beats the best by more than a tie: ties keep the smallest T
                better = np.flatnonzero(waits[j:] < best_wait - tie)
                if not len(better):
                    break
                j += int(better[0])
                best_period, best_wait = float(periods[j]), float(waits[j])
        if stop < len(periods):
            break
        start += _ALG1_CHUNK
    if best_wait == math.inf:  # the bounds fail already at T = t_max, hence at every T: cap the fast ranks
        return _capped_schedule(times, 0.0, max_spread, max_local_steps, 0.0)
    steps = tuple(max(1, _steps_in(best_period, x)) for x in times)
    return Schedule(steps, times)


def solve_schedule(
    step_times: Sequence[float],
    allreduce_time: float = 0.0,
    *,
    max_spread: int = DEFAULT_MAX_SPREAD,
    max_local_steps: int = 16,
    tolerance: float = 0.02,
) -> Schedule:
    """Exact, communication-aware solver (see the module docstring).

    When no round satisfies the bounds, the fast ranks are capped at the spread bound instead (the module
    docstring's fallback, chosen with the same ``allreduce_time`` and ``tolerance``), and a ``RuntimeWarning`` is
    issued once per process.

    Args:
        step_times: seconds per optimizer step of every rank.
        allreduce_time: seconds one averaging all-reduce costs; it makes short rounds expensive.
        max_spread: ``M``; the fastest and slowest rank's local steps differ by less than this.
        max_local_steps: no rank takes more local steps than this per round (bounds staleness).
        tolerance: accept a round whose throughput is within this fraction of the best, preferring the
            shortest such round (more frequent averaging helps convergence).
    """
    times = validate_step_times(step_times)
    _check_bounds(max_spread, max_local_steps)
    if not math.isfinite(allreduce_time) or allreduce_time < 0.0:
        raise ValueError(f"allreduce_time must be a finite number of seconds >= 0, got {allreduce_time!r}")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must lie in [0, 1), got {tolerance!r}")

    t = np.asarray(times)
    t_min, t_max = float(t.min()), float(t.max())
    # Feasible periods: every rank takes >= 1 step (T >= t_max), the fastest at most max_local_steps.
    t_upper = (max_local_steps + 1) * t_min * (1.0 - _EPS)
    # Every breakpoint k * t_i up to t_upper. The number of breakpoints <= T is exactly sum_i floor(T / t_i),
    # so after sorting, a breakpoint's position gives the total steps of a round of that length.
    counts = np.floor(t_upper / t + _EPS).astype(np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    multiples = np.arange(int(counts.sum())) - first + 1
    breakpoints = np.sort(np.repeat(t, counts) * multiples)
    totals = np.arange(1, len(breakpoints) + 1)

    # Equal breakpoints: the last of them carries the full count.
    last_of_equal = np.append(breakpoints[1:] > breakpoints[:-1] * (1.0 + _EPS), True)
    long_enough = breakpoints >= t_max * (1.0 - _EPS)
    # The spread is not monotone in T (it drops at multiples of t_max), so every breakpoint is checked.
    spread = np.floor(breakpoints / t_min + _EPS) - np.floor(breakpoints / t_max + _EPS)
    # The cap is checked here too: t_upper's floating-point slack can admit a breakpoint at (cap + 1) * t_min.
    capped = np.floor(breakpoints / t_min + _EPS) <= max_local_steps
    feasible = last_of_equal & long_enough & capped & (spread < max_spread)
    if not feasible.any():  # the bounds fail at T = t_max, hence at every T: cap the fast ranks
        return _capped_schedule(times, float(allreduce_time), max_spread, max_local_steps, tolerance)
    periods, totals = breakpoints[feasible], totals[feasible]
    rates = totals / (periods + allreduce_time)
    shortest_good = int(np.argmax(rates >= (1.0 - tolerance) * rates.max()))
    period = float(periods[shortest_good])
    steps = tuple(max(1, _steps_in(period, x)) for x in times)
    return Schedule(steps, times, float(allreduce_time))
