"""Splitting a global batch by speed and memory (``core/batch_shares.py``), against brute force and ddp's batches."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_oscars.core.batch_shares import (
    BatchTimeModel,
    resolve_batch_sizes,
    share_span,
    solve_shares,
    split_last_batch,
)


def _slowest(shares, models):
    return max(m.time(n) for m, n in zip(models, shares))


def test_equal_ranks_share_equally_and_a_3x_slower_rank_takes_a_quarter():
    equal = [BatchTimeModel(0.005, 0.001)] * 2
    assert solve_shares(64, equal) == [32, 32]
    uneven = [BatchTimeModel(0.0, 0.001), BatchTimeModel(0.0, 0.003)]
    assert solve_shares(64, uneven) == [48, 16]


def test_a_fixed_cost_per_step_moves_samples_to_the_fast_rank():
    # Both 1 ms per sample, but rank 1 pays 8 ms more per step: it takes 4 samples fewer than half of 64.
    shares = solve_shares(64, [BatchTimeModel(0.0, 0.001), BatchTimeModel(0.008, 0.001)])
    assert shares == [36, 28]


def test_caps_bind_and_the_rest_goes_to_the_others():
    models = [BatchTimeModel(0.0, 0.001), BatchTimeModel(0.0, 0.003)]
    assert solve_shares(64, models, caps=[40, 64]) == [40, 24]


@pytest.mark.parametrize(
    ("caps", "message"),
    [([10, 10], "fewer than the global batch of 64"), ([0, 64], "at least 1"), ([64], "1 batch size caps for 2")],
)
def test_impossible_caps_are_errors_naming_the_numbers(caps, message):
    with pytest.raises(ValueError, match=message):
        solve_shares(64, [BatchTimeModel(0.0, 0.001)] * 2, caps=caps)


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(3, 14),
    params=st.lists(st.tuples(st.floats(0.0, 0.02), st.floats(0.0005, 0.01)), min_size=2, max_size=3),
    caps=st.lists(st.integers(1, 14), min_size=3, max_size=3),
)
def test_shares_sum_to_the_batch_respect_caps_and_minimise_the_slowest_rank(total, params, caps):
    models = [BatchTimeModel(a, b) for a, b in params]
    caps = caps[: len(models)]
    if sum(caps) < total or total < len(models):
        return
    shares = solve_shares(total, models, caps)
    assert sum(shares) == total and all(1 <= n <= c for n, c in zip(shares, caps))
    best = min(
        _slowest(option, models)
        for option in itertools.product(*(range(1, c + 1) for c in caps))
        if sum(option) == total
    )
    assert _slowest(shares, models) == pytest.approx(best, rel=1e-12)


def test_the_time_model_recovers_fixed_and_per_sample_costs_from_two_batch_sizes():
    model = BatchTimeModel.fit([16, 16, 48, 48], [0.021, 0.021, 0.053, 0.053])
    assert model.fixed == pytest.approx(0.005) and model.per_sample == pytest.approx(0.001)
    # One batch size: the time is taken as proportional to the batch.
    assert BatchTimeModel.fit([32, 32], [0.04, 0.04]) == BatchTimeModel(0.0, 0.04 / 32)
    # A negative fit (noise) falls back to proportional too.
    assert BatchTimeModel.fit([10, 20], [0.05, 0.01]).fixed == 0.0


@settings(max_examples=200, deadline=None)
@given(
    shares=st.lists(st.integers(1, 40), min_size=2, max_size=5),
    fraction=st.floats(0.0, 1.0),
)
def test_a_short_last_batch_keeps_the_proportions_and_every_sample(shares, fraction):
    samples = int(sum(shares) * fraction)
    cut = split_last_batch(shares, samples)
    assert sum(cut) == samples and all(0 <= c <= s for c, s in zip(cut, shares))
    if samples >= len(shares):
        assert min(cut) >= 1
    floor = 1 if samples >= len(shares) else 0
    parts = [floor + (samples - floor * len(shares)) * s / sum(shares) for s in shares]
    if all(p <= s for p, s in zip(parts, shares)):  # no share binds: each within one sample of its part
        assert all(abs(c - p) < 1 for c, p in zip(cut, parts)), (cut, parts)


def test_the_ranks_spans_make_up_ddps_global_batch_whatever_the_shares():
    # ddp, 2 ranks of batch 4 over the order p: rank r's batch k is p[r::2][4k:4k+4]; together, p[8k:8k+8].
    order = list(range(100, 132))
    ddp_batch_1 = sorted(order[0::2][4:8] + order[1::2][4:8])
    for shares in ([4, 4], [6, 2], [1, 7]):
        spans = [share_span(8, shares, rank) for rank in range(2)]
        taken = sorted(i for first, last in spans for i in order[first:last])
        assert taken == ddp_batch_1


def test_batch_sizes_by_rank_or_by_device_name_with_clear_errors():
    assert resolve_batch_sizes([64, 24], 2, ["a", "b"]) == [64, 24]
    assert resolve_batch_sizes({"A100": 64, "V100": 24}, 3, ["A100", "V100", "A100"]) == [64, 24, 64]
    assert resolve_batch_sizes(None, 2, ["a", "b"]) is None
    with pytest.raises(ValueError, match="3 entries for 2 ranks"):
        resolve_batch_sizes([1, 2, 3], 2, ["a", "b"])
    with pytest.raises(ValueError, match=r"no entry for the device\(s\) \['T4'\]"):
        resolve_batch_sizes({"A100": 64}, 2, ["A100", "T4"])
    with pytest.raises(ValueError, match="at least 1"):
        resolve_batch_sizes([8, 0], 2, ["a", "b"])
    with pytest.raises(ValueError, match="a list"):
        resolve_batch_sizes("64", 2, ["a", "b"])
