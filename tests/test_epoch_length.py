"""An epoch's length in slots: the fewest that hold its units, or a few more where validations make those slower."""

from __future__ import annotations

import random

import pytest

from lightning_oscars.core.epoch_length import SEARCHED_SLOTS, plan_seconds, quickest_epoch_slots
from lightning_oscars.core.epoch_shape import EpochValidation
from lightning_oscars.core.partition import EpochPlan, plan_rounds, planned_slots
from lightning_oscars.core.policy import SchedulePolicy
from lightning_oscars.core.rounds import RoundController

# The sharded 2 x 2 benchmark's schedule: the slow replica 2.5 times slower, 64 units an epoch, validation halfway.
STEPS, TIMES, COST, UNITS = (12, 5), (0.0435, 0.108), 0.01, 64


def _halfway(slots: int) -> tuple[int, ...]:
    return EpochValidation(0.5, 1).slots(slots)


def _rounds_of(steps, units, boundaries=None, widths=None):
    def rounds_of(slots):
        return plan_rounds(steps, units, slots, boundaries=boundaries(slots) if boundaries else (), widths=widths)

    return rounds_of


def _every_unit_once(rounds, units: int) -> None:
    placed = sorted(u for rnd in rounds for rank in range(len(rnd.quotas)) for u in rnd.units_of(rank))
    assert placed == list(range(units))


def test_a_validation_that_cuts_every_round_short_buys_one_more_slot():
    least = planned_slots(STEPS, UNITS)
    fewest = plan_rounds(STEPS, UNITS, least, boundaries=_halfway(least))
    # 45 slots validate at 22 and end at 44: every round is cut to (11, 5), where the slow rank sets the pace
    assert least == 45 and _halfway(least) == (22, 44)
    assert [r.quotas for r in fewest if any(r.quotas)] == [(11, 5)] * 4
    chosen = quickest_epoch_slots(_rounds_of(STEPS, UNITS, _halfway), UNITS, TIMES, COST, least, least + 40)
    assert chosen == 46
    rounds = plan_rounds(STEPS, UNITS, chosen, boundaries=_halfway(chosen))
    _every_unit_once(rounds, UNITS)
    assert (12, 5) in [r.quotas for r in rounds]  # the fast rank keeps its share
    assert plan_seconds(rounds, TIMES, COST) < 0.96 * plan_seconds(fewest, TIMES, COST)


def test_without_validations_the_fewest_slots_are_kept():
    rng = random.Random(0)
    for _ in range(200):
        steps = tuple(rng.randint(1, 16) for _ in range(rng.randint(2, 4)))
        times = tuple(rng.uniform(0.8, 1.2) / s for s in steps)
        units = rng.randint(10, 500)
        least = planned_slots(steps, units)
        chosen = quickest_epoch_slots(_rounds_of(steps, units), units, times, 0.01 * max(times), least, least + 40)
        assert chosen == least, (steps, units)


@pytest.mark.parametrize("seed", range(3))
def test_the_chosen_length_places_every_unit_once_within_the_loader(seed):
    rng = random.Random(seed)
    for _ in range(60):
        n = rng.randint(2, 4)
        steps = tuple(rng.randint(1, 16) for _ in range(n))
        widths = tuple(rng.randint(1, 3) for _ in range(n)) if rng.random() < 0.3 else None
        times = tuple(rng.uniform(0.5, 2.0) / s for s in steps)
        units, interval = rng.randint(10, 300), rng.choice([0.25, 0.3, 0.5, 1.0])
        least = planned_slots(steps, units, widths)
        most = least + rng.randint(0, 2 * SEARCHED_SLOTS)

        def boundaries(slots: int, interval: float = interval) -> tuple[int, ...]:
            return EpochValidation(interval, 1).slots(slots)

        rounds_of = _rounds_of(steps, units, boundaries, widths)
        chosen = quickest_epoch_slots(rounds_of, units, times, 0.01, least, most)
        assert least <= chosen <= min(most, least + SEARCHED_SLOTS)
        _every_unit_once(rounds_of(chosen), units)
        fewest = plan_seconds(rounds_of(least), times, 0.01)
        assert plan_seconds(rounds_of(chosen), times, 0.01) <= fewest  # never predicted slower than the fewest


def test_unknown_step_times_or_no_room_keep_the_fewest():
    rounds_of = _rounds_of(STEPS, UNITS, _halfway)
    assert quickest_epoch_slots(rounds_of, UNITS, (), COST, 45, 80) == 45
    assert quickest_epoch_slots(rounds_of, UNITS, (0.0, 0.108), COST, 45, 80) == 45
    assert quickest_epoch_slots(rounds_of, UNITS, TIMES, COST, 45, 45) == 45


def _controller() -> RoundController:
    policy = SchedulePolicy(warmup_steps=2)
    controller = RoundController(policy, 2, 0, now=lambda: 0.0)
    controller.begin_fit()
    # a schedule solved earlier in the fit (as a resume restores it), still re-solved as speeds drift
    controller.ledger.load_state_dict({"round_cost": COST})
    policy.load_state_dict({"local_steps": list(STEPS), "step_times": list(TIMES)}, COST)
    return controller


def test_an_epoch_planned_with_a_schedule_takes_the_quicker_length():
    controller = _controller()
    bound = controller.epoch_slot_bound(UNITS)
    assert bound > 46
    plan = controller.plan_epoch(1, UNITS, bound, _halfway)
    assert plan.total_slots == 46
    _every_unit_once(plan.rounds, UNITS)
    # without validations inside the epoch, the fewest
    assert _controller().plan_epoch(1, UNITS, bound).total_slots == 45


def test_a_re_plan_mid_epoch_prices_the_lengths_too():
    # a first round of (4, 4) (a warm-up's), then the solved (12, 5) for the 56 units left
    plan, plain = (EpochPlan(2, UNITS, 40, (4, 4), boundaries=_halfway) for _ in range(2))
    start = plan.rounds[1].start_slot
    plain.replan(start, STEPS, max_slots=100)
    assert plain.total_slots == start + planned_slots(STEPS, UNITS - 8) == 44  # no step times: what the units need
    plan.replan(start, STEPS, max_slots=100, step_times=TIMES, round_cost=COST)
    assert plan.total_slots == 48
    _every_unit_once(plan.rounds, UNITS)
    assert plan_seconds(plan.rounds[1:], TIMES, COST) < 0.97 * plan_seconds(plain.rounds[1:], TIMES, COST)
    capped = EpochPlan(2, UNITS, 40, (4, 4), boundaries=_halfway)
    capped.replan(start, STEPS, max_slots=46, step_times=TIMES, round_cost=COST)
    assert 44 <= capped.total_slots <= 46  # never beyond the loader's length, never short of the units
    _every_unit_once(capped.rounds, UNITS)
