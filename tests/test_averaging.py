"""The flat averager in one process: N ranks are simulated by summing the packed buffers of N averagers with
identical layouts (exactly what the SUM all-reduce does); the real collective runs on a one-rank gloo group."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_oscars.dist.averaging import (
    DIGITS,
    FlatAverager,
    add_flat,
    agree_on_layout,
    averaged_tensors,
    decode_integer_mean,
    encode_integers,
    flat_copy,
    layout_agreement,
    load_flat,
    optimizer_state_layout,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EXTREMES = [INT64_MIN, INT64_MIN + 1, -(2**53) - 1, -123456789012345, -1, 0, 1, 2**24 + 1, 123456789, INT64_MAX]
CPU = torch.device("cpu")


@pytest.fixture
def gloo(tmp_path) -> Iterator[dist.ProcessGroup | None]:
    """A one-rank gloo group: the default one, or a subgroup when an earlier test left a default group behind."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-rank default process group is already initialized")
        group = dist.new_group(backend="gloo")
        assert isinstance(group, dist.ProcessGroup)
        try:
            yield group
        finally:
            dist.destroy_process_group(group)
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def simulate(
    ranks: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    controls: Sequence[Sequence[float]] | None = None,
    weight_index: int = 0,
) -> list[list[float]]:
    """One round over len(ranks) simulated ranks; each rank's control defaults to [its weight]."""
    if controls is None:
        controls = [[w] for w in weights]
    averagers = [FlatAverager(tensors, len(controls[0]), CPU) for tensors in ranks]
    for averager, weight, control in zip(averagers, weights, controls):
        averager.pack(weight, control)
    total = torch.stack([a.buffer for a in averagers]).sum(dim=0)
    results = []
    for averager in averagers:
        averager.buffer.copy_(total)
        results.append(averager.unpack_summed(weight_index))
    return results


def mean_half_up(values: Sequence[int]) -> int:
    return (2 * sum(values) + len(values)) // (2 * len(values))


# --- exact integers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_int64_extremes_survive_bit_exact(dtype):
    ranks = [[torch.tensor(EXTREMES, dtype=torch.int64), torch.ones(2, dtype=dtype)] for _ in range(3)]
    simulate(ranks, weights=[1.0, 2.0, 5.0])
    for tensors in ranks:
        assert tensors[0].dtype == torch.int64
        assert tensors[0].tolist() == EXTREMES


def test_large_integer_buffer_round_trips_through_the_real_all_reduce(gloo):
    counter = torch.tensor([16777217, 123456789], dtype=torch.int64)
    weights = torch.tensor([0.5, -2.0])
    averager = FlatAverager([weights, counter], control_size=3, device=CPU)
    summed = averager.all_reduce(4.0, [4.0, 7.5, -1.0], weight_index=0, group=gloo)
    assert summed == [4.0, 7.5, -1.0]
    assert counter.tolist() == [16777217, 123456789]
    assert weights.tolist() == [0.5, -2.0]


def test_unequal_integers_give_the_rounded_mean_ties_up():
    columns = [[1, 2], [-1, -2], [-5, 0], [3, 4], [-3, 4], [INT64_MIN, INT64_MAX], [INT64_MAX, INT64_MAX - 1], [7, 8]]
    ranks = [[torch.tensor([col[r] for col in columns], dtype=torch.int64)] for r in range(2)]
    simulate(ranks, weights=[1.0, 1.0])
    expected = [2, -1, -2, 4, 1, 0, INT64_MAX, 8]
    assert expected == [mean_half_up(col) for col in columns]
    for tensors in ranks:
        assert tensors[0].tolist() == expected


def test_odd_rank_count_rounds_to_nearest():
    values = [[-3, 0, 0], [1, 1, 0], [INT64_MIN, INT64_MIN, INT64_MIN + 2], [5, -4, 0]]
    ranks = [[torch.tensor([v[r] for v in values])] for r in range(3)]
    simulate(ranks, weights=[1.0, 1.0, 1.0])
    assert ranks[0][0].tolist() == [-1, 1, INT64_MIN + 1, 0]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_every_integer_dtype_is_kept(dtype):
    info = torch.iinfo(dtype)
    ranks = [[torch.tensor([info.min, info.max, 3], dtype=dtype)] for _ in range(2)]
    ranks[1][0][2] = 6
    simulate(ranks, weights=[1.0, 1.0])
    assert ranks[0][0].dtype == dtype
    assert ranks[0][0].tolist() == [info.min, info.max, 5]


