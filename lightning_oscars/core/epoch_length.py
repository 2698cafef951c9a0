"""How many slots an epoch of plain rounds takes: the fewest that use every unit, or a few more when those run faster.

:func:`planned_slots` counts the fewest slots that hold the epoch's units when every round follows the local steps.
That count is not always the quickest epoch. Lightning validates at slots that follow from the epoch's length
(``val_check_interval``), rounds end there, and the length decides where: with local steps ``(12, 5)`` on 64 units
and a validation halfway, 45 slots put a validation at slot 22 and the epoch's end at 44, so every round is cut to
``(11, 5)``, which leaves the slow rank the busiest, and one slot is left over as a round of its own. 46 slots
validate at 23 and spread the units so that the fast rank keeps its share. :func:`quickest_epoch_slots` prices the
rounds of a few lengths with the schedule's own step times and round cost (values every rank agreed on, so every
rank picks the same length) and keeps the shortest predicted within :data:`SLOT_TOLERANCE` of the fastest. Only
epochs that validate inside themselves are priced: without a validation to move, the fewest slots are the quickest.
Pure; no Lightning, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_oscars.core.quotas import steps_of
from lightning_oscars.core.round_plan import Round

__all__ = ["SEARCHED_SLOTS", "SLOT_TOLERANCE", "plan_seconds", "quickest_epoch_slots"]

# The most extra slots tried beyond the fewest: enough for every offset of a round whose busiest rank takes up to
# this many steps; more would rarely pay for planning the epoch that many more times.
SEARCHED_SLOTS = 16
# The shortest length predicted within this fraction of the fastest is kept: the prediction prices the no-op slots a
# longer epoch adds at nothing, and each still runs a batch's worth of Lightning's loop on every rank.
SLOT_TOLERANCE = 0.005


def plan_seconds(rounds: Sequence[Round], step_times: Sequence[float], round_cost: float) -> float:
    """Predicted seconds of ``rounds``: each lasts until its slowest rank ends its steps, then averages."""
    total = 0.0
    for rnd in rounds:
        widths = rnd.widths or (1,) * len(rnd.quotas)
        total += max(steps_of(q, w) * t for q, w, t in zip(rnd.quotas, widths, step_times)) + round_cost
    return total


def quickest_epoch_slots(
    rounds_of: Callable[[int], Sequence[Round]],
    units: int,
    step_times: Sequence[float],
    round_cost: float,
    least: int,
    most: int,
) -> int:
    """The epoch's slots, from ``least`` (what :func:`planned_slots` counts) to ``most`` (the loader's length), whose
    rounds (``rounds_of(slots)``: the plain rounds an epoch of so many slots would run, validations included) are
    predicted to end soonest while placing all ``units`` they have to: the shortest within :data:`SLOT_TOLERANCE` of
    the fastest. ``least`` when a step time is unknown or there is nothing to choose."""
    if not step_times or not all(t > 0.0 for t in step_times) or most <= least:
        return least
    priced: dict[int, float] = {}
    for slots in range(least, min(most, least + SEARCHED_SLOTS) + 1):
        rounds = rounds_of(slots)
        if sum(sum(r.quotas) for r in rounds) == units:  # a length that leaves units out is never chosen
            priced[slots] = plan_seconds(rounds, step_times, round_cost)
    if not priced:
        return least
    fastest = min(priced.values())
    return min(slots for slots, seconds in priced.items() if seconds <= fastest * (1.0 + SLOT_TOLERANCE))
