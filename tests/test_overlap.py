"""Averaging overlapped with the next round: the late correction's arithmetic over simulated ranks, and the scheme
around the collectives on a one-rank gloo group (2-rank fits are in test_multiprocess.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import meeting
from torch import Tensor, nn

from lightning_oscars import OscarsStrategy
from lightning_oscars.dist.averaging import FlatAverager, averaged_tensors
from lightning_oscars.dist.overlap import LateAverage, OverlappedAveraging

CPU = torch.device("cpu")


def _rank_tensors(scale: float, count: int, flag: bool) -> list[Tensor]:
    return [
        torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t() * scale,  # strided
        torch.tensor(5.0, dtype=torch.bfloat16) * scale,  # 0-dim, low precision
        torch.tensor([count, 2**40 + count], dtype=torch.int64),  # a counter beyond float32's exact integers
        torch.tensor([flag]),
    ]


def _post_and_sum(lates: list[LateAverage], weights: list[float]) -> None:
    """What post() and apply()'s collective do across ranks: pack every rank, sum the buffers into each."""
    for late, weight in zip(lates, weights):
        late.pack(weight)
    total = torch.stack([late.averager.buffer for late in lates]).sum(dim=0)
    for late in lates:
        late.averager.buffer.copy_(total)


def test_a_late_average_is_the_posted_mean_plus_the_progress_made_since():
    ranks = [_rank_tensors(1.0, 10, True), _rank_tensors(3.0, 13, False), _rank_tensors(2.0, 20, True)]
    weights = [1.0, 2.0, 1.0]
    lates = [LateAverage(tensors, CPU) for tensors in ranks]
    _post_and_sum(lates, weights)
    with torch.no_grad():  # a round of local steps on every rank after it posted
        for r, tensors in enumerate(ranks):
            tensors[0].add_(0.5 * (r + 1))
            tensors[1].add_(1.0)
            tensors[2].add_(r + 1)
            tensors[3].fill_(False)
    for late in lates:
        late.correct()
    mean_matrix = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t() * (1.0 + 6.0 + 2.0) / 4.0  # weighted: scales 1, 3, 2
    for r, tensors in enumerate(ranks):
        assert torch.equal(tensors[0], mean_matrix + 0.5 * (r + 1))  # the mean, plus this rank's own steps
        assert tensors[1].dtype == torch.bfloat16 and tensors[1].item() == pytest.approx(
            5.0 * 9.0 / 4.0 + 1.0, rel=1e-2
        )
        # integers: the unweighted mean rounded half up (43 / 3 -> 14), exact beyond 2**24, plus the progress
        assert tensors[2].tolist() == [14 + r + 1, 2**40 + 14 + r + 1]
        assert tensors[3].tolist() == [True]  # bools take the majority of what was sent, not the local flip


def test_with_no_progress_a_late_average_lands_exactly_where_averaging_at_once_does():
    late_ranks = [_rank_tensors(1.0, 3, True), _rank_tensors(4.0, 8, False)]
    now_ranks = [[t.clone() for t in tensors] for tensors in late_ranks]
    lates = [LateAverage(tensors, CPU) for tensors in late_ranks]
    _post_and_sum(lates, [1.0, 1.0])
    for late in lates:
        late.correct()
    averagers = [FlatAverager(tensors, 1, CPU) for tensors in now_ranks]
    for averager in averagers:
        averager.pack(1.0, [1.0])
    total = torch.stack([a.buffer for a in averagers]).sum(dim=0)
    for averager in averagers:
        averager.buffer.copy_(total)
        averager.unpack_summed(0)
    for late_tensors, now_tensors in zip(late_ranks, now_ranks):
        for a, b in zip(late_tensors, now_tensors):
            assert torch.equal(a, b)


def test_the_scheme_posts_at_a_round_end_and_applies_at_the_next_call(one_rank_group):
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    scheme = OverlappedAveraging()
    scheme.bind(model.parameters())
    tensors = averaged_tensors(model)
    assert scheme.settled
    first = meeting([2.0, 7.0])
    scheme.combine_late(tensors, first)
    assert first._summed == [2.0, 7.0]  # the control data, summed at once (one rank), before the models are posted
    assert not scheme.settled and scheme.applied_late == 0
    posted = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the next round's progress, while the average is in flight
    scheme.combine_late(tensors, meeting([2.0, 7.0]))  # applies the first (one rank: mean == sent), posts again
    assert scheme.applied_late == 1 and not scheme.settled
    assert torch.equal(model[0].weight, posted + 1.0)
    scheme.combine(tensors, meeting([1.0, 0.0]))  # validation: applied, then averaged at once
    assert scheme.settled and scheme.applied_late == 2
    scheme.combine_late(tensors, meeting([1.0, 0.0]))
    scheme.release()  # a failed fit: dropped without waiting
    assert scheme.settled


def test_overlap_is_an_option_of_the_strategy_and_refuses_the_outer_step():
    assert isinstance(OscarsStrategy(overlap_averaging=True).make_scheme(), OverlappedAveraging)
    assert not isinstance(OscarsStrategy().make_scheme(), OverlappedAveraging)
    with pytest.raises(ValueError, match="overlap_averaging cannot be combined with outer_lr"):
        OscarsStrategy(overlap_averaging=True, outer_lr=0.7)
    with pytest.raises(ValueError, match="overlap_averaging must be True or False"):
        OscarsStrategy(overlap_averaging="yes")  # type: ignore[arg-type]