def test_bool_tensors_take_the_majority_and_keep_their_dtype():
    votes = [[True, False, True, False], [True, False, False, True], [True, True, False, False]]
    ranks = [[torch.tensor(v)] for v in votes]
    simulate(ranks, weights=[1.0, 1.0, 1.0])
    for tensors in ranks:
        assert tensors[0].dtype == torch.bool
        assert tensors[0].tolist() == [True, False, False, False]
    tie = [[torch.tensor([True])], [torch.tensor([False])]]
    simulate(tie, weights=[1.0, 1.0])
    assert tie[0][0].item() is True  # ties go up


def test_integer_mean_ignores_float_weights():
    ranks = [[torch.tensor([2.0]), torch.tensor([10])], [torch.tensor([6.0]), torch.tensor([20])]]
    simulate(ranks, weights=[1.0, 3.0])
    for floats, ints in ranks:
        assert floats.item() == pytest.approx((1.0 * 2.0 + 3.0 * 6.0) / 4.0)
        assert ints.item() == 15


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=5), min_size=1, max_size=6))
def test_digit_sums_decode_to_the_exact_rounded_mean(per_rank):
    width = min(len(row) for row in per_rank)
    rows = [row[:width] for row in per_rank]
    digit_sums = sum(encode_integers(torch.tensor(row, dtype=torch.int64)).to(torch.float32) for row in rows)
    assert isinstance(digit_sums, Tensor)
    decoded = decode_integer_mean(digit_sums, len(rows))
    assert decoded.tolist() == [mean_half_up([row[i] for row in rows]) for i in range(width)]


def test_encoding_is_biased_base_256_most_significant_first():
    digits = encode_integers(torch.tensor([INT64_MIN, -1, 0, 258]))
    assert digits.shape == (4, DIGITS)
    assert digits.tolist() == [
        [0] * 8,
        [127] + [255] * 7,
        [128] + [0] * 7,
        [128, 0, 0, 0, 0, 0, 1, 2],
    ]


def test_too_many_ranks_for_a_float32_buffer_is_refused():
    averager = FlatAverager([torch.tensor([1])], control_size=0, device=CPU)
    averager.pack(1.0, [])
    averager.buffer[-1] = 70000.0
    with pytest.raises(ValueError, match="70000 ranks"):
        averager.unpack_summed(0)


# --- floats, control, shapes ---------------------------------------------------------------------------------


def test_floats_get_the_weighted_mean_and_control_is_summed_without_the_count_slot():
    ranks = [[torch.tensor([1.0, 2.0]), torch.tensor(4.0, dtype=torch.float64)] for _ in range(2)]
    ranks[1][0].copy_(torch.tensor([5.0, 10.0]))
    ranks[1][1].fill_(8.0)
    results = simulate(ranks, weights=[1.0, 3.0], controls=[[9.0, 1.0, 0.5], [9.0, 3.0, 0.25]], weight_index=1)
    assert results == [[18.0, 4.0, 0.75]] * 2
    for first, second in ranks:
        assert first.tolist() == pytest.approx([4.0, 8.0])
        assert second.dtype == torch.float64
        assert second.item() == pytest.approx(7.0)


def test_float64_forces_a_float64_buffer():
    assert FlatAverager([torch.zeros(2), torch.zeros(1)], 1, CPU).buffer.dtype == torch.float32
    assert FlatAverager([torch.zeros(2), torch.zeros(1, dtype=torch.float64)], 1, CPU).buffer.dtype == torch.float64


def test_buffer_layout_floats_then_digits_then_control_then_count():
    averager = FlatAverager([torch.tensor([3]), torch.tensor([1.5, 2.5])], control_size=2, device=CPU)
    averager.pack(2.0, [7.0, 8.0])
    assert averager.buffer.tolist() == [3.0, 5.0, 128, 0, 0, 0, 0, 0, 0, 3, 7.0, 8.0, 1.0]
    assert averager.control.tolist() == [7.0, 8.0]


