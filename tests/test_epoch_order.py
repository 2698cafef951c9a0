"""EpochOrder: the epoch's sample order follows the user's sampler (and seed_everything), and what cannot be
honoured is refused with an error that says what to do."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import RandomSampler, SequentialSampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_oscars.core.loader import EpochOrder
from lightning_oscars.core.loader_shape import global_view
from lightning_oscars.lightning._internals import unwrap_sampler

DATA = list(range(50))


def test_sequential_and_random_samplers():
    assert EpochOrder.of(SequentialSampler(DATA), 50, None).draw(0) == DATA
    order = EpochOrder.of(RandomSampler(DATA), 50, 7)
    assert order.kind == "permutation" and not order.shared
    assert sorted(order.draw(0)) == DATA and order.draw(0) != order.draw(1)
    assert order.draw(3) == EpochOrder.of(RandomSampler(DATA), 50, 7).draw(3), "identical on every rank"


def test_shuffle_follows_seed_everything_unless_the_strategy_pins_one(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    a = EpochOrder.of(RandomSampler(DATA), 50, None)
    monkeypatch.setenv("PL_GLOBAL_SEED", "12")
    b = EpochOrder.of(RandomSampler(DATA), 50, None)
    assert (a.seed, b.seed) == (11, 12) and a.draw(0) != b.draw(0)
    assert EpochOrder.of(RandomSampler(DATA), 50, 3).seed == 3
    # Lightning's injected DistributedSampler carries seed_everything's seed.
    injected = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=5)
    assert EpochOrder.of(injected, 50, None).seed == 5
    assert EpochOrder.of(DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=False), 50, None).kind == "sequential"


def test_a_custom_sampler_is_drawn_and_shared():
    weights = torch.ones(50)
    weights[0] = 1000.0
    user = WeightedRandomSampler(weights, num_samples=30, replacement=True)
    wrapped = DistributedSamplerWrapper(user, num_replicas=2, rank=1)  # what Lightning injects around it
    order = EpochOrder.of(unwrap_sampler(wrapped), 50, None)  # the session unwraps it (_internals)
    assert order.kind == "sampler" and order.shared and order.num_samples == 30
    drawn = order.draw(0)
    assert len(drawn) == 30 and drawn.count(0) > 15


def test_a_distributed_sampler_subclass_is_drawn_as_the_global_order_it_shards():
    class MyDistributed(DistributedSampler):
        pass

    order = EpochOrder.of(global_view(MyDistributed(DATA, num_replicas=2, rank=0)), 50, None)
    assert order.kind == "sampler" and order.shared and sorted(order.draw(0)) == list(range(50))


def test_what_cannot_be_honoured_is_refused():
    class Endless(torch.utils.data.Sampler):
        def __iter__(self):
            while True:
                yield 0

    with pytest.raises(ValueError, match="has no length"):
        EpochOrder.of(Endless(), 50, None)

    class Liar(torch.utils.data.Sampler):
        def __len__(self):
            return 10

        def __iter__(self):
            return iter(range(5))

    with pytest.raises(ValueError, match="yielded 5 indices"):
        EpochOrder.of(Liar(), 50, None).draw(0)
