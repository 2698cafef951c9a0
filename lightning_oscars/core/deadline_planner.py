"""One fit's deadline round, planned from what every rank agreed on (``reservations.py`` holds the arithmetic).

:class:`DeadlinePlanner` keeps the deadline round's length in seconds and every rank's reservation
(``deadline.plan_deadline``), re-planned only when the agreed step times, jitters, local steps or round cost moved,
and answers the round controller's questions about the epoch's plan: how many slots an epoch of such rounds takes,
how much of the deadline a round shortened to a validation boundary gets, whether an upcoming round must be re-laid.
Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_oscars.core.deadline import DeadlineRound, plan_deadline
from lightning_oscars.core.partition import EpochPlan, Round
from lightning_oscars.core.reservations import (
    deadline_epoch_slots,
    deadline_reservation,
    deadline_round_fits,
    reservation_scale,
)

__all__ = ["DeadlinePlanner"]


class DeadlinePlanner:
    """One fit's deadline round: its length in seconds and every rank's reservation, from the agreed step times,
    jitters, local steps and round cost; re-planned only when one of them moved (every rank has the same figures, so
    every rank re-plans at the same round)."""

    def __init__(self) -> None:
        self.deadline_round: DeadlineRound | None = None
        self._key: tuple | None = None

    def update(
        self,
        step_times: Sequence[float],
        jitter: Sequence[float],
        local_steps: Sequence[int],
        round_cost: float,
        max_local_steps: int,
    ) -> DeadlineRound | None:
        """The deadline round for these figures (``None`` without step times: rounds stay plain), re-planned when
        the schedule, a step time (by 5%) or a jitter (by 0.02) moved."""
        if not step_times or min(step_times) <= 0.0:
            return None
        key = (
            tuple(local_steps),
            tuple(round(math.log(t) / 0.05) for t in step_times),
            tuple(round(s / 0.02) for s in jitter),
        )
        if key != self._key:
            self._key = key
            self.deadline_round = plan_deadline(step_times, jitter, local_steps, round_cost, max_local_steps)
        return self.deadline_round

    @staticmethod
    def epoch_slots(deadline: DeadlineRound, total_units: int) -> int:
        """Slots of an epoch of ``deadline``'s rounds over ``total_units`` (see :func:`deadline_epoch_slots`)."""
        return deadline_epoch_slots(deadline.expected_units, max(deadline.reserve), total_units)

    @staticmethod
    def scale(plan: EpochPlan | None, slot: int, deadline: DeadlineRound) -> float:
        """The share of the deadline the round starting at ``slot`` gets: less than all of it when the round was
        shortened to end on a validation boundary (its reservations scaled alike)."""
        if plan is None or not 0 <= slot < plan.total_slots:
            return 1.0
        rnd = plan.round_at(slot)
        if not rnd.deadline or rnd.warmup or rnd.start_slot != slot:
            return 1.0
        return reservation_scale(max(deadline.reserve), rnd.length)

    @staticmethod
    def needs_other(plan: EpochPlan, rnd: Round, reserve: tuple[int, ...]) -> bool:
        """Whether the upcoming round ``rnd`` differs from the deadline round ``reserve`` asks for (a plain round
        where one would fit: planned before the first deadline was known). A round shortened to end on a validation
        boundary holds a scaled reservation, and is what ``reserve`` asks for there."""
        if rnd.deadline:
            return rnd.quotas != deadline_reservation(rnd.start_slot, reserve, plan.boundary_slots(), plan.total_slots)
        return deadline_round_fits(reserve, plan.total_units - rnd.first_unit, plan.total_slots - rnd.start_slot)
