"""A schedule (every rank's local steps per round), its predicted cost, and the rule for changing it.

Pure Python: the solvers in ``solver.py`` produce schedules, ``policy.py`` decides when to adopt a new one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "Schedule",
    "rebalance",
    "schedule_drift",
    "schedule_from_local_steps",
    "SNAP_SIGMAS",
    "snap_step_times",
    "validate_step_times",
]

# How many combined standard errors apart two measured step times must be to count as different speeds.
SNAP_SIGMAS = 2.0

# Plausible seconds per optimizer step; outside this range a timing is broken (and the arithmetic overflows).
MIN_STEP_TIME, MAX_STEP_TIME = 1e-9, 1e6


@dataclass(frozen=True)
class Schedule:
    """How many local steps every rank takes per round, and what that is predicted to cost.

    Attributes:
        local_steps: ``tau_i`` for every rank, each at least 1.
        step_times: the per-rank seconds per optimizer step the schedule was solved for.
        allreduce_time: the seconds one averaging all-reduce was assumed to take.
    """

    local_steps: tuple[int, ...]
    step_times: tuple[float, ...]
    allreduce_time: float = 0.0

    @property
    def period(self) -> float:
        """``T*``: seconds until the last rank finishes its local steps."""
        return max(tau * t for tau, t in zip(self.local_steps, self.step_times))

    @property
    def idle_times(self) -> tuple[float, ...]:
        """Seconds every rank waits at the barrier per round."""
        period = self.period
        return tuple(period - tau * t for tau, t in zip(self.local_steps, self.step_times))

    @property
    def utilization(self) -> float:
        """Share of the cluster's time spent computing (all-reduce and waits count as lost)."""
        busy = sum(tau * t for tau, t in zip(self.local_steps, self.step_times))
        return busy / (len(self.local_steps) * (self.period + self.allreduce_time))

    @property
    def throughput(self) -> float:
        """Predicted optimizer steps per second summed over ranks."""
        return sum(self.local_steps) / (self.period + self.allreduce_time)

    def evaluated_at(self, step_times: Sequence[float], allreduce_time: float | None = None) -> Schedule:
        """The same local steps, priced with other step times (to compare against a re-solved schedule)."""
        times = validate_step_times(step_times)
        if len(times) != len(self.local_steps):
            raise ValueError(f"step_times has {len(times)} entries, the schedule {len(self.local_steps)}")
        cost = self.allreduce_time if allreduce_time is None else allreduce_time
        return Schedule(self.local_steps, times, cost)


def validate_step_times(step_times: Sequence[float], name: str = "step_times") -> tuple[float, ...]:
    """Return ``step_times`` as floats, or raise ``ValueError`` naming ``name`` if any is not finite and > 0."""
    times = tuple(float(t) for t in step_times)
    if not times:
        raise ValueError(f"{name} must not be empty")
    for rank, t in enumerate(times):
        if not math.isfinite(t) or not MIN_STEP_TIME <= t <= MAX_STEP_TIME:
            raise ValueError(
                f"{name}[{rank}] = {t!r}: every step time must be a finite number of seconds in"
                f" [{MIN_STEP_TIME:g}, {MAX_STEP_TIME:g}]"
            )
    return times


