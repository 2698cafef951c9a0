"""The user's batching, as written, in-process (``core/loader_shape.py``): a custom ``batch_sampler`` (length
buckets) and a ``batch_size=None`` loader over a ``BatchSampler`` are split between ranks batch by batch, every batch
once per epoch in the order the user's sampler yields it; a library's ``DistributedSampler`` subclass is read as the
global order it shards; options that would resize or split the user's batches are refused by name."""

from __future__ import annotations

import pytest
import torch
from loader_shapes_data import BatchesOfShard, LengthBuckets
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from lightning_oscars.core.epoch_order import EpochOrder
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.loader_shape import global_view, loader_shape
from lightning_oscars.core.partition import EpochPlan, planned_slots

LOCAL_STEPS = (3, 1)


class Rows(Dataset):
    """Item ``i`` is ``i``; indexed by a list (``batch_size=None`` over a BatchSampler) it is that list's rows."""

    def __len__(self) -> int:
        return 45

    def __getitem__(self, index):
        return torch.as_tensor(index)


def _epoch(user: DataLoader, rank: int, epoch: int = 0) -> list[list[int]]:
    """The rows ``rank`` trains in one epoch, batch by batch (the order drawn as rank 0 would and shared)."""
    order = EpochOrder.of_loader(user, seed=None, unwrap=lambda s: s)
    loader = LoadBalancedLoader(user, rank=rank, world_size=2, order=order)
    slots = planned_slots(LOCAL_STEPS, loader.total_units)
    loader.start_epoch(EpochPlan(2, loader.total_units, slots, LOCAL_STEPS), epoch, None)
    trained, iterator = [], iter(loader)
    for _ in range(len(loader)):
        batch = next(iterator)
        if loader.take_slot().real:
            parts = batch if isinstance(batch, tuple) else (batch,)
            trained.append(torch.cat([torch.as_tensor(p).reshape(-1) for p in parts]).tolist())
    loader.close()
    return trained


def _user_batches(user: DataLoader, epoch: int) -> list[list[int]]:
    source = user.batch_sampler if loader_shape(user) == "batch_sampler" else user.sampler
    source = global_view(source)
    for s in (source, getattr(source, "sampler", None)):
        if hasattr(s, "set_epoch"):
            s.set_epoch(epoch)
    return [list(b) for b in source]


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(Rows(), batch_sampler=LengthBuckets(45, 4)),
        lambda: DataLoader(Rows(), batch_size=None, sampler=BatchSampler(RandomSampler(Rows()), 4, False)),
        lambda: DataLoader(Rows(), batch_size=None, sampler=BatchesOfShard(Rows(), 4, num_replicas=2, rank=1)),
    ],
    ids=["length_buckets", "batch_size_none_over_batch_sampler", "distributed_sampler_subclass"],
)
def test_the_users_batches_are_the_unit_every_batch_once_in_the_users_order(make):
    user = make()
    assert loader_shape(user) != "samples"
    for epoch in (0, 1):
        torch.manual_seed(7)  # a RandomSampler draws from the global generator: rank 0's draw is shared
        expected = _user_batches(make(), epoch) if not isinstance(user.sampler, RandomSampler) else None
        ranks = []
        for rank in (0, 1):
            torch.manual_seed(7)
            ranks.append(_epoch(make(), rank, epoch))
        fast, slow = ranks
        assert len(fast) > len(slow) > 0  # split by speed: 3 local steps to 1
        everything = fast + slow
        assert sorted(i for b in everything for i in b) == list(range(45))  # every sample once
        if expected is not None:
            assert sorted(map(tuple, everything)) == sorted(map(tuple, expected))  # the user's batches, whole
            # In the user's order: each rank's batches come in the order the sampler yields them.
            for mine in (fast, slow):
                positions = [expected.index(b) for b in mine]
                assert positions == sorted(positions)


def test_a_distributed_sampler_subclass_is_read_as_the_order_it_shards():
    shard = BatchesOfShard(Rows(), 4, num_replicas=2, rank=1, shuffle=True, seed=3)
    whole = global_view(shard)
    assert whole is not shard and shard.num_replicas == 2 and shard.rank == 1  # the user's sampler is untouched
    rows = [i for b in whole for i in b]
    assert sorted(rows) == list(range(45))  # every rank's share, no padding
    shard.set_epoch(1)
    assert [i for b in global_view(shard) for i in b] != rows  # its own shuffle, per epoch


def test_a_plain_sampler_loader_keeps_its_shape():
    user = DataLoader(Rows(), batch_size=4, sampler=SequentialSampler(Rows()))
    assert loader_shape(user) == "samples"
    assert EpochOrder.of_loader(user, seed=None, unwrap=lambda s: s).kind == "sequential"


