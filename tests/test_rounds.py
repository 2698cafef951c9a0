"""The round controller and the control data, driven without Lightning and without torch.distributed: two ranks'
controllers exchange their contributions by summing them, as the all-reduce does."""

from __future__ import annotations

import pytest

from lightning_oscars import RoundController, RoundRecord, SchedulePolicy
from lightning_oscars.core.control import Contribution, ControlData, RankReport, fraction_of_ideal
from lightning_oscars.core.loader import SlotInfo


class FakeClock:
    """Laps of scripted lengths: ``next_lap`` seconds per closed interval."""

    def __init__(self) -> None:
        self.next_lap = 0.01
        self._laps: list[float] = []

    def mark(self) -> None:
        pass

    def lap(self) -> None:
        self._laps.append(self.next_lap)

    def drain(self) -> list[float]:
        laps, self._laps = self._laps, []
        return laps


def cluster(step_times: tuple[float, float], **policy) -> list[tuple[RoundController, FakeClock]]:
    ranks = []
    for rank, seconds in enumerate(step_times):
        clock = FakeClock()
        clock.next_lap = seconds
        controller = RoundController(SchedulePolicy(warmup_steps=2, **policy), 2, rank, clock=clock, now=lambda: 0.0)
        controller.begin_fit()
        ranks.append((controller, clock))
    return ranks


def run_round(ranks, slot0: int, batch_size: int = 8) -> tuple[list, int]:
    """Every rank iterates the round's slots (real for its quota, no-op after), then the control data is summed."""
    plan = ranks[0][0].plan
    rnd = plan.round_at(slot0)
    ends = set()
    for controller, _ in ranks:
        real = rnd.real_offsets(controller.rank)
        for offset in range(rnd.length):
            controller.begin_slot(SlotInfo(offset in real, batch_size if offset in real else 0, 0.0))
            ends.add(controller.end_slot(slot0 + offset, 1, plan.total_slots))
    assert ends == {None, rnd.end_slot}, "every rank ends the round at the same slot"
    vectors = [c.contribution(global_step=rnd.end_slot).encode(2) for c, _ in ranks]
    summed = ControlData.decode([sum(v) for v in zip(*vectors)], 2)
    outcomes = [c.absorb(summed, allreduce_s=0.001, epoch=0, global_step=rnd.end_slot, next_slot=rnd.end_slot)
                for c, _ in ranks]  # fmt: skip
    return outcomes, rnd.end_slot


def test_warmup_then_a_solved_schedule_that_favours_the_fast_rank():
    ranks = cluster((0.01, 0.03))
    plans = [c.plan_epoch(0, total_units=64, bound=c.policy.epoch_slot_bound(64)) for c, _ in ranks]
    bound = ranks[0][0].policy.epoch_slot_bound(64)
    assert plans[0].total_slots == plans[1].total_slots == bound
    outcomes, slot = run_round(ranks, 0)
    first = outcomes[0]
    assert first == outcomes[1], "every rank reaches the same outcome"
    assert first.record.local_steps == (2, 2) and first.rebalanced and first.resized
    assert first.record.samples == (16, 16)
    assert first.record.step_times == pytest.approx((0.01, 0.03))
    tau = ranks[0][0].local_steps
    assert tau[0] >= 2 * tau[1]
    # The epoch sized as an upper bound was cut to what the schedule needs.
    assert ranks[0][0].plan.total_slots == ranks[1][0].plan.total_slots < bound
    second, _ = run_round(ranks, slot)
    assert second[0].record.local_steps == tau and not second[0].rebalanced and not second[0].resized
    # Nothing trained since that averaging: a validation, checkpoint or epoch end right now averages nothing.
    assert not any(c.needs_average for c, _ in ranks)
    ranks[0][0].begin_slot(SlotInfo(False, 0, 0.0))  # a no-op slot is not training either...
    ranks[0][0].end_slot(slot, 1, ranks[0][0].plan.total_slots)
    assert ranks[0][0].needs_average  # ...but it is a slot of the round: every rank agrees on the answer


