"""Going on with an epoch after a failed round (continuation.py), and the plans built from it."""

from __future__ import annotations

import pytest

from lightning_oscars import RoundController, SchedulePolicy
from lightning_oscars.core.continuation import EpochContinuation, Survivor, continue_epoch
from lightning_oscars.core.partition import EpochPlan


def trained_from(plan: EpochPlan, start_slot: int, world: int) -> list[int]:
    """Every unit the ranks of ``plan`` train from ``start_slot`` on, walking the slots as the loader does."""
    return [
        unit
        for slot in range(start_slot, plan.total_slots)
        for rank in range(world)
        if (unit := plan.unit_at(rank, slot)) is not None
    ]


def failed_at_round_end(world: int = 3, steps=(4, 2, 1), units: int = 60, failed_round: int = 2):
    plan = EpochPlan(world, units, 200, steps)
    rnd = plan.rounds[failed_round]
    return plan, rnd


def test_a_lost_ranks_share_of_the_failed_round_is_trained_again_and_nothing_else():
    plan, rnd = failed_at_round_end()
    survivors = [Survivor(0, rnd.quotas[0]), Survivor(2, rnd.quotas[2])]
    going_on = continue_epoch(plan, 0, rnd.end_slot, survivors)
    before = [plan.unit(p) for p in range(rnd.first_unit)]
    kept = plan.reserved_units(0, rnd) + plan.reserved_units(2, rnd)
    assert sorted(going_on.order[: going_on.consumed]) == sorted(before + kept)
    assert list(going_on.retrained) == plan.reserved_units(1, rnd)
    assert going_on.slots == rnd.end_slot and going_on.epoch == 0
    # The rest of the epoch (the lost share included) is still to come, in the epoch's order after the consumed.
    rest = going_on.order[going_on.consumed :]
    assert set(rest) == set(range(60)) - set(before + kept)
    assert set(going_on.retrained) <= set(rest)


def test_what_a_lost_rank_trained_before_an_extra_averaging_is_kept():
    plan, rnd = failed_at_round_end()
    plan.progress = (1, 1, 0)  # a validation inside the round averaged one unit of ranks 0 and 1
    going_on = continue_epoch(plan, 0, rnd.end_slot, [Survivor(0, rnd.quotas[0])])
    lost1 = plan.reserved_units(1, rnd)
    assert lost1[0] in going_on.order[: going_on.consumed]
    assert list(going_on.retrained) == lost1[1:] + plan.reserved_units(2, rnd)


def test_a_survivor_cut_short_inside_a_round_keeps_only_what_it_trained():
    plan, rnd = failed_at_round_end()
    going_on = continue_epoch(plan, 0, rnd.start_slot + 1, [Survivor(0, 1), Survivor(1, 1), Survivor(2, 1)])
    assert going_on.consumed == rnd.first_unit + 3
    assert going_on.retrained == ()


def test_a_stop_after_an_averaging_consumed_exactly_the_rounds_before_it():
    plan, rnd = failed_at_round_end()
    going_on = continue_epoch(plan, 0, rnd.end_slot, [Survivor(0, 0), Survivor(1, 0)], averaged=True)
    after = plan.rounds[3]
    assert sorted(going_on.order[: going_on.consumed]) == sorted(plan.unit(p) for p in range(after.first_unit))
    assert going_on.retrained == ()
    ended = continue_epoch(plan, 0, plan.total_slots, [Survivor(0, 0)], averaged=True)
    assert ended.consumed == 60


def test_a_failure_inside_a_validation_after_its_averaging_keeps_every_ranks_averaged_units():
    plan, rnd = failed_at_round_end()
    plan.progress = (2, 1, 0)  # what ranks 0, 1, 2 had trained when the validation two slots in averaged
    going_on = continue_epoch(plan, 0, rnd.start_slot + 2, [Survivor(0, 2)], averaged=True)
    kept = plan.reserved_units(0, rnd)[:2] + plan.reserved_units(1, rnd)[:1]
    before = [plan.unit(p) for p in range(rnd.first_unit)]
    assert sorted(going_on.order[: going_on.consumed]) == sorted(before + kept)
    assert going_on.retrained == ()  # the lost rank had trained nothing after the averaging: nothing of it is lost