@pytest.mark.parametrize("option", ["batch_sizes", "replica_size"])
def test_options_that_would_resize_or_split_the_users_batches_are_refused_by_name(option):
    user = DataLoader(Rows(), batch_sampler=LengthBuckets(45, 4))
    order = EpochOrder.of_loader(user, seed=None, unwrap=lambda s: s)
    kwargs = {"batch_sizes": [4, 4]} if option == "batch_sizes" else {"replica_size": 2}
    with pytest.raises(ValueError, match=f"{option}.*custom batch_sampler"):
        LoadBalancedLoader(user, rank=0, world_size=2, order=order, **kwargs)


class ZipLoader(DataLoader):
    """A loader over two loaders whose own ``__iter__`` zips them (semi-supervised loaders in single-cell tools): each
    batch is one of each, both shuffled from torch's global generator."""

    def __init__(self) -> None:
        self.labelled = DataLoader(Rows(), batch_size=5, shuffle=True)
        self.unlabelled = DataLoader(Rows(), batch_size=5, shuffle=True)
        super().__init__(self.labelled)  # its dataset is a loader

    def __iter__(self):
        return zip(self.labelled, self.unlabelled)

    def __len__(self) -> int:
        return len(self.labelled)


def test_a_loader_with_its_own_iteration_is_driven_alike_on_every_rank():
    user = ZipLoader()
    assert loader_shape(user) == "driven"
    for epoch in (0, 1):
        ranks = []
        for rank in (0, 1):
            torch.manual_seed(100 + rank)  # training's random state differs between the ranks: it must not matter
            ranks.append(_epoch(ZipLoader(), rank, epoch))
        fast, slow = ranks
        assert len(fast) > len(slow) > 0 and len(fast) + len(slow) == 9
        rows = [i for batch in fast + slow for i in batch]
        assert sorted(rows) == sorted(list(range(45)) * 2)  # each loader's every sample once (both halves zipped)
    assert [len(b) for b in _epoch(ZipLoader(), 0, 0)] == [10] * len(fast)  # the user's own batches


class Windows:
    """A library's iterable of ready batches (not a DataLoader): ``per_pass`` batches per pass, each batch a tensor
    of ``[pass, k]`` so that a test can say which pass and batch a rank trained; counts its passes."""

    def __init__(self, per_pass: int) -> None:
        self.per_pass, self.passes = per_pass, 0

    def __len__(self) -> int:
        return self.per_pass

    def __iter__(self):
        self.passes += 1
        return iter([torch.tensor([[self.passes, k]]) for k in range(self.per_pass)])


def test_an_iterable_of_its_own_batches_deals_ddps_budget_each_rank_from_its_own_copy():
    """Two ranks at (3, 1) local steps, 5 batches per pass: the epoch is 10 batches (ddp's: one pass per rank), the
    fast rank drawing 7 or 8 of them from its copy in order (a second pass after the fifth), the slow one the rest;
    the next epoch starts a new pass on each rank."""
    copies = {rank: Windows(5) for rank in (0, 1)}
    trained = {}
    for rank, copy in copies.items():
        loader = LoadBalancedLoader(copy, rank=rank, world_size=2)
        assert loader.shape == "own" and loader.total_units == 10
        slots = planned_slots(LOCAL_STEPS, loader.total_units)
        trained[rank] = []
        for epoch in (0, 1):
            loader.start_epoch(EpochPlan(2, loader.total_units, slots, LOCAL_STEPS), epoch, None)
            batches, iterator = [], iter(loader)
            for _ in range(len(loader)):
                batch = next(iterator)
                if loader.take_slot().real:
                    batches.append(tuple(batch.reshape(-1).tolist()))
            trained[rank].append(batches)
        loader.close()
    for epoch in (0, 1):
        fast, slow = trained[0][epoch], trained[1][epoch]
        assert len(fast) + len(slow) == 10 and len(fast) > 5 > len(slow)
        assert [k for _, k in fast] == [k % 5 for k in range(len(fast))]  # in order, a second pass after the fifth
        assert [k for _, k in slow] == list(range(len(slow)))
    assert trained[0][1][0] == (copies[0].passes - 1, 0)  # epoch 1 began a new pass on the fast rank


def test_an_iterable_of_its_own_batches_without_a_length_is_refused_naming_why():
    with pytest.raises(ValueError, match="when it has a length .* this one has none"):
        LoadBalancedLoader(iter(Windows(5)), rank=0, world_size=2)
    with pytest.raises(ValueError, match="batch_sizes cannot apply .* batches of its own"):
        LoadBalancedLoader(Windows(5), rank=0, world_size=2, batch_sizes=[2, 1])