def test_round_cost_is_the_busiest_ranks_time_outside_its_steps():
    # Pinned (2, 2) local steps at 0.01 / 0.03 s. Each round's averaging ends 0.08 s after the previous one (wall
    # clock scripted): rank 1's round is 0.06 s of compute and 0.02 s of everything else, the round's fixed cost;
    # rank 0 reports 0.06 s outside its steps (its wait included). Validation time does not count.
    clock = {"now": 0.0}
    ranks = cluster((0.01, 0.03), local_steps=(2, 2))
    for c, _ in ranks:
        c.ledger._now = lambda: clock["now"]
        c.plan_epoch(0, 16, c.policy.epoch_slot_bound(16))
    slot, costs = 0, []
    for i in range(4):
        clock["now"] += 0.08
        if i == 2:
            clock["now"] += 1.0  # a validation run between rounds 2 and 3
            for c, _ in ranks:
                c.exclude_time(1.0)
        outcomes, slot = run_round(ranks, slot)
        assert outcomes[0].record == outcomes[1].record
        costs.append(outcomes[0].record.round_cost)
    # Reports lag one round and round 1 began at an unknown time: the cost is unknown (0) until round 3, which
    # prices round 2's fixed cost of 0.02 s.
    assert costs[0] == costs[1] == 0.0
    assert costs[2] == pytest.approx(0.02) and costs[3] == pytest.approx(0.02)
    assert outcomes[0].record.time == pytest.approx(0.32)  # training time: the validation second is left out
    assert outcomes[0].record.wall == pytest.approx(0.06 + 0.02)


def test_requests_travel_to_every_rank_and_are_cleared():
    ranks = cluster((0.01, 0.01), local_steps=(2, 2))
    for c, _ in ranks:
        c.plan_epoch(0, 16, c.policy.epoch_slot_bound(16))
    ranks[1][0].ledger.request_stop()
    assert (
        ranks[0][0].ledger.request_sigterm() and not ranks[0][0].ledger.request_sigterm()
    )  # only the first one counts
    ranks[1][0].ledger.request_requeue()
    outcomes, slot = run_round(ranks, 0)
    assert all(o.stop and o.sigterm and o.requeue for o in outcomes)
    later, _ = run_round(ranks, slot)
    # stop and requeue are served once; SIGTERM stays (the run is ending).
    assert all(not o.stop and not o.requeue and o.sigterm for o in later)


def test_disagreeing_global_steps_are_an_error():
    ranks = cluster((0.01, 0.01), local_steps=(1, 1))
    vectors = [
        Contribution(0, RankReport(global_step=3)).encode(2),
        Contribution(1, RankReport(global_step=4)).encode(2),
    ]
    summed = ControlData.decode([a + b for a, b in zip(*vectors)], 2)
    with pytest.raises(RuntimeError, match="disagree on global_step"):
        ranks[0][0].absorb(summed, allreduce_s=0.0, epoch=0, global_step=3, next_slot=None)


def test_control_data_round_trip_and_bad_sizes():
    mine = Contribution(1, RankReport(0.02, 32, 0.5, 0.003, 7), weight=32.0, stop=True)
    summed = ControlData.decode(mine.encode(3), 3)
    assert summed.ranks[1] == RankReport(0.02, 32, 0.5, 0.003, 7)
    assert summed.ranks[0] == RankReport() and summed.weight == 32.0
    assert (summed.stop, summed.sigterm, summed.requeue) == (True, False, False)
    with pytest.raises(ValueError, match="entries for 2 ranks"):
        ControlData.decode(mine.encode(3), 2)
    with pytest.raises(ValueError, match="outside a world"):
        Contribution(3, RankReport()).encode(3)


def test_record_derives_period_idle_and_utilization():
    r = RoundRecord(1, 0.0, 0, 4, (3, 1), (0.1, 0.3), (48, 16), (0.3, 0.2), 0.1, False)
    assert r.period == 0.3 and r.idle_times == pytest.approx((0.0, 0.1))
    assert r.utilization == pytest.approx(0.5 / (2 * 0.4))
    assert r["local_steps"] == [3, 1] and r.local_steps == (3, 1)  # subscripts read as the dicts of 0.1 did
    assert r.as_dict()["idle_times"] == pytest.approx([0.0, 0.1]) and dict(r)["period"] == r.get("period")
    with pytest.raises(KeyError):
        r["nope"]


