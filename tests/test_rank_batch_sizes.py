"""Per-rank batch sizes under local steps, in the core: the plan's widths (a rank's step trains several units), the
quotas counted in units, and the loader fetching a rank's own batch size from blocks, with every sample once."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan, planned_slots
from lightning_oscars.core.quotas import block_widths, steps_of, unit_quotas
from lightning_oscars.core.replicas import ReplicaLayout, replica_batch_sizes


def _trained(plan: EpochPlan, widths: tuple[int, ...]) -> list[int]:
    """Every unit the plan gives out, checking each step holds 1..width units."""
    units: list[int] = []
    for rank, width in enumerate(widths):
        for slot in range(plan.total_slots):
            step = plan.units_at(rank, slot)
            if step is not None:
                assert 1 <= len(step) <= width
                units += step
    return sorted(units)


@pytest.mark.parametrize("seed", range(3))
def test_every_unit_is_trained_once_with_widths_across_replans_validations_and_a_restore(seed):
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(2, 4)
        widths = tuple(rng.randint(1, 4) for _ in range(n))
        steps = tuple(rng.randint(1, 8) for _ in range(n))
        units = rng.randint(sum(widths), 300)
        slots = planned_slots(steps, units, widths)
        boundaries = (lambda total: (total // 3, 2 * total // 3)) if rng.random() < 0.5 else None
        plan = EpochPlan(n, units, slots, steps, boundaries=boundaries, widths=widths)
        assert _trained(plan, widths) == list(range(units))
        if boundaries is None:
            assert not plan.rounds[-1].is_empty  # the epoch is sized to what the rounds need, no idle tail
        if len(plan.rounds) > 2:
            plan.replan(plan.rounds[1].start_slot, tuple(rng.randint(1, 8) for _ in range(n)), max_slots=4 * slots)
            assert _trained(plan, widths) == list(range(units))
        restored = EpochPlan.from_state_dict(n, plan.state_dict())
        assert [restored.units_at(n - 1, s) for s in range(restored.total_slots)] == [
            plan.units_at(n - 1, s) for s in range(plan.total_slots)
        ]


def test_a_full_round_gives_each_rank_its_local_steps_of_its_own_width():
    plan = EpochPlan(2, 100, planned_slots((3, 5), 100, (2, 1)), (3, 5), widths=(2, 1))
    first = plan.rounds[0]
    assert first.quotas == (6, 5) and first.length == 5
    assert [len(s) for s in first.step_units(0)] == [2, 2, 2] and [len(s) for s in first.step_units(1)] == [1] * 5
    # A rank's first step does not depend on the quotas: the first round's first units, in rank order.
    assert first.step_units(0)[0] == [0, 1] and first.step_units(1)[0] == [2]


def test_unit_quotas_split_the_epochs_tail_in_proportion_to_steps_times_width():
    assert unit_quotas((4, 2), (1, 3), 100, 50) == [4, 6]  # a full round
    tail = unit_quotas((4, 2), (1, 3), 7, 3)
    assert sum(tail) == 7 and max(steps_of(q, w) for q, w in zip(tail, (1, 3))) <= 3
    assert unit_quotas((3, 1), None, 100, 200) == [3, 1]  # no widths: round_quotas itself


def test_block_widths_are_the_batch_sizes_in_their_common_block():
    assert block_widths([64, 32]) == (32, (2, 1))
    assert block_widths([48, 32, 16]) == (16, (3, 2, 1))
    assert block_widths([33, 32]) == (1, (33, 32))
    with pytest.raises(ValueError, match="positive integers"):
        block_widths([16, 0])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_loader_fetches_each_ranks_own_batch_size_and_every_sample_once(accumulate):
    data = TensorDataset(torch.arange(203))  # not a multiple of the block: the last block is short
    sizes, steps = [24, 16], (2, 3)
    seen: list[int] = []
    lengths: dict[int, list[int]] = {0: [], 1: []}
    for rank in (0, 1):
        loader = LoadBalancedLoader(
            DataLoader(data, batch_size=8),
            rank,
            2,
            shuffle=True,
            seed=1,
            batches_per_slot=accumulate,
            batch_sizes=sizes,
        )
        assert loader.batch_size == 8 and loader.widths == (3, 2)
        plan = EpochPlan(
            2, loader.total_units, planned_slots(steps, loader.total_units, loader.widths), steps, widths=loader.widths
        )
        loader.start_epoch(plan, 0, None)
        iterator = iter(loader)
        for _ in range(plan.total_slots * accumulate):
            (batch,) = next(iterator)
            if loader.take_slot().real:
                seen += batch.tolist()
                lengths[rank].append(len(batch))
    assert sorted(seen) == list(range(203))
    for rank, size in enumerate(sizes):
        assert max(lengths[rank]) == size and sum(n != size for n in lengths[rank]) <= 2 * accumulate


def test_replicas_take_one_batch_size_each_and_their_ranks_must_agree():
    layout = ReplicaLayout(4, 2)
    assert replica_batch_sizes([32, 32, 16, 16], layout) == [32, 16]
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] of one replica the sizes \[16, 8\]"):
        replica_batch_sizes([32, 32, 16, 8], layout)


def test_a_replicas_ranks_each_train_the_replicas_batch_size_and_every_sample_once():
    data = TensorDataset(torch.arange(300))
    layout, sizes, steps = ReplicaLayout(4, 2), [24, 8], (2, 3)  # per rank: replica 0 on 24, replica 1 on 8
    seen: list[int] = []
    lengths: dict[int, list[int]] = {rank: [] for rank in range(4)}
    for rank in range(4):
        loader = LoadBalancedLoader(
            DataLoader(data, batch_size=4),
            layout.replica_of(rank),
            layout.replicas,
            shuffle=True,
            seed=2,
            replica_size=2,
            member=layout.member_of(rank),
            batch_sizes=sizes,
        )
        assert loader.batch_size == 8 and loader.widths == (3, 1)
        total = loader.total_units
        plan = EpochPlan(2, total, planned_slots(steps, total, loader.widths), steps, widths=loader.widths)
        loader.start_epoch(plan, 0, None)
        iterator = iter(loader)
        for _ in range(plan.total_slots):
            (batch,) = next(iterator)
            if loader.take_slot().real:
                seen += batch.tolist()
                lengths[rank].append(len(batch))
    assert sorted(seen) == list(range(300))
    assert lengths[0] == lengths[1] and lengths[2] == lengths[3], "a replica's ranks step together on equal parts"
    for rank, size in enumerate([24, 24, 8, 8]):
        assert max(lengths[rank]) == size and sum(n != size for n in lengths[rank]) <= 2
