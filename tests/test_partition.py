import random

import pytest

from lightning_oscars.core.partition import (
    EpochPlan,
    max_epoch_slots,
    plan_rounds,
    planned_slots,
    round_quotas,
    segment_length,
    split_proportionally,
    validations_after_resize,
)


def all_units(plan_rounds_list, world_size):
    units = []
    for rnd in plan_rounds_list:
        for rank in range(world_size):
            units += rnd.units_of(rank)
    return units


def random_epoch(seed: int, most_steps: int, most_units: int) -> tuple[random.Random, int, list[int], int]:
    """A seeded random cluster of 1-6 ranks, their local steps and the epoch's units (and the generator, to go on)."""
    rng = random.Random(seed)
    world = rng.randint(1, 6)
    steps = [rng.randint(1, most_steps) for _ in range(world)]
    return rng, world, steps, rng.randint(world, most_units)


@pytest.mark.parametrize("seed", range(30))
def test_every_unit_used_once_per_epoch(seed):
    _, world, steps, total_units = random_epoch(seed, 9, 400)
    slots = planned_slots(steps, total_units)
    rounds = plan_rounds(steps, total_units, slots)
    units = all_units(rounds, world)
    assert sorted(units) == list(range(total_units))
    assert sum(r.length for r in rounds) == slots
    for rnd in rounds:
        assert all(q <= rnd.length for q in rnd.quotas)


def test_full_rounds_follow_local_steps():
    rounds = plan_rounds([3, 1], 40, planned_slots([3, 1], 40))
    assert all(r.quotas == (3, 1) for r in rounds)
    assert len(rounds) == 10


def test_first_unit_does_not_depend_on_the_quotas():
    a = plan_rounds([5, 2, 1], 100, 60)
    b = plan_rounds([1, 1, 1], 100, 60)
    assert [a[0].units_of(r)[0] for r in range(3)] == [b[0].units_of(r)[0] for r in range(3)] == [0, 1, 2]


def test_replan_keeps_used_units_and_covers_the_rest():
    plan = EpochPlan(2, 60, 60, [2, 2])
    boundary = plan.rounds[3].start_slot
    used = all_units(plan.rounds[:3], 2)
    plan.replan(boundary, [3, 1])
    assert plan.version == 1
    assert all_units(plan.rounds[:3], 2) == used
    assert sorted(all_units(plan.rounds, 2)) == list(range(60))
    with pytest.raises(ValueError):
        plan.replan(boundary + 1, [1, 1])


def test_falling_behind_grows_quotas_instead_of_dropping_data():
    # Sized for (4, 4) but the second rank slowed down to (4, 1): the remaining data still fits.
    slots = planned_slots([4, 4], 80)
    rounds = plan_rounds([4, 1], 80, slots)
    assert sorted(all_units(rounds, 2)) == list(range(80))


def test_unit_at_and_noops():
    plan = EpochPlan(2, 8, planned_slots([3, 1], 8), [3, 1])
    assert [plan.unit_at(1, s) for s in range(3)] == [1, None, None]
    assert plan.unit_at(0, 0) == 0
    # A rank's real slots are spread over the round: cut anywhere, each rank has done its share.
    spread = EpochPlan(2, 11, 8, [8, 3])
    assert spread.rounds[0].real_offsets(1) == [0, 2, 5]
    assert [spread.unit_at(1, s) for s in range(8)] == [1, None, 9, None, None, 10, None, None]
    assert [spread.unit_at(0, s) for s in range(8)] == [0, *range(2, 9)]
    for cut in range(1, 8):
        done = [sum(1 for o in spread.rounds[0].real_offsets(r) if o < cut) for r in range(2)]
        assert abs(done[0] / 8 - done[1] / 3) <= 1 / 3
    with pytest.raises(IndexError):
        plan.round_at(plan.total_slots)


def test_split_proportionally_respects_bounds():
    q = split_proportionally([3.0, 1.0], 8, caps=[5, 5], floors=[1, 1])
    assert q == [5, 3]
    assert split_proportionally([1.0, 1.0, 1.0], 2, caps=[4, 4, 4], floors=[1, 1, 0]) == [1, 1, 0]
    assert sum(split_proportionally([0.2, 7.0, 1.5], 9, caps=[9, 9, 9], floors=[0, 0, 0])) == 9


