"""The schedule policy: every decision about how many local steps each rank takes, in one pure object.

:class:`SchedulePolicy` holds the solver (chosen once, at construction), its bounds, the snapping of equal
speeds, the smoothing of measured step times, the re-balancing rule, pinned schedules and the bound on an
epoch's slots before the speeds are known. ``OscarsStrategy`` (through its round controller) and the simulator
in ``benchmarks/simulator`` drive the same class, so what the simulator predicts is what the strategy does.

No torch, no torch.distributed: every rank feeds its policy the same all-reduced numbers and so reaches the
same schedule without talking.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from lightning_oscars.core.epoch_length import quickest_epoch_slots
from lightning_oscars.core.partition import Round, max_epoch_slots, plan_rounds, planned_slots
from lightning_oscars.core.solver import (
    DEFAULT_MAX_SPREAD,
    Schedule,
    rebalance,
    schedule_from_local_steps,
    snap_step_times,
    solve_schedule,
    solve_schedule_alg1,
    validate_step_times,
)
from lightning_oscars.core.warmup import warmup_reservation

__all__ = ["SNAP_TOLERANCE", "SPEED_JUMP", "SchedulePolicy", "Solver"]

Solver = Literal["exact", "alg1", "uniform"]
SolveFn = Callable[..., Schedule]
# Ranks whose measured step times differ by less than this are treated as equally fast (noise, not speed).
SNAP_TOLERANCE = 0.05
# A round's median this many times above or below a rank's estimate replaces the estimate instead of being smoothed
# into it: a rank that turned 3x slower (a straggler, a shared node) is re-balanced for at once, not over several
# rounds of a half-way estimate. Noise in a round's median stays well inside a factor of 2.
SPEED_JUMP = 2.0


def _solve_exact(
    times: Sequence[float],
    allreduce_s: float,
    *,
    max_spread: int,
    max_local_steps: int,
    tolerance: float,
    uncertainty: Sequence[float] | None = None,
) -> Schedule:
    return solve_schedule(
        snap_step_times(times, SNAP_TOLERANCE, uncertainty),
        allreduce_s,
        max_spread=max_spread,
        max_local_steps=max_local_steps,
        tolerance=tolerance,
    )


def _solve_alg1(
    times: Sequence[float],
    allreduce_s: float,
    *,
    max_spread: int,
    max_local_steps: int,
    tolerance: float,
    uncertainty: Sequence[float] | None = None,
) -> Schedule:
    # The paper's algorithm as published: raw times, blind to the all-reduce cost (recorded, not used).
    solved = solve_schedule_alg1(times, max_spread, max_local_steps=max_local_steps)
    return Schedule(solved.local_steps, solved.step_times, allreduce_s)


_SOLVERS = {"exact": _solve_exact, "alg1": _solve_alg1}


def _validate(
    solver: str,
    max_spread: int,
    max_local_steps: int,
    warmup_steps: int,
    tolerance: float,
    rebalance_threshold: float,
    min_gain: float,
    smoothing: float,
) -> None:
    """Raise ``ValueError`` naming the first bad schedule option (by the strategy's option name)."""
    if solver not in ("exact", "alg1", "uniform"):
        raise ValueError(f"solver must be 'exact', 'alg1' or 'uniform', got {solver!r}")
    for name, value in (
        ("max_spread", max_spread),
        ("max_local_steps", max_local_steps),
        ("warmup_steps", warmup_steps),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, number, upper in (
        ("efficiency_tolerance", tolerance, 1.0),
        ("rebalance_threshold", rebalance_threshold, math.inf),
        ("min_gain", min_gain, math.inf),
    ):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not (0.0 <= number < upper):
            raise ValueError(f"{name} must be a number in [0, {upper}), got {number!r}")
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 < smoothing <= 1.0:
        raise ValueError(f"smoothing must lie in (0, 1], got {smoothing!r}")


class SchedulePolicy:
    """Chooses every rank's local steps per round from the step times the ranks agreed on.

    Args:
        solver: ``"exact"`` (snapped times, communication-aware), ``"alg1"`` (the paper's Algorithm 1) or
            ``"uniform"`` (fixed-period local SGD: ``max_local_steps`` on every rank, nothing solved).
        max_spread / max_local_steps / tolerance: the solver's bounds (see :func:`solve_schedule`).
        warmup_steps: local steps of every rank while no schedule is known (the profiling round).
        rebalance_threshold / min_gain: the re-balancing rule (see :func:`~lightning_oscars.core.solver.rebalance`).
        smoothing: weight of the newest round's median in every rank's step-time moving average (a median
            :data:`SPEED_JUMP` times off the average replaces it).
        step_times: solve once from these times before the first round (no profiling round).
        local_steps: pin every round's local steps (nothing solved).
        resolve: re-solve when speeds drift; by default only when nothing is pinned.
        initial_allreduce_s: the all-reduce cost the solve from ``step_times`` assumes.
    """

    def __init__(
        self,
        solver: Solver = "exact",
        *,
        max_spread: int = DEFAULT_MAX_SPREAD,
        max_local_steps: int = 16,
        tolerance: float = 0.02,
        warmup_steps: int = 4,
        rebalance_threshold: float = 0.2,
        min_gain: float = 0.02,
        smoothing: float = 0.5,
        step_times: Sequence[float] | None = None,
        local_steps: Sequence[int] | None = None,
        resolve: bool | None = None,
        initial_allreduce_s: float = 0.0,
    ) -> None:
        _validate(
            solver, max_spread, max_local_steps, warmup_steps, tolerance, rebalance_threshold, min_gain, smoothing
        )
        if step_times is not None and local_steps is not None:
            raise ValueError("pin either step_times or local_steps, not both")
        self.solver = solver
        self.widths: tuple[int, ...] | None = None  # units per step of each rank (per-rank batch sizes): epoch sizes
        self.max_spread = max_spread
        self.max_local_steps = max_local_steps
        self.tolerance = float(tolerance)
        self.warmup_steps = warmup_steps
        self.rebalance_threshold = float(rebalance_threshold)
        self.min_gain = float(min_gain)
        self.smoothing = float(smoothing)
        self.pinned_step_times = validate_step_times(step_times) if step_times is not None else None
        self.pinned_local_steps = (
            schedule_from_local_steps(local_steps).local_steps if local_steps is not None else None
        )
        pinned = self.pinned_step_times is not None or self.pinned_local_steps is not None or solver == "uniform"
        self.resolve = (not pinned) if resolve is None else bool(resolve)
        self.initial_allreduce_s = float(initial_allreduce_s)
        self._solve: SolveFn | None = None
        if solver != "uniform":
            self._solve = functools.partial(
                _SOLVERS[solver], max_spread=max_spread, max_local_steps=max_local_steps, tolerance=self.tolerance
            )
        self.world_size = 0
        self.schedule: Schedule | None = None
        self.estimate: list[float] = []  # smoothed seconds per step per rank; 0.0 while unknown
        # each estimate's standard error as a fraction of it (0.0: unknown, or measured without a spread)
        self.uncertainty: list[float] = []
        self.solves = 0
        self._warmup = warmup_steps

    # ------------------------------------------------------------------ a run

    def begin(self, world_size: int, max_steps: int | None = None) -> None:
        """Start a run of ``world_size`` ranks: forget measurements, adopt the pinned schedule if any. A run shorter
        than the warm-up (``max_steps``) spends what it has on measuring."""
        self.world_size = world_size
        self.estimate = [0.0] * world_size
        self.uncertainty = [0.0] * world_size
        self.solves = 0
        self._warmup = min(self.warmup_steps, max_steps) if max_steps and max_steps > 0 else self.warmup_steps
        self.schedule = self._initial_schedule(world_size)

    def _initial_schedule(self, n: int) -> Schedule | None:
        if self.pinned_local_steps is not None:
            if len(self.pinned_local_steps) != n:
                raise ValueError(f"local_steps has {len(self.pinned_local_steps)} entries for {n} ranks")
            return schedule_from_local_steps(self.pinned_local_steps)
        if self._solve is None:  # uniform: fixed-period local SGD
            return schedule_from_local_steps((self.max_local_steps,) * n)
        if self.pinned_step_times is not None:
            if len(self.pinned_step_times) != n:
                raise ValueError(f"step_times has {len(self.pinned_step_times)} entries for {n} ranks")
            return self._count_solve(self.pinned_step_times, self.initial_allreduce_s)
        return None

    @property
    def solved(self) -> bool:
        return self.schedule is not None

    @property
    def warmup(self) -> int:
        """Every rank's steps in the profiling round (``warmup_steps``, or fewer when ``max_steps`` is shorter)."""
        return self._warmup

    @property
    def step_times(self) -> tuple[float, ...]:
        """The seconds per step the schedule was solved for (empty while none is)."""
        return self.schedule.step_times if self.schedule is not None else ()

    def warmup_reservation(self) -> int:
        """Units every rank reserves in a time-boxed warm-up round (``warmup.py``)."""
        return warmup_reservation(self._warmup, self.max_local_steps, self.max_spread)

    @property
    def local_steps(self) -> tuple[int, ...]:
        """Every rank's local steps in the next round: the schedule's, or the warm-up's while none is known."""
        if self.schedule is not None:
            return self.schedule.local_steps
        return (self._warmup,) * self.world_size

    # ------------------------------------------------------------------ epoch sizing

    def epoch_slot_bound(self, total_units: int) -> int:
        """The most slots an epoch of ``total_units`` can take: its length as reported before speeds are known."""
        if self.schedule is not None and not self.resolve:  # pinned or fixed period: the length is known
            return planned_slots(self.schedule.local_steps, total_units, self.widths)
        most = min(self.max_spread, self.max_local_steps)
        return max_epoch_slots(total_units, self.world_size, most, last_round=max(most, self._warmup))

    def epoch_slots(
        self,
        total_units: int,
        bound: int,
        boundaries: Callable[[int], Sequence[int]] | None = None,
        round_cost: float = 0.0,
    ) -> tuple[int, bool]:
        """Slots of an epoch about to start, and whether that is only an upper bound (speeds still unknown: the
        epoch is cut once the first schedule is solved). Never beyond ``bound``, the loader's length. The fewest
        that hold the units, or up to a few more where the epoch's rounds are predicted to run faster in them
        (``epoch_length.py``; ``boundaries``: where an epoch of so many slots validates; ``round_cost``: the agreed
        seconds of one averaging)."""
        schedule, widths = self.schedule, self.widths
        if schedule is None:
            return bound, True
        least = min(planned_slots(schedule.local_steps, total_units, widths), bound)
        if boundaries is None:  # no validation inside the epoch to move: the fewest slots are the quickest
            return least, False

        def rounds_of(slots: int) -> list[Round]:
            return plan_rounds(schedule.local_steps, total_units, slots, boundaries=boundaries(slots), widths=widths)

        return quickest_epoch_slots(rounds_of, total_units, schedule.step_times, round_cost, least, bound), False

    # ------------------------------------------------------------------ measurements

    def observe(self, medians: Sequence[float], allreduce_s: float, errors: Sequence[float] | None = None) -> bool:
        """One averaging: fold each rank's median step time of the round (0 or NaN: none measured) into the
        estimate, maybe (re-)solve; return whether the local steps changed. ``errors``: each median's standard
        error as a fraction of it (from the round's spread and step count); the exact solver does not tell apart
        ranks whose estimates lie within noise of each other (:func:`snap_step_times`)."""
        for rank, median in enumerate(medians):
            if median > 0.0 and math.isfinite(median):
                old = self.estimate[rank]
                error = float(errors[rank]) if errors is not None else 0.0
                if old <= 0.0 or max(median / old, old / median) >= SPEED_JUMP:
                    self.estimate[rank] = median
                    self.uncertainty[rank] = error
                else:
                    a = self.smoothing
                    self.estimate[rank] = a * median + (1.0 - a) * old
                    self.uncertainty[rank] = math.hypot(a * error, (1.0 - a) * self.uncertainty[rank])
        if self._solve is None or not all(t > 0.0 for t in self.estimate):
            return False
        if self.schedule is None:
            self.schedule = self._count_solve(self.estimate, allreduce_s)
            return True
        if not self.resolve:
            return False
        self.schedule, changed = rebalance(
            self.schedule, tuple(self.estimate), allreduce_s, self._count_solve, self.rebalance_threshold, self.min_gain
        )
        return changed

    def _count_solve(self, times: Sequence[float], allreduce_s: float) -> Schedule:
        assert self._solve is not None
        self.solves += 1
        return self._solve(tuple(times), allreduce_s, uncertainty=tuple(self.uncertainty) or None)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        schedule = self.schedule
        return {
            "local_steps": list(schedule.local_steps) if schedule else None,
            "step_times": list(schedule.step_times) if schedule else None,
            "known_times": list(self.estimate),
            "known_uncertainty": list(self.uncertainty),
        }

    def load_state_dict(self, state: dict[str, Any], allreduce_s: float) -> None:
        """Resume an adaptive schedule and the agreed step times (pinned schedules stay as configured)."""
        if not self.resolve or not state.get("local_steps"):
            return
        self.schedule = Schedule(tuple(state["local_steps"]), tuple(state["step_times"]), allreduce_s)
        known = [float(t) for t in state.get("known_times") or []]
        if len(known) == self.world_size:
            self.estimate = known
        errors = [float(e) for e in state.get("known_uncertainty") or []]
        if len(errors) == self.world_size:
            self.uncertainty = errors
