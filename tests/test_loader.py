"""LoadBalancedLoader in-process: the user's worker settings reach the inner loaders, and what ranks train on
does not depend on them; a mid-epoch re-plan keeps every sample exactly once."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan, planned_slots

LOCAL_STEPS = (3, 1)


class _WorkerTagged(Dataset):
    """Item ``i`` with the id of the worker process that loaded it (-1 in the main process)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return index, -1 if info is None else info.id


def _epoch(dataset: Dataset, rank: int, **loader_kwargs) -> tuple[list[list[int]], list[bool], set[int]]:
    """One epoch of ``rank``: the sample indices per real slot, which slots were real, the workers seen."""
    user = DataLoader(dataset, batch_size=4, drop_last=True, **loader_kwargs)
    loader = LoadBalancedLoader(user, rank=rank, world_size=2, shuffle=True, seed=3)
    slots = planned_slots(LOCAL_STEPS, loader.total_units)
    loader.start_epoch(EpochPlan(2, loader.total_units, slots, LOCAL_STEPS), 1, None)
    batches, real, workers = [], [], set()
    iterator = iter(loader)
    for _ in range(slots):
        indices, worker = next(iterator)
        info = loader.take_slot()
        real.append(info.real)
        if info.real:
            batches.append(indices.tolist())
            workers.update(worker.tolist())
    # The loader's length is an upper bound (the strategy ends the epoch at the plan's last slot): past the
    # plan every slot is a no-op, then the iterator ends.
    extra = [(next(iterator), loader.take_slot()) for _ in range(len(loader) - slots)]
    assert all(not info.real for _, info in extra) and len(extra) == len(loader) - slots
    with pytest.raises(StopIteration):
        next(iterator)
    loader.close()
    return batches, real, workers


def test_worker_settings_reach_the_inner_loader_and_change_nothing_trained():
    dataset = _WorkerTagged()
    for rank in (0, 1):
        plain, plain_real, plain_workers = _epoch(dataset, rank)
        workers, workers_real, seen = _epoch(dataset, rank, num_workers=2, persistent_workers=True, prefetch_factor=2)
        assert plain_workers == {-1}
        assert seen and seen <= {0, 1}, "batches must be loaded in worker processes"
        assert workers == plain and workers_real == plain_real


def test_ranks_share_the_epoch_exactly_once_in_speed_proportion():
    fast, fast_real, _ = _epoch(_WorkerTagged(), 0)
    slow, slow_real, _ = _epoch(_WorkerTagged(), 1)
    assert len(fast_real) == len(slow_real), "every rank iterates the same number of slots"
    seen = sorted(i for batch in fast + slow for i in batch)
    assert seen == list(range(40)), "every sample exactly once per epoch"
    assert len(fast) >= 2 * len(slow) > 0, (len(fast), len(slow))  # 3:1 local steps, last round partial


def test_mid_epoch_replan_keeps_every_sample_once():
    dataset = _WorkerTagged()
    seen: list[int] = []
    for rank in (0, 1):
        user = DataLoader(dataset, batch_size=4, drop_last=True)
        loader = LoadBalancedLoader(user, rank=rank, world_size=2, shuffle=True, seed=3)
        plan = EpochPlan(2, loader.total_units, planned_slots(LOCAL_STEPS, loader.total_units), LOCAL_STEPS)
        loader.start_epoch(plan, 0, None)
        iterator = iter(loader)
        for slot in range(plan.total_slots):
            if slot == 3:  # the second round starts: speeds swapped
                plan.replan(3, (1, 3))
            indices, _ = next(iterator)
            if loader.take_slot().real:
                seen.extend(indices.tolist())
    assert sorted(seen) == list(range(40))


class _Pid(Dataset):
    """Item ``i`` with the id of the process that loaded it."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[int, int]:
        import os

        return index, os.getpid()


def test_persistent_workers_survive_replans_and_epochs_and_their_start_up_is_not_timed():
    user = DataLoader(_Pid(), batch_size=4, drop_last=True, num_workers=1, persistent_workers=True)
    loader = LoadBalancedLoader(user, rank=0, world_size=2, shuffle=True, seed=3)
    pids: set[int] = set()
    fetch_times = []
    for epoch in range(2):
        plan = EpochPlan(2, loader.total_units, planned_slots(LOCAL_STEPS, loader.total_units), LOCAL_STEPS)
        loader.start_epoch(plan, epoch, None)
        iterator = iter(loader)
        for slot in range(plan.total_slots):
            if slot == 3:
                plan.replan(3, (2, 2))  # restarts the inner iterator mid-epoch
            _, pid = next(iterator)
            info = loader.take_slot()
            if info.real:
                pids.update(pid.tolist())
                fetch_times.append(info.fetch_seconds)
    loader.close()
    assert len(pids) == 1, "one persistent worker process for the whole fit"
    # The first batch after each (re)start of the workers' stream is not a step's data loading.
    assert fetch_times.count(None) == 4 and all(t is None or t >= 0.0 for t in fetch_times)


def test_noop_slots_yield_empty_batches_of_the_same_structure():
    user = DataLoader(_WorkerTagged(), batch_size=4, drop_last=True)
    loader = LoadBalancedLoader(user, rank=1, world_size=2, shuffle=False)
    plan = EpochPlan(2, loader.total_units, planned_slots(LOCAL_STEPS, loader.total_units), LOCAL_STEPS)
    loader.start_epoch(plan, 0, None)
    iterator = iter(loader)
    items = [(next(iterator), loader.take_slot()) for _ in range(3)]
    (real, real_info), (noop, noop_info) = items[0], items[1]
    assert real_info.real and real[0].shape == (4,)
    assert not noop_info.real and noop_info.samples == 0
    assert [t.shape for t in noop] == [(0,), (0,)] and noop[0].dtype == real[0].dtype


def test_accumulation_change_resizes_units():
    user = DataLoader(_WorkerTagged(), batch_size=4)  # 10 batches
    loader = LoadBalancedLoader(user, rank=0, world_size=2, shuffle=False, batches_per_slot=1)
    assert loader.total_units == 10
    loader.set_batches_per_slot(4)
    assert (loader.total_units, len(loader)) == (3, 12)
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        loader.set_batches_per_slot(16)


@pytest.mark.parametrize("persistent", [False, True])
def test_close_lets_the_workers_exit_at_once(persistent: bool):
    import multiprocessing

    user = DataLoader(_WorkerTagged(), batch_size=4, drop_last=True, num_workers=2, persistent_workers=persistent)
    loader = LoadBalancedLoader(user, rank=0, world_size=2, shuffle=True, seed=3)
    slots = planned_slots(LOCAL_STEPS, loader.total_units)
    loader.start_epoch(EpochPlan(2, loader.total_units, slots, LOCAL_STEPS), 1, None)
    before = set(multiprocessing.active_children())
    iterator = iter(loader)
    for _ in range(3):  # an epoch left part-way, as a stop or max_steps leaves it
        next(iterator)
        loader.take_slot()
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2, "the inner loader's workers are running"
    del iterator
    loader.close()
    assert not any(w.is_alive() for w in workers), "closed: no worker left for a garbage collection to wait on"
    again = iter(loader)  # and it still serves an epoch
    assert next(again) is not None and loader.take_slot().real