def test_round_quotas_tail():
    assert round_quotas([3, 1], 0, 10) == [0, 0]
    assert round_quotas([3, 1], 1, 10) == [1, 0]
    assert round_quotas([3, 1], 3, 10) == [2, 1]
    assert round_quotas([3, 1], 100, 10) == [3, 3]  # behind: both work, nothing left over the epoch's slots


def test_replan_with_shrink_cuts_an_upper_bound_epoch_and_keeps_every_unit():
    plan = EpochPlan(2, 100, 100, (4, 4))  # sized as an upper bound: one unit per slot
    plan.replan(4, (3, 1), shrink=True)
    assert plan.total_slots == 4 + planned_slots((3, 1), 92)
    units = sorted(u for r in plan.rounds for rank in range(2) for u in r.units_of(rank))
    assert units == list(range(100))
    # Without shrink the spare slots stay as no-ops.
    kept = EpochPlan(2, 100, 100, (4, 4))
    kept.replan(4, (3, 1))
    assert kept.total_slots == 100 and kept.units_used() == 100
    # Nothing left after the first round: the epoch ends at the boundary.
    done = EpochPlan(2, 8, 8, (4, 4))
    done.replan(4, (3, 1), shrink=True)
    assert done.total_slots == 4 and done.units_used() == 8


def test_epoch_slot_bound_examples():
    # 2 ranks, spread bound 8: at most 8 slots per 9 units, plus one last partial round.
    assert max_epoch_slots(256, 2, 8, last_round=8) == 256 * 8 // 9 + 8 == 235
    # 64 ranks: a round of 8 slots uses at least 71 units.
    assert max_epoch_slots(10_000, 64, 8, last_round=8) == 10_000 * 8 // 71 + 8 == 1134
    assert max_epoch_slots(5, 4, 8, last_round=8) == 5  # never more than one slot per unit
    assert max_epoch_slots(0, 4, 8, last_round=8) == 0
    with pytest.raises(ValueError):
        max_epoch_slots(10, 0, 8, last_round=8)


@pytest.mark.parametrize("old, new", [((5, 8), (2, 5)), ((2, 5), (5, 8)), ((4, 4), (8, 1))])
def test_replan_within_the_loader_bound_resizes_the_epoch_to_the_new_local_steps(old, new):
    """Speeds swapped mid-epoch (the volatile profile): kept at its old size, the epoch would push the slow rank
    beyond its local steps until the epoch ends (or end in idle slots); re-sized, every round but the last follows
    the new local steps exactly, and every unit is still used once."""
    units, bound = 600, max_epoch_slots(600, 2, 8, last_round=8)
    kept = EpochPlan(2, units, planned_slots(old, units), old)
    boundary = kept.rounds[3].start_slot
    kept.replan(boundary, new)
    off_schedule = [r.quotas for r in kept.rounds[3:-1] if r.quotas != new]
    assert off_schedule or kept.rounds[-1].is_empty, "the old size does not fit the new steps (else nothing shown)"
    needed = boundary + planned_slots(new, units - 3 * sum(old))
    resized = EpochPlan(2, units, planned_slots(old, units), old)
    resized.replan(boundary, new, max_slots=bound)
    assert resized.total_slots == needed <= bound
    assert all(r.quotas == new for r in resized.rounds[3:-1]) and not resized.rounds[-1].is_empty
    assert sorted(all_units(resized.rounds, 2)) == list(range(units))
    # Never beyond the loader's length: a bound too small for the new steps keeps what fits, data still once.
    tight = EpochPlan(2, units, planned_slots(old, units), old)
    tight.replan(boundary, new, max_slots=kept.total_slots)
    assert tight.total_slots == min(kept.total_slots, needed)
    assert sorted(all_units(tight.rounds, 2)) == list(range(units))


def test_a_resized_epoch_keeps_its_number_of_validations():
    # 100 batches validated at 50 and 100; grown to 130 after the first validation: only the end is left.
    assert validations_after_resize(60, 130, due=1) == (130,)
    # Grown before the first validation: both move with the epoch.
    assert validations_after_resize(20, 130, due=2) == (75, 130)
    # Cut to 60 after 40 batches, before the first validation: no divisor of 60 validates exactly twice after 40
    # except 10, and for 61 batches none does; the points do.
    assert validations_after_resize(40, 61, due=2) == (51, 61)
    # Every case: exactly `due` points in the rest, increasing, the last at the end; fewer only if fewer batches.
    for done in range(0, 40):
        for new in range(done + 1, 60):
            for due in range(0, 5):
                points = validations_after_resize(done, new, due)
                assert len(points) == min(due, new - done)
                assert all(done < a < b for a, b in zip(points, points[1:])) and all(done < p <= new for p in points)
                assert not points or points[-1] == new


