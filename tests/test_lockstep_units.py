"""The pieces that keep BSP's ranks in step and every paradigm within its bound over a whole round, in one process:
the shard's closing of a round, the loader's closing of its slots (the data handed back), the packed pacer, and the
schedule's spread under a bound. Multi-process behaviour: ``test_lockstep.py``."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_oscars.core.deadline import DeadlinePacer
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan
from lightning_oscars.core.policy import SchedulePolicy
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.shard import Shard
from lightning_oscars.core.staleness import BSP, SSP


def unit(worker: int) -> torch.Tensor:
    """A push that adds 1 to ``worker``'s coordinate (applied as ``delta / 2``)."""
    return torch.eye(2)[worker] * 2


def test_bsp_closes_the_round_for_both_at_the_clock_where_one_takes_no_further_step() -> None:
    shard = Shard(torch.zeros(2), 2, BSP(), now=lambda: 0.0)
    for clock in (1, 2):
        shard.push(0, unit(0), clock, 1.0, more=True)
        shard.push(1, unit(1), clock, 1.0, more=clock < 2)  # worker 1's next slot in the round is a no-op
        for worker in (0, 1):
            assert shard.may_start(worker)
            shard.grant(worker)
        assert shard.closed == [clock == 2, clock == 2], "one's last step is everybody's last step of the round"


def test_bsp_grants_the_clocks_parameters_even_if_a_peer_pushes_again_before_the_worker_collects_them() -> None:
    shard = Shard(torch.zeros(2), 2, BSP(), now=lambda: 0.0)
    shard.push(0, unit(0), 1, 1.0)
    shard.push(1, unit(1), 1, 1.0)
    assert torch.equal(shard.grant(1), torch.ones(2))
    shard.push(1, unit(1), 2, 1.0)  # worker 1 stepped again before worker 0's thread woke up
    assert torch.equal(shard.grant(0), torch.ones(2)), "BSP's clock 2 starts from clock 1's parameters exactly"
    assert not shard.closed[0]


def test_a_peer_that_ended_the_round_bounds_the_other_by_its_steps_and_then_closes_the_round() -> None:
    shard = Shard(torch.zeros(2), 2, SSP(2), now=lambda: 0.0)
    shard.push(1, unit(1), 1, 1.0)
    shard.grant(1)
    shard.end_round(1)  # the slow worker took 1 step and ended its round
    for clock in range(1, 5):
        shard.push(0, unit(0), clock, 1.0)
        assert shard.may_start(0), "a worker held only by one that ended the round is always answered"
        shard.grant(0)
        assert shard.closed[0] == (clock - 1 > 2), f"clock {clock}: within 2 of the other's 1 step, then closed"
    # Open grants only (the leads of the iterations they start): worker 1's, then worker 0's first three.
    assert shard.staleness == [1, 0, 1, 2]