def test_fraction_of_ideal_weights_idle_time_by_speed():
    # Rank 0 (0.1 s/step) computes 0.3 of a 0.4 s round, rank 1 (0.3 s/step) 0.2: 3 + 2/3 steps trained where
    # 4 + 4/3 could have been. A fast rank's idle second costs three times a slow rank's.
    r = RoundRecord(1, 0.0, 0, 4, (3, 1), (0.1, 0.3), (48, 16), (0.3, 0.2), 0.1, False)
    assert r.fraction_of_ideal == pytest.approx((3 + 2 / 3) / (4 + 4 / 3))
    assert fraction_of_ideal([0.3, 0.2], [0.1, 0.3], 0.4) == r.fraction_of_ideal
    assert fraction_of_ideal([1.0, 1.0], [0.1, 0.3], 1.0) == pytest.approx(1.0)  # nobody waits: ideal
    assert fraction_of_ideal([1.0, 0.0], [0.1, 0.3], 1.0) == pytest.approx(0.75)  # the slow rank is the idle one
    assert fraction_of_ideal([0.0, 1.0], [0.1, 0.3], 1.0) == pytest.approx(0.25)
    assert fraction_of_ideal([1.0], [0.1], 0.0) == 0.0 and fraction_of_ideal([1.0, 1.0], [0.1, 0.0], 1.0) == 0.0
    assert "fraction_of_ideal" in r.as_dict()


def test_checkpoint_state_restores_schedule_estimates_and_plan():
    ranks = cluster((0.01, 0.03))
    for c, _ in ranks:
        c.plan_epoch(0, 64, c.policy.epoch_slot_bound(64))
    run_round(ranks, 0)
    saved = ranks[1][0].state_dict()
    fresh = RoundController(SchedulePolicy(warmup_steps=2), 2, 1, clock=FakeClock())
    fresh.begin_fit()
    plan = fresh.load_state_dict(saved, total_units=64)
    assert fresh.local_steps == ranks[1][0].local_steps and fresh.num_averagings == 1
    assert fresh.policy.estimate == ranks[1][0].policy.estimate
    assert plan is not None and plan.rounds == ranks[1][0].plan.rounds
    # Another cluster shape: start afresh.
    other = RoundController(SchedulePolicy(warmup_steps=2), 3, 1, clock=FakeClock())
    other.begin_fit()
    assert other.load_state_dict(saved, total_units=64) is None and other.policy.schedule is None


def test_only_rounds_ending_away_from_validations_and_the_epoch_end_may_be_combined_late():
    # Overlapped averaging's rule: where Lightning validates or the epoch ends the models must be equal at once.
    controller = RoundController(SchedulePolicy(local_steps=[3, 1]), 2, 0, now=lambda: 0.0)
    controller.begin_fit()
    plan = controller.plan_epoch(0, total_units=48, bound=64, boundaries=lambda slots: (slots // 2,))
    ends = [r.end_slot for r in plan.rounds]
    validation = plan.boundary_slots()[0]
    assert validation in ends and ends[-1] == plan.total_slots  # the plan ends rounds there
    late = {end for end in ends if controller.may_combine_late(end)}
    assert late == set(ends) - {validation, plan.total_slots}
    assert late, "rounds inside the epoch's halves may be combined late"
    controller.forget_plan()
    assert not controller.may_combine_late(ends[0])  # no plan: nothing is late


def test_a_slot_lightning_runs_past_the_plan_makes_the_epoch_end_average():
    # SWA's BatchNorm epoch lengthens the epoch by one batch, where a partial accumulation unit steps the optimizer
    # on each rank's own gradients: the epoch's end must average, on every rank alike.
    ranks = cluster((0.01, 0.01), local_steps=(2, 2))
    for c, _ in ranks:
        c.plan_epoch(0, 16, c.policy.epoch_slot_bound(16))
    slot = 0
    while slot < ranks[0][0].plan.total_slots:
        _, slot = run_round(ranks, slot)
    assert not any(c.needs_average for c, _ in ranks)
    for c, _ in ranks:
        c.begin_slot(SlotInfo(False, 0, 0.0))
        assert c.end_slot(slot, 1, slot + 1) is None  # no round ends there...
    assert all(c.needs_average for c, _ in ranks)  # ...but the epoch end averages
