"""The time-boxed warm-up (``lightning_oscars.core.warmup``): the gate on its own, then two ranks of different speeds
in simulated time through the real round controller, plan and loader, events in time order across ranks."""

from __future__ import annotations

import pytest
import torch
from simulated import SimClock, Time, wired_loader
from torch.utils.data import DataLoader, TensorDataset

from lightning_oscars import RoundController, SchedulePolicy
from lightning_oscars.core.control import ControlData
from lightning_oscars.core.partition import EpochPlan, deadline_round_fits, fitting_reservation
from lightning_oscars.core.warmup import WarmupGate, warmup_reservation


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self.reads = 0

    def __call__(self, delta: int) -> int:
        self.reads += delta == 0
        self.value += delta
        return self.value


def test_the_reservation_leaves_room_for_a_faster_rank_within_the_solver_bounds():
    assert warmup_reservation(4, 16, 8) == 16
    assert warmup_reservation(4, 16, 2) == 8
    assert warmup_reservation(4, 2, 8) == 4, "never fewer than the warm-up itself"
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_reservation(0, 16, 8)


def test_the_gate_trains_the_warmup_then_until_every_other_rank_announced():
    counter = Counter()
    gate = WarmupGate(world_size=3, counter=counter)
    gate.begin(3)
    assert all(gate.is_due(k, 12, taken=k, reserved=12, pending=0) for k in range(3))
    assert counter.reads == 0, "the warm-up's own steps read nothing"
    assert gate.is_due(3, 12, taken=3, reserved=12, pending=1), "nobody else is done"
    counter(1)  # one other rank finished
    assert gate.is_due(4, 12, taken=4, reserved=12, pending=1), "a second other rank is not"
    counter(1)
    # This rank has not announced (its last step may still be running) and counts as done: every other rank is.
    assert not gate.is_due(5, 12, taken=5, reserved=12, pending=1)
    reads = counter.reads
    assert not gate.is_due(6, 12, taken=5, reserved=12, pending=0) and counter.reads == reads, "decided once"
    gate.trained(2)
    assert counter.value == 2, "announces only after its warm-up"
    gate.trained(3)
    gate.trained(4)
    assert counter.value == 3, "announces once"
    short = WarmupGate(2, Counter())
    short.begin(2)
    assert not short.is_due(5, 6, taken=6, reserved=6, pending=0), "the reservation ran out"
    with pytest.raises(ValueError, match="at least one step"):
        short.begin(0)


def test_a_rank_that_cannot_read_the_counter_stops_training_extra_steps():
    def broken(delta: int) -> int:
        raise ConnectionError("the store died with rank 0")

    gate = WarmupGate(2, broken)
    gate.begin(2)
    assert gate.is_due(1, 8, taken=1, reserved=8, pending=0)
    assert not gate.is_due(2, 8, taken=2, reserved=8, pending=0)
    gate.trained(2)  # does not raise


def test_the_plan_lays_out_only_the_first_round_as_the_warmup_and_settles_it():
    plan = EpochPlan(2, 100, 90, (4, 4), warmup_reserve=(16, 16))
    first, second = plan.rounds[:2]
    assert first.warmup and first.deadline and first.length == 16 and first.quotas == (16, 16)
    assert not second.deadline and not second.warmup
    assert plan.settle(0, (12, 4)), "units were handed back"
    assert plan.rounds[0].warmup and plan.rounds[0].quotas == (12, 4)
    restored = EpochPlan.from_state_dict(2, plan.state_dict())
    assert restored.rounds == plan.rounds and restored.order == plan.order
    # An epoch too short for the reservation gets the largest that fits: 14 of 30 units per rank leaves one each.
    assert not deadline_round_fits((16, 16), 30, 30)
    assert fitting_reservation((16, 16), (4, 4), 30, 30) == (14, 14) and deadline_round_fits((14, 14), 30, 30)
    short = EpochPlan(2, 30, 30, (4, 4), warmup_reserve=(16, 16)).rounds[0]
    assert short.warmup and short.deadline and short.quotas == (14, 14)
    # Slots bound it too: if each rank trained only one unit of it, the other 28 need 14 of the 20 slots.
    assert fitting_reservation((16, 16), (4, 4), 30, 20) == (6, 6)
    # One too short for even the warm-up's own steps starts with a plain warm-up.
    assert fitting_reservation((16, 16), (4, 4), 9, 9) is None
    assert not EpochPlan(2, 9, 9, (4, 4), warmup_reserve=(16, 16)).rounds[0].deadline
    with pytest.raises(ValueError, match="warmup_reserve"):
        EpochPlan(2, 100, 90, (4, 4), warmup_reserve=(16,))