def snap_step_times(
    step_times: Sequence[float], tolerance: float = 0.05, uncertainty: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Give ranks whose step times lie within ``tolerance`` of each other one common (the largest) time.

    Measured times of equally fast ranks differ by noise; solving on the raw values lets the shortest
    good round fall between them and hands identical ranks different local steps, and the slightly
    "faster" one then idles every round. Grouping is by sorted order: a group starts at its fastest member
    and takes every rank up to ``(1 + tolerance)`` times that. ``uncertainty``: every time's standard error, as a
    fraction of it (log scale); a rank also joins when its distance in log terms is within
    :data:`SNAP_SIGMAS` combined standard errors of the group's first member: a difference the measurements
    cannot tell from noise (short, jittery steps measured a few times) is not a speed difference either.
    """
    times = validate_step_times(step_times)
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must lie in [0, 1), got {tolerance!r}")
    errors = [0.0] * len(times) if uncertainty is None else [max(0.0, float(e)) for e in uncertainty]
    if len(errors) != len(times):
        raise ValueError(f"{len(errors)} uncertainties for {len(times)} step times")

    def same_speed(first: int, rank: int) -> bool:
        if times[rank] <= times[first] * (1.0 + tolerance):
            return True
        noise = SNAP_SIGMAS * math.hypot(errors[first], errors[rank])
        return math.log(times[rank] / times[first]) <= noise

    order = sorted(range(len(times)), key=times.__getitem__)
    snapped = list(times)
    group: list[int] = []
    for rank in [*order, -1]:
        if group and (rank < 0 or not same_speed(group[0], rank)):
            slowest = times[group[-1]]
            for member in group:
                snapped[member] = slowest
            group = []
        if rank >= 0:
            group.append(rank)
    return tuple(snapped)


def schedule_from_local_steps(
    local_steps: Sequence[int], step_times: Sequence[float] | None = None, allreduce_time: float = 0.0
) -> Schedule:
    """A pinned schedule. Without ``step_times`` the ranks are priced as equally fast (1 s per step)."""
    steps = tuple(local_steps)
    if not steps:
        raise ValueError("local_steps must not be empty")
    for rank, tau in enumerate(steps):
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
            raise ValueError(f"local_steps[{rank}] = {tau!r}: every rank needs an integer >= 1 local steps")
    times = validate_step_times(step_times) if step_times is not None else (1.0,) * len(steps)
    if len(times) != len(steps):
        raise ValueError(f"local_steps has {len(steps)} entries but step_times has {len(times)}")
    return Schedule(steps, times, float(allreduce_time))


def schedule_drift(schedule: Schedule, step_times: Sequence[float], allreduce_time: float) -> float:
    """How far the cluster moved since ``schedule`` was solved, as a fraction: the largest relative change of a
    rank's step time, or of the all-reduce cost relative to the round. Infinite when the cost was unknown (0) at
    the solve and is known now: the first schedule is solved before any all-reduce has been timed, and a cost
    that is small next to the round can still make longer rounds worth it."""
    times = validate_step_times(step_times)
    if len(times) != len(schedule.step_times):
        raise ValueError(f"step_times has {len(times)} entries, the schedule {len(schedule.step_times)}")
    old_cost = schedule.allreduce_time
    if old_cost == 0.0 and allreduce_time > 0.0:
        return math.inf
    drift = max(abs(new - old) / old for new, old in zip(times, schedule.step_times))
    return max(drift, abs(allreduce_time - old_cost) / (schedule.period + old_cost))


def rebalance(
    schedule: Schedule,
    step_times: Sequence[float],
    allreduce_time: float,
    solve: Callable[[Sequence[float], float], Schedule],
    rebalance_threshold: float,
    min_gain: float,
) -> tuple[Schedule, bool]:
    """The re-balancing rule: re-solve when :func:`schedule_drift` exceeds ``rebalance_threshold``, and adopt the
    new schedule only if its local steps differ and it is predicted more than ``min_gain`` faster than keeping the
    current local steps at the new times (hysteresis against flapping on noise).

    Returns ``(schedule, changed)``. When nothing is adopted after a re-solve, the returned schedule keeps the
    local steps but is priced at the new times, which become the reference for the next drift check."""
    if schedule_drift(schedule, step_times, allreduce_time) <= rebalance_threshold:
        return schedule, False
    current = schedule.evaluated_at(step_times, allreduce_time)
    candidate = solve(step_times, allreduce_time)
    if candidate.local_steps != current.local_steps and candidate.throughput > current.throughput * (1.0 + min_gain):
        return candidate, True
    return current, False