def test_non_contiguous_and_zero_dim_tensors_pack_and_unpack():
    base = [torch.arange(12.0).reshape(3, 4), torch.arange(12.0).reshape(3, 4) * 3]
    views = [b.t()[1:] for b in base]  # strided, non-contiguous
    scalars = [torch.tensor(1.0), torch.tensor(3.0)]
    ints = [torch.arange(6).reshape(2, 3).t(), torch.arange(6).reshape(2, 3).t() * 3]
    counters = [torch.tensor(5), torch.tensor(8)]
    assert not views[0].is_contiguous() and not ints[0].is_contiguous()
    expected_view = ((base[0] + base[1]) / 2).t()[1:].clone()
    expected_ints = (torch.arange(6).reshape(2, 3).t() * 2).clone()
    simulate([[views[r], scalars[r], ints[r], counters[r]] for r in range(2)], weights=[1.0, 1.0])
    for r in range(2):
        assert torch.equal(views[r], expected_view)
        assert scalars[r].shape == () and scalars[r].item() == 2.0
        assert torch.equal(ints[r], expected_ints)
        assert counters[r].shape == () and counters[r].item() == 7  # 6.5 rounds up
    assert torch.equal(base[0][:, 0], torch.tensor([0.0, 4.0, 8.0]))  # column outside the view untouched


def test_non_positive_total_weight_is_refused():
    averager = FlatAverager([torch.zeros(1)], control_size=1, device=CPU)
    averager.pack(0.0, [0.0])
    with pytest.raises(ValueError, match="total weight"):
        averager.unpack_summed(0)


def test_no_tensors_still_sums_the_control_data():
    """A buffer-less model under a parameter server hands the averager no tensor: the round's control data must
    still be summed (it carries the samples, the stop requests and the hand-back of data)."""
    results = simulate([[], [], []], weights=[1.0, 2.0, 3.0], controls=[[1.0, 5.0], [2.0, 0.0], [3.0, -1.0]])
    assert results == [[6.0, 4.0]] * 3


def test_empty_control_data_round_trips_through_the_real_all_reduce(gloo):
    averager = FlatAverager([], control_size=2, device=CPU)
    assert averager.all_reduce(2.0, [2.0, 9.0], weight_index=0, group=gloo) == [2.0, 9.0]


def test_bad_construction_and_control_length_raise():
    with pytest.raises(ValueError, match="nothing to average"):
        FlatAverager([], 0, CPU)
    with pytest.raises(TypeError, match="complex"):
        FlatAverager([torch.zeros(1, dtype=torch.complex64)], 1, CPU)
    with pytest.raises(ValueError, match="control has 2 entries"):
        FlatAverager([torch.zeros(1)], 1, CPU).pack(1.0, [1.0, 2.0])


def test_holds_compares_identity_not_values():
    tensors = [torch.ones(3), torch.zeros(2)]
    averager = FlatAverager(tensors, 1, CPU)
    assert averager.holds(list(tensors))
    assert not averager.holds([tensors[0], tensors[1].clone()])  # an LBFGS-style replaced state tensor
    assert not averager.holds(tensors[:1])
    assert not averager.holds([*tensors, torch.ones(1)])


# --- what is averaged ----------------------------------------------------------------------------------------


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_frozen_parameters_are_excluded_but_buffers_kept():
    net = _net()
    for param in net[0].parameters():
        param.requires_grad_(False)
    ids = [id(t) for t in averaged_tensors(net)]
    expected = [net[1].weight, net[1].bias, net[2].weight, net[2].bias, *net.buffers()]
    assert ids == [id(t) for t in expected]
    assert id(net[1].num_batches_tracked) in ids


def test_extra_modules_params_and_buffers_follow_the_module_in_order():
    net = _net()
    ema = copy.deepcopy(net).requires_grad_(False)
    swa = torch.optim.swa_utils.AveragedModel(net)
    tensors = averaged_tensors(net, extra_modules=[ema, swa])
    own = [*net.parameters(), *net.buffers()]
    extra = [*ema.parameters(), *ema.buffers(), *swa.parameters(), *swa.buffers()]
    assert [id(t) for t in tensors] == [id(t) for t in own + extra]
    assert any(t is swa.n_averaged for t in tensors)