def simulate(step_s: tuple[float, float], timed: bool, epochs: int = 1, accumulate: int = 1):
    """Two ranks of ``step_s`` seconds per step (a no-op slot takes 0.5 ms) train ``epochs`` epochs of 480 samples
    in batches of 4, ``accumulate`` batches per step. Each slot is two events in simulated time: its start (Lightning
    fetches the next slot's batch, which decides whether that one is real) and its end (the hooks ran); events of
    both ranks are processed in time order, so what a rank reads from the shared counter is what the others had
    announced by then. Returns the samples trained per epoch, the history and the first round's end."""
    data = DataLoader(TensorDataset(torch.arange(480)), batch_size=4, shuffle=True)
    counter = Counter()
    clocks = [Time(), Time()]
    ranks = []
    for rank in range(2):
        policy = SchedulePolicy(warmup_steps=4, max_local_steps=16)
        gate = WarmupGate(2, counter) if timed else None
        controller = RoundController(policy, 2, rank, warmup_gate=gate, clock=SimClock(clocks[rank]), now=clocks[rank])
        controller.begin_fit()
        ranks.append((controller, wired_loader(controller, data, rank, accumulate)))
    seen: list[list[int]] = []
    first_round_end = None
    for epoch in range(epochs):
        iterators, pending = [], []
        for controller, loader in ranks:
            loader.start_epoch(controller.plan_epoch(epoch, loader.total_units, loader.max_slots), epoch, None)
            iterators.append(iter(loader))
            pending.append(next(iterators[-1]))  # Lightning fetches one batch ahead
        seen.append([])
        batch = [0, 0]
        while batch[0] < ranks[0][0].plan.total_slots * accumulate:
            ends: list[tuple[int | None, int] | None] = [None, None]
            running: list[tuple[float, bool] | None] = [None, None]  # (end time, real) of a started slot
            while None in ends:
                waiting = [r for r in range(2) if ends[r] is None]
                rank = min(waiting, key=lambda r: running[r][0] if running[r] else clocks[r].now)
                controller, loader = ranks[rank]
                if running[rank] is None:  # the slot starts: the next one is fetched (and decided) now
                    (item,) = pending[rank]
                    pending[rank] = next(iterators[rank], None)
                    info = loader.take_slot()
                    controller.begin_slot(info)
                    if info.real:
                        seen[-1] += item.tolist()
                    running[rank] = (clocks[rank].now + (step_s[rank] if info.real else 0.0005), info.real)
                    continue
                clocks[rank].now = running[rank][0]
                running[rank] = None
                epoch_batches = controller.plan.total_slots * accumulate
                end = controller.end_slot(batch[rank], accumulate, epoch_batches)
                batch[rank] += 1
                if end is not None or batch[rank] >= epoch_batches:
                    ends[rank] = (end, batch[rank])
            assert ends[0] == ends[1], "both ranks end the round at the same slot"
            batch = [ends[0][1], ends[0][1]]
            meet = max(c.now for c in clocks) + 0.002
            for c in clocks:
                c.now = meet
            first_round_end = first_round_end if first_round_end is not None else meet
            vectors = [c.contribution(global_step=0).encode(2) for c, _ in ranks]
            summed = ControlData.decode([sum(v) for v in zip(*vectors)], 2)
            outcomes = [c.absorb(summed, allreduce_s=0.002, epoch=epoch, global_step=0, next_slot=ends[0][0])
                        for c, _ in ranks]  # fmt: skip
            assert outcomes[0] == outcomes[1]
    return seen, ranks[0][0].history, first_round_end


@pytest.mark.parametrize("ratio", [1, 3, 5])
def test_faster_ranks_train_while_the_slowest_warms_up(ratio):
    fast, slow = 0.01, 0.01 * ratio
    seen, history, first_end = simulate((fast, slow), timed=True, epochs=2)
    for epoch in seen:
        assert sorted(epoch) == list(range(480)), "every sample exactly once per epoch"
    trained = [s // 4 for s in history[0].samples]
    # The slowest rank takes its warm-up steps; on equal ranks each has fetched its fifth before the other is done.
    assert trained[1] == (5 if ratio == 1 else 4), trained
    # The fast rank keeps going while the slow one warms up, overshooting by at most the step it had fetched and
    # the one it was running when the slow rank announced, and never beyond its reservation (16 slots).
    assert min(4 * ratio - 1, 16) <= trained[0] <= min(4 * ratio + 2, 16), trained
    # The round ends within those two fast steps and the no-op slots after the slow rank's warm-up.
    assert first_end <= 4 * slow + 2 * fast + 16 * 0.0005 + 0.002 + 1e-9
    _, plain, _ = simulate((fast, slow), timed=False)
    assert [s // 4 for s in plain[0].samples] == [4, 4], "without the gate every rank takes exactly 4"


def test_the_timed_warmup_keeps_every_sample_once_with_accumulation():
    seen, history, _ = simulate((0.01, 0.04), timed=True, epochs=2, accumulate=3)
    for epoch in seen:
        assert sorted(epoch) == list(range(480))
    assert history[0].samples[0] > history[0].samples[1] == 4 * 4 * 3


def test_the_controller_tells_the_gate_the_warmup_the_run_can_afford():
    policy = SchedulePolicy(warmup_steps=4, max_local_steps=16, max_spread=8)
    gate = WarmupGate(2, Counter())
    controller = RoundController(policy, 2, 0, warmup_gate=gate)
    controller.begin_fit(max_steps=3)  # a run shorter than the warm-up spends it all on measuring
    plan = controller.plan_epoch(0, 200, 150)
    assert gate.warmup_steps == 3 == policy.warmup
    assert plan.rounds[0].warmup and plan.rounds[0].quotas == (policy.warmup_reservation(),) * 2 == (16, 16)