def test_a_settled_deadline_order_is_followed():
    plan = EpochPlan(2, 40, 40, (2, 1), reserve=(3, 2))
    first = plan.rounds[0]
    plan.settle(first.start_slot, (2, 1))  # both stopped short: their last reserved units go back to the epoch
    plan.replan(first.end_slot, (2, 1), reserve=(3, 2))
    second = plan.rounds[1]
    going_on = continue_epoch(plan, 1, second.end_slot, [Survivor(0, second.quotas[0])])
    consumed = going_on.order[: going_on.consumed]
    assert set(plan.reserved_units(0, first)[:2] + plan.reserved_units(1, first)[:1]) <= set(consumed)
    assert set(plan.reserved_units(0, second)) <= set(consumed)
    assert not set(plan.reserved_units(1, second)) & set(consumed)


@pytest.mark.parametrize("new_world, steps", [(1, (1,)), (2, (3, 1)), (4, (1, 1, 2, 1))])
def test_the_new_worlds_plan_trains_exactly_the_rest_once(new_world, steps):
    plan, rnd = failed_at_round_end()
    going_on = continue_epoch(plan, 0, rnd.end_slot, [Survivor(2, rnd.quotas[2])])
    left = 60 - going_on.consumed
    after = EpochPlan(new_world, 60, going_on.slots + left, steps, continuation=going_on)
    later = trained_from(after, going_on.slots, new_world)
    assert sorted(later) == sorted(going_on.order[going_on.consumed :])
    assert sorted(later + list(going_on.order[: going_on.consumed])) == list(range(60))
    assert after.units_used() == 60
    # A re-plan from a later round boundary keeps the finished slots and still covers the rest once.
    boundary = after.rounds[2].start_slot
    done = [
        u for u in trained_from(after, going_on.slots, new_world) if u not in trained_from(after, boundary, new_world)
    ]
    after.replan(boundary, (1,) * new_world, max_slots=after.total_slots * 2)
    assert sorted(done + trained_from(after, boundary, new_world)) == sorted(going_on.order[going_on.consumed :])


def test_the_round_controller_plans_the_continued_epoch_once():
    policy = SchedulePolicy("exact", max_local_steps=4)
    rounds = RoundController(policy, 2, 1)
    rounds.begin_fit()
    going_on = EpochContinuation(3, tuple(reversed(range(50))), consumed=20, slots=12)
    rounds.continuation = going_on
    plan = rounds.plan_epoch(3, 50, bound=100)
    assert plan.total_slots == 100  # speeds unknown: sized as an upper bound, cut once they are measured
    assert plan.rounds[0].end_slot == 12 and plan.order == list(reversed(range(50)))
    assert sorted(trained_from(plan, 12, 2)) == list(range(30))  # the 30 units left, in the continuation's order
    rounds.forget_plan()
    assert rounds.plan_epoch(3, 50, bound=100).order is None, "used once: the epoch planned again is whole"
    rounds.continuation = going_on
    assert rounds.plan_epoch(4, 50, bound=100).order is None, "another epoch is planned whole"


def test_a_failure_late_in_an_epoch_gets_the_slots_its_rest_needs():
    rounds = RoundController(SchedulePolicy("exact", max_local_steps=4), 2, 0)
    rounds.begin_fit()
    whole = rounds.epoch_slot_bound(8)  # the loader's length for a whole epoch of 8 units
    # The failed round was the epoch's last: its slots are run, and the lost rank's 6 units are still to train.
    going_on = EpochContinuation(1, tuple(range(8)), consumed=2, slots=whole - 2)
    too_short = RoundController(SchedulePolicy("exact", max_local_steps=4), 2, 0)
    too_short.begin_fit()
    too_short.continuation = going_on
    cut = too_short.plan_epoch(1, 8, bound=whole)
    assert len(trained_from(cut, going_on.slots, 2)) < 6, "a whole epoch's length cannot hold the rest"
    rounds.continuation = going_on
    plan = rounds.plan_epoch(1, 8, bound=going_on.slot_bound(rounds.epoch_slot_bound))
    assert sorted(trained_from(plan, going_on.slots, 2)) == list(range(2, 8))


def test_bad_continuations_are_refused():
    plan, rnd = failed_at_round_end()
    with pytest.raises(ValueError, match="no rank survived"):
        continue_epoch(plan, 0, rnd.end_slot, [])
    with pytest.raises(ValueError, match="not distinct ranks"):
        continue_epoch(plan, 0, rnd.end_slot, [Survivor(0, 1), Survivor(0, 1)])
    with pytest.raises(ValueError, match="trained 9 steps"):
        continue_epoch(plan, 0, rnd.end_slot, [Survivor(0, 9)])
    with pytest.raises(ValueError, match="every unit of the epoch once"):
        EpochContinuation(0, (0, 0, 1), 1, 1)
    with pytest.raises(ValueError, match="does not fit"):
        EpochPlan(2, 10, 5, (1, 1), continuation=EpochContinuation(0, tuple(range(10)), 2, 6))
