"""Research idioms whose state lives outside the optimizer's parameters train under oscars with every rank ending
identical (issue 46's third ring): ModelPruning, a user's EMA callback, a momentum teacher, a loss that all-reduces a
buffer inside every step (DINO's center), parametrized weights (spectral and weight norm), SpikeDetection (which reads
every batch's loss and synchronises per batch), and Lightning's gathering of each rank's trained samples.

One launch of 2 ranks through Lightning's launcher runs every case, rank 1 three times slower and ``warmup_steps=1``,
so that the ranks take unequal local steps inside each 3-epoch fit (``tests/idioms_case.py``)."""

from __future__ import annotations

import json
import sys

import pytest
from subproc import ROOT, assert_clean_exit, clean_env, run

CASES = ("pruning", "ema_callback", "teacher", "dino", "spectral", "spike", "gather")
TIMEOUT = 240


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("idioms")
    cmd = [sys.executable, str(ROOT / "tests" / "idioms_case.py"), "oscars", "+".join(CASES), str(out)]
    code, log = run(cmd, TIMEOUT, env=clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20)))
    assert_clean_exit(code, log, TIMEOUT)
    return {case: [json.loads((out / case / f"rank{r}.json").read_text()) for r in range(2)] for case in CASES}


def _identical(a: dict[str, list[float]], b: dict[str, list[float]]) -> list[str]:
    """The keys whose values differ (bitwise) between two ranks' states."""
    assert set(a) == set(b)
    return [key for key in a if a[key] != b[key]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_every_rank_ends_with_the_same_state_after_unequal_local_steps(ranks, case):
    fast, slow = ranks[case]
    assert "error" not in fast and "error" not in slow, (fast.get("error"), slow.get("error"))
    if case != "spike":  # SpikeDetection synchronises every batch: the ranks then step alike
        assert fast["steps_taken"] > slow["steps_taken"], "the ranks took unequal local steps"
    # Every parameter and buffer: the frozen teacher, DINO's center, spectral norm's vectors, BatchNorm statistics.
    assert _identical(fast["state"], slow["state"]) == []


@pytest.mark.multiprocess
def test_pruning_masks_are_equal_and_binary_after_every_epoch(ranks):
    fast, slow = ranks["pruning"]
    assert fast["masks"] == slow["masks"] and len(fast["masks"]) == 3
    for epoch in fast["masks"]:
        assert all(binary for _, binary in epoch.values()), epoch  # never the mean of two ranks' masks
    zeros = [epoch["net.0.weight_mask"][0] for epoch in fast["masks"]]
    assert zeros[0] < zeros[1] < zeros[2], zeros  # each epoch prunes a quarter of what is left
    assert fast["zeros"] == slow["zeros"]  # made permanent at the end: the same weights pruned on both ranks


@pytest.mark.multiprocess
def test_a_users_ema_callback_state_is_equal_on_every_rank(ranks):
    fast, slow = ranks["ema_callback"]
    assert fast["ema"] == slow["ema"] and fast["ema"]
    assert fast["ema"] != {k: v for k, v in fast["state"].items()}  # an average over time, not the last weights


@pytest.mark.multiprocess
def test_spectral_norm_keeps_unit_vectors_and_a_unit_spectral_norm(ranks):
    for rank in ranks["spectral"]:
        assert abs(rank["u_norm"] - 1) < 1e-5 and abs(rank["v_norm"] - 1) < 1e-5, rank
        assert abs(rank["sigma"] - 1) < 1e-3, rank


@pytest.mark.multiprocess
def test_gathering_what_each_rank_trained_returns_every_sample_of_every_epoch(ranks):
    fast, slow = ranks["gather"]
    assert len(fast["trained_rows"]) != len(slow["trained_rows"])  # lists of different lengths were gathered
    assert sorted(fast["gathered"]) == sorted(slow["gathered"]) == sorted(fast["trained_rows"] + slow["trained_rows"])
    assert sorted(fast["gathered"]) == sorted(fast["dataset_rows"] * 3)  # every sample once per epoch, 3 epochs
    # One tensor of different lengths cannot be stacked: every rank gets the same error, naming both shapes.
    for rank in (fast, slow):
        assert "different shapes" in rank["tensor_error"] and str(len(fast["trained_rows"])) in rank["tensor_error"]