class Indexed(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        return index


def test_a_closed_round_turns_its_fetched_and_later_slots_into_no_ops_and_hands_their_data_back() -> None:
    """Two ranks, 10 units, deadline rounds reserving 3 each: both close the first round after one step (Lightning
    fetched the second slot ahead here), and the epoch still trains every sample exactly once."""
    reserve = (3, 3)
    loaders, plans, iterators = [], [], []
    for rank in (0, 1):
        loader = LoadBalancedLoader(DataLoader(Indexed(), batch_size=4), rank=rank, world_size=2)
        plan = EpochPlan(2, loader.total_units, 8, reserve, reserve)
        loader.start_epoch(plan, 0, None)
        loaders.append(loader)
        plans.append(plan)
        iterators.append(iter(loader))
    assert plans[0].round_at(0).deadline and plans[0].round_at(0).length == 3
    trained: list[list[int]] = [[], []]
    per_round: list[dict[int, int]] = [{}, {}]
    fetched = [[next(it)] for it in iterators]  # a loader fetched one batch ahead (the prefetched path)
    slot = 0
    while slot < plans[0].total_slots:
        for rank, (loader, it) in enumerate(zip(loaders, iterators)):
            if slot + 1 < plans[rank].total_slots:
                fetched[rank].append(next(it))
            batch = fetched[rank].pop(0)
            info = loader.take_slot()
            if info.real:
                trained[rank] += batch.tolist()
                per_round[rank][info.round_slot] = per_round[rank].get(info.round_slot, 0) + 1
            if slot == 0:
                assert loader.continues_round(), "its second slot is fetched, real, of the same round"
                loader.close_round()
                assert not loader.continues_round()
        slot += 1
        rnd = plans[0].round_at(slot - 1)
        if slot == rnd.end_slot and rnd.deadline:  # the round's meeting: settle what each rank trained, re-plan
            steps = (per_round[0].get(rnd.start_slot, 0), per_round[1].get(rnd.start_slot, 0))
            for plan in plans:
                if plan.settle(rnd.start_slot, steps) and slot < plan.total_slots:
                    plan.replan(slot, reserve, reserve=reserve)
    assert per_round[0][0] == per_round[1][0] == 1, "the closed round: one step each"
    assert sorted(trained[0] + trained[1]) == list(range(40)), "every sample once in the epoch"


def test_a_packed_pacer_steps_while_a_step_fits_and_never_after_the_first_no_op() -> None:
    now = [0.0]
    pacer = DeadlinePacer(lambda: now[0], packed=True)
    pacer.start_round(10.0, 1.0)
    decisions = []
    for offset, elapsed in enumerate([0.0, 1.0, 2.0, 9.5, 3.0, 4.0]):  # time runs out at the 4th; then "back"
        now[0] = elapsed
        decisions.append(pacer.is_due(offset, 20, offset, 20, 0))
    assert decisions == [True, True, True, False, False, False]
    spread = DeadlinePacer(lambda: 0.0)
    spread.start_round(3.0, 1.0)
    assert [spread.is_due(k, 6, k, 6, 0) for k in range(4)].count(False) >= 1, "unpacked: steps spread"


def test_a_bound_caps_every_ranks_local_steps_near_the_fewest_and_lockstep_takes_the_busiests() -> None:
    policy = SchedulePolicy(local_steps=(2, 9, 5))
    rounds = RoundController(policy, 3, 0)
    rounds.begin_fit()
    assert rounds.local_steps == (2, 9, 5)
    rounds.step_spread = 3
    assert rounds.local_steps == (2, 5, 5)
    rounds.step_spread = 0  # BSP: everybody waits for everybody at every step; rounds as long as the busiest's
    assert rounds.local_steps == (9, 9, 9)


def test_without_a_batch_fetched_ahead_the_next_slot_is_decided_now_and_the_fetch_follows_it() -> None:
    """Lightning fetches a sized loader's next batch only after the running batch's hooks, where a lockstep scheme
    asks whether this rank steps again in the round: the loader decides that slot then, and fetches what it said.
    A round closed after that decision turns the decided slot into a no-op and hands its unit back."""
    loader = LoadBalancedLoader(DataLoader(Indexed(), batch_size=4), rank=0, world_size=2)
    reserve = (3, 3)
    plan = EpochPlan(2, loader.total_units, 8, reserve, reserve)
    loader.start_epoch(plan, 0, None)
    units = plan.reserved_units(0, plan.round_at(0))
    cursor = lambda: loader._iterator.cursor  # noqa: E731 - the epoch's cursor, made at iter()
    it = iter(loader)
    next(it)
    assert loader.take_slot().real
    assert loader.continues_round(), "nothing fetched ahead: slot 1 is decided now (no pacer: due)"
    assert loader.continues_round(), "asked twice: the same decision, not a second unit"
    assert cursor().taken == 2
    second = next(it)
    assert loader.take_slot().real
    assert second.tolist() == list(range(4 * units[1], 4 * units[1] + 4)), "the fetch trains the unit decided"
    assert loader.continues_round(), "slot 2 holds the round's third reserved unit"
    assert cursor().taken == 3
    loader.close_round()  # a peer takes no further step: the decided slot becomes a no-op, its unit not reached
    third = next(it)
    assert not loader.take_slot().real and third.numel() == 0
    assert cursor().taken == 2, "the unit decided ahead went back to the round: settling hands it to the epoch"
    assert not loader.continues_round(), "past the closed round's reservation nothing is real"