def test_a_tensor_reachable_twice_is_averaged_once():
    net = _net()
    tensors = averaged_tensors(net, extra_modules=[net[1]])
    assert len({id(t) for t in tensors}) == len(tensors) == len([*net.parameters(), *net.buffers()])


def _sgd_after_step(net: nn.Module, skip: nn.Module | None) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(5, 3)).sum().backward()
    if skip is not None:
        for param in skip.parameters():
            param.grad = None  # no gradient on this rank, hence no momentum buffer
    optimizer.step()
    return optimizer


def test_optimizer_state_layout_counts_averaged_state_per_parameter():
    net = _net()
    assert optimizer_state_layout([torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)]) == [0] * 6
    sgd = _sgd_after_step(net, skip=net[2])
    assert optimizer_state_layout([sgd]) == [1, 1, 1, 1, 0, 0]
    adam = torch.optim.Adam(net[0].parameters())
    net(torch.randn(5, 3)).sum().backward()
    adam.step()
    assert optimizer_state_layout([sgd, adam]) == [1, 1, 1, 1, 0, 0, 2, 2]  # Adam's 0-dim step is not counted


def test_layout_agreement_keeps_only_parameters_with_the_same_nonzero_count_everywhere():
    layouts = [[1, 1, 0, 2, 2, 0], [1, 0, 0, 2, 1, 0], [1, 1, 0, 2, 2, 3]]
    highest = [max(col) for col in zip(*layouts)]
    lowest = [min(col) for col in zip(*layouts)]
    assert layout_agreement(highest, lowest) == [True, False, False, True, False, False]


def test_agree_on_layout_runs_one_max_all_reduce(gloo):
    assert agree_on_layout([2, 0, 1], CPU, group=gloo) == [True, False, True]
    assert agree_on_layout([], CPU, group=gloo) == []


def test_state_mask_selects_only_agreed_parameters_state():
    torch.manual_seed(0)
    nets = [_net(), copy.deepcopy(_net())]
    optimizers = [_sgd_after_step(nets[0], skip=None), _sgd_after_step(nets[1], skip=nets[1][2])]
    layouts = [optimizer_state_layout([o]) for o in optimizers]
    mask = layout_agreement([max(c) for c in zip(*layouts)], [min(c) for c in zip(*layouts)])
    assert mask == [True, True, True, True, False, False]
    per_rank = [averaged_tensors(n, [o], state_mask=mask) for n, o in zip(nets, optimizers)]
    assert [t.shape for t in per_rank[0]] == [t.shape for t in per_rank[1]]
    agreed = [*nets[0][0].parameters(), *nets[0][1].parameters()]
    momentum = [optimizers[0].state[p]["momentum_buffer"] for p in agreed]
    assert [id(t) for t in per_rank[0][-4:]] == [id(t) for t in momentum]
    unmasked = averaged_tensors(nets[0], optimizers[:1])
    assert len(unmasked) == len(per_rank[0]) + 2  # without a mask every present state tensor is included
    simulate(per_rank, weights=[1.0, 1.0])  # same layout on both ranks: the round goes through
    with pytest.raises(ValueError, match="state_mask has 2 entries"):
        averaged_tensors(nets[0], optimizers[:1], state_mask=[True, True])


def test_a_correction_from_a_snapshot_keeps_the_progress_made_since():
    """Ripples' overlap: the group's mean minus what this rank sent, added to values that moved on meanwhile."""
    params = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t(), torch.tensor(5.0, dtype=torch.bfloat16)]  # strided, 0-dim
    sent = flat_copy(params)
    partner = torch.tensor([3.0, 6.0, 4.0, 8.0, 7.0])
    with torch.no_grad():  # a local step after the snapshot
        params[0].add_(0.5)
        params[1].add_(1.0)
    add_flat(params, (sent + partner) / 2 - sent)
    assert torch.equal(params[0], torch.tensor([[2.0, 4.5], [3.0, 6.0]]) + 0.5)  # the mean, plus the step
    assert params[1].dtype == torch.bfloat16 and params[1].item() == 7.0
    # With no progress in between, the correction lands exactly on the mean.
    load_flat(params, sent)
    add_flat(params, (sent + partner) / 2 - sent)
    assert torch.equal(flat_copy(params), (sent + partner) / 2)
