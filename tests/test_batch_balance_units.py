"""The parts of ``balance="batch"`` that need no second process: the schedule and balancer (``core/batch_shares.py``),
the loader's batches (``core/share_loader.py``), the step's all-reduce and the wait timer (``dist/batch_weighting.py``,
on a one-rank gloo group), and the strategy's option errors."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from test_averaging import gloo  # noqa: F401 - the one-rank gloo group fixture
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_oscars import OscarsStrategy
from lightning_oscars.core.batch_shares import BatchTimeModel, ShareBalancer, ShareSchedule, solve_shares
from lightning_oscars.core.epoch_order import EpochOrder
from lightning_oscars.core.share_loader import ShareLoader, epoch_batches, resumed_batches, saved_position
from lightning_oscars.dist.batch_weighting import StepSync, WaitTimer, share_weight
from lightning_oscars.lightning._internals import rewind_batch_progress


def test_a_schedule_change_holds_from_its_batch_on_across_epochs():
    schedule = ShareSchedule([16, 16])
    schedule.change((0, 5), [24, 8])
    assert schedule.shares_at((0, 4)) == (16, 16) and schedule.shares_at((0, 5)) == (24, 8)
    assert schedule.shares_at((3, 0)) == (24, 8)
    schedule.change((1, 2), [20, 12])
    assert schedule.shares_at((1, 1)) == (24, 8) and schedule.shares_at((1, 2)) == (20, 12)
    with pytest.raises(ValueError, match="do not split a global batch of 32"):
        schedule.change((2, 0), [20, 20])
    with pytest.raises(ValueError, match="precedes the last one"):
        schedule.change((0, 9), [16, 16])


def test_the_balancer_finds_the_split_of_a_fixed_plus_per_sample_step_and_then_holds_it():
    # Rank 1 is 3x slower at 2 ms + 0.2 ms per sample: the balanced split of 32 is [29, 3] (2 + 5.8 vs 3 * 2.6 ms).
    true = [BatchTimeModel(0.002, 0.0002), BatchTimeModel(0.006, 0.0006)]
    balancer = ShareBalancer(32, 2, warmup_steps=2, min_gain=0.02, smoothing=0.5)
    shares = balancer.initial()
    assert shares == [16, 16]
    changes = 0
    for _ in range(40):
        proposed = balancer.observe(shares, [m.time(n) for m, n in zip(true, shares)], shares)
        if proposed is not None:
            shares, changes = proposed, changes + 1
    assert shares == solve_shares(32, true, floor=2) == [29, 3]
    assert changes <= 3  # it converges, then the hysteresis holds the split


def test_pinned_step_times_split_once_and_caps_bind():
    balancer = ShareBalancer(32, 2, caps=[20, 16], pinned=[1.0, 3.0])
    assert balancer.initial() == [20, 12]  # [24, 8] unconstrained; the fast rank's memory holds 20
    assert balancer.observe([20, 12], [0.1, 0.9], [20, 12]) is None  # pinned: measures change nothing


def test_no_rank_gets_fewer_than_two_samples_while_the_batch_allows():
    assert solve_shares(32, [BatchTimeModel(0.0, 0.001), BatchTimeModel(0.0, 1.0)], floor=2) == [30, 2]
    assert solve_shares(3, [BatchTimeModel(0.0, 0.001), BatchTimeModel(0.0, 1.0)], floor=2) == [2, 1]


@pytest.mark.parametrize(
    ("samples", "drop_last", "expected"),
    [
        (96, False, [(0, 32), (32, 32), (64, 32)]),
        (100, False, [(0, 32), (32, 32), (64, 32), (96, 4)]),
        (97, False, [(0, 32), (32, 32), (64, 33)]),  # a remainder smaller than the world joins the last batch
        (100, True, [(0, 32), (32, 32), (64, 32)]),
    ],
)
def test_an_epochs_global_batches_cover_every_sample_once(samples, drop_last, expected):
    assert epoch_batches(samples, 32, 2, drop_last) == expected


def _loader(rank: int, schedule: ShareSchedule, n: int = 100, workers: int = 0) -> ShareLoader:
    data = TensorDataset(torch.arange(n))
    user = DataLoader(data, batch_size=16, num_workers=workers)
    return ShareLoader(user, rank, 2, EpochOrder("permutation", n, seed=3), schedule)


def test_the_ranks_batches_are_ddps_global_batches_in_ddps_order():
    schedule = ShareSchedule([24, 8])
    loaders = [_loader(r, schedule) for r in (0, 1)]
    for loader in loaders:
        loader.start_epoch(1)
    order = EpochOrder("permutation", 100, seed=3).draw(1)
    for j, batches in enumerate(zip(*loaders)):
        got = sorted(int(i) for batch in batches for i in batch[0])
        assert got == sorted(order[j * 32 : (j + 1) * 32])  # ddp's global batch j: positions [32 j, 32 (j + 1))
    assert [len(b[0]) for b in _loader(0, schedule)] == [24, 24, 24, 2]  # the last 4: two each (BatchNorm's floor)


def test_a_change_takes_effect_past_the_fetched_batches_and_a_resume_starts_at_its_batch():
    schedule = ShareSchedule([16, 16])
    loader = _loader(0, schedule, workers=2)
    assert loader.lag == 2 + 2 * 2  # Lightning's fetcher, and two workers' prefetch of two each
    assert loader.change_key((0, 1), batches_per_step=4) == (0, 8)  # past batch 7, at an optimizer step's start
    loader.start_epoch(0, start_batch=2)
    assert len(list(iter(loader))) == len(loader) - 2


@pytest.mark.parametrize(("old_world", "new_world", "start"), [(2, 1, 2), (2, 3, 1), (3, 2, 2), (2, 2, 3)])
def test_an_epoch_resumed_in_another_world_trains_the_rest_once_in_the_new_worlds_batches(old_world, new_world, start):
    """A checkpoint (or a recovery point) written at batch ``start`` of epoch 1 by ``old_world`` ranks of 16, resumed
    on ``new_world``: the samples before are the old world's, the rest are trained once, in global batches of the new
    world, and the epoch after is laid out whole again."""
    n, order = 100, EpochOrder("permutation", 100, seed=3)

    def loaders(world: int) -> list[ShareLoader]:
        schedule = ShareSchedule([16] * world)
        return [
            ShareLoader(DataLoader(TensorDataset(torch.arange(n)), batch_size=16), r, world, order, schedule)
            for r in range(world)
        ]

    old = loaders(old_world)[0]
    saved = {"world": old_world, "total": 16 * old_world, "resumed": old.resumed}
    position = saved_position(n, False, saved, 1, start)
    assert position == old.position(1, start) == start * 16 * old_world
    resumed = loaders(new_world)
    for loader in resumed:
        loader.start_epoch(1, start_batch=start, position=position)
    assert all(
        len(loader) == len(resumed_batches(n, 16 * new_world, new_world, False, start, position)) for loader in resumed
    )
    rest = [int(i) for batches in zip(*resumed) for batch in batches for i in batch[0]]
    assert sorted(rest) == sorted(order.draw(1)[position:]), "the rest of the epoch, once"
    assert resumed[0].layout(1)[start] == (position, 16 * new_world) or position + 16 * new_world > n
    # The resumed epoch's layout holds a checkpoint taken in it: a second resume finds the same position.
    later = {"world": new_world, "total": 16 * new_world, "resumed": resumed[0].resumed}
    if start + 1 < len(resumed[0]):
        assert saved_position(n, False, later, 1, start + 1) == resumed[0].position(1, start + 1)
    for loader in resumed:
        loader.start_epoch(2)
    assert len(resumed[0]) == len(epoch_batches(n, 16 * new_world, new_world, False))


def test_a_recovery_checkpoint_resumes_at_the_first_batch_of_the_step_not_taken():
    progress = {
        "current": dict.fromkeys(("ready", "started", "processed", "completed"), 7),
        "total": dict.fromkeys(("ready", "started", "processed", "completed"), 27),
        "is_last_batch": True,
    }
    checkpoint = {"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}
    progress["current"]["ready"] = progress["total"]["ready"] = 8  # batch 7 was fetched; its step broke
    rewind_batch_progress(checkpoint, 6)  # the step's first micro-batch
    assert progress["current"] == dict.fromkeys(("ready", "started", "processed", "completed"), 6)
    assert progress["total"] == dict.fromkeys(("ready", "started", "processed", "completed"), 26)
    assert progress["is_last_batch"] is False


def test_share_weights_make_the_mean_over_ranks_the_global_batch_mean():
    shares = [24, 8]
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([5.0, -1.0])]  # each rank's mean gradient over its share
    mean = sum(share_weight(shares, r) * g for r, g in enumerate(grads)) / 2
    assert torch.allclose(mean, (24 * grads[0] + 8 * grads[1]) / 32)


def test_the_step_sync_keeps_unused_parameters_without_a_gradient_and_returns_the_control(gloo):  # noqa: F811
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2), nn.Linear(2, 2))
    frozen = nn.Linear(2, 2)
    model.append(frozen)
    frozen.requires_grad_(False)
    model(torch.randn(4, 3))[:, 0].sum().backward()  # the last Linear is frozen; all trainable ones get gradients
    model[2].weight.grad = None  # as if no rank had used it
    before = model[0].weight.grad.clone()
    sync = StepSync(model, group=gloo)
    assert sync.sync([1.5, 4.0]) == [1.5, 4.0]
    assert model[2].weight.grad is None and torch.equal(model[0].weight.grad, before)
    assert frozen.weight.grad is None


def test_the_wait_timer_times_collectives_of_its_thread_once(gloo):  # noqa: F811
    waits: list[float] = []
    original = dist.all_reduce
    with WaitTimer(waits.append):
        dist.all_reduce(torch.ones(2), group=gloo)
        dist.broadcast_object_list([1], src=0, group=gloo)  # makes broadcasts of its own: counted once
        other = threading.Thread(target=lambda: dist.barrier(group=gloo))
        other.start()
        other.join()
    assert len(waits) == 2 and all(w >= 0 for w in waits)
    assert dist.all_reduce is original  # put back


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"balance": "bytes"}, "balance must be 'steps' or 'batch'"),
        ({"batch_sizes": [16, 8], "deadline_rounds": True}, "batch_sizes cannot be combined with deadline_rounds"),
        ({"batch_sizes": [16, 0]}, "at least 1"),
        ({"balance": "batch", "batch_sizes": [16, 0]}, "at least 1"),
        ({"balance": "batch", "batch_sizes": "largest"}, "a list .* a dict by device name or .auto."),
        ({"balance": "batch", "solver": "alg1"}, "solver='alg1' configures local steps"),
        ({"balance": "batch", "outer_lr": 0.7}, "outer_lr=0.7 configures local steps"),
        ({"balance": "batch", "replica_size": 2}, "replica_size=2 configures local steps"),
    ],
)
def test_bad_balance_options_are_errors_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        OscarsStrategy(**options)