def test_segment_length_tiles_the_slots_before_a_boundary_with_equal_rounds():
    assert segment_length(0, 13, (), 100) is None
    assert segment_length(0, 13, (40,), 100) is None  # far away: full rounds first
    assert segment_length(22, 13, (40,), 100) == 9  # 18 slots left: 9 + 9, not 13 + 5
    assert segment_length(31, 13, (40,), 100) == 9  # the last of them
    assert segment_length(35, 13, (40,), 100) == 5  # less than a round: one round up to the boundary
    assert segment_length(40, 13, (40, 80), 100) is None  # on a boundary: the next one is 40 slots away
    assert segment_length(90, 13, (40, 80, 100), 100) is None  # only the epoch's end ahead: its own rules


def test_rounds_end_on_the_boundaries_with_their_local_steps_scaled_down():
    # A 1x/2x/2x/2x cluster's schedule, an epoch of 36 slots validated after 18: 13 + 5 before, 9 + 9 now.
    steps, units = (13, 13, 13, 7), 128
    slots = planned_slots(steps, units)
    rounds = plan_rounds(steps, units, slots, boundaries=(18,))
    ends = [r.end_slot for r in rounds]
    assert 18 in ends
    assert [r.length for r in rounds if r.end_slot <= 18] == [9, 9]
    assert [r.quotas for r in rounds if r.end_slot <= 18] == [(9, 9, 9, 5), (9, 9, 9, 5)]
    assert sorted(all_units(rounds, 4)) == list(range(units))
    assert sum(r.length for r in rounds) == slots
    without = plan_rounds(steps, units, slots)
    assert 18 not in [r.end_slot for r in without]  # the validation cut a round before


@pytest.mark.parametrize("seed", range(40))
def test_boundaries_never_fall_inside_a_plain_round_and_every_unit_is_used_once(seed):
    rng, world, steps, total_units = random_epoch(seed, 16, 600)
    slots = planned_slots(steps, total_units) + rng.choice([0, 0, rng.randint(0, 20)])
    boundaries = sorted(rng.sample(range(1, slots), min(slots - 1, rng.randint(0, 4)))) if slots > 1 else []
    plan = EpochPlan(world, total_units, slots, steps, boundaries=lambda _: boundaries)
    rounds = plan.rounds
    assert sorted(all_units(rounds, world)) == list(range(total_units))
    assert sum(r.length for r in rounds) == slots
    for rnd in rounds:
        assert all(q <= rnd.length for q in rnd.quotas)
        assert rnd.is_empty or rnd.length <= max(steps)
        if not rnd.is_empty:
            assert not any(rnd.start_slot < b < rnd.end_slot for b in boundaries), (rnd, boundaries)
    # re-planned from a round start with other local steps: still every unit once, still aligned
    start = rounds[len(rounds) // 2].start_slot
    if start < slots:
        new_steps = [rng.randint(1, 16) for _ in range(world)]
        plan.replan(start, new_steps)
        assert sorted(all_units(plan.rounds, world)) == list(range(total_units))
        for rnd in plan.rounds:
            if rnd.start_slot >= start and not rnd.is_empty and rnd.end_slot < plan.total_slots:
                assert not any(rnd.start_slot < b < rnd.end_slot for b in boundaries), (rnd, boundaries)


def test_a_resize_keeps_an_every_n_batches_validation_at_multiples_of_n():
    """``val_check_interval=7`` validates every 7 batches under ddp whatever the epoch's length: a re-plan that
    re-sizes the running epoch must not move the rest of its validations (it once spread them, validating at 13
    and 20), while a fraction of the epoch spreads the ones still owed."""
    from lightning_oscars.core.epoch_shape import EpochValidation

    every_seven = EpochValidation(7, batches_per_slot=1)
    every_seven.sized(30)
    every_seven.at_batch(9)
    assert every_seven.resized(27) is None
    assert all(every_seven.validates_after(b) is None for b in range(27))  # Lightning's own rule: every 7th batch
    assert every_seven.slots(27) == (7, 14, 21)
    quarter = EpochValidation(0.25, batches_per_slot=1)
    quarter.sized(40)
    quarter.at_batch(9)
    assert quarter.resized(30) == frozenset({15, 20, 25, 30})  # the 4 owed after batch 9, spread over the 21 left
