"""benchmarks.loss_breakdown: every second between a run's wall time and the ideal lands in exactly one part."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.loss_breakdown import KINDS, breakdown, per_round  # noqa: E402

BATCH = 64
T = (0.04, 0.12)  # a 1x and a 3x rank
RATE = sum(BATCH / t for t in T)


def record(time, tau, taken, compute, allreduce=0.005, times=T):
    return {
        "time": time,
        "local_steps": list(tau),
        "samples": [BATCH * k for k in taken],
        "step_times": list(times),
        "compute_times": list(compute),
        "allreduce_time": allreduce,
    }


def make_run():
    history = [
        record(0.50, (4, 4), (4, 4), (0.16, 0.48)),  # warm-up: the 1x rank waits
        # steady: 7 x 0.04 = 0.28 s against 2 x 0.12 = 0.24 s; the busiest rank took 0.29 s; 0.012 s of edges
        record(0.50 + 0.29 + 0.005 + 0.012, (7, 2), (7, 2), (0.29, 0.245)),
        record(1.00, (7, 2), (2, 1), (0.08, 0.12)),  # cut short by a validation
        # a deadline round: planned (7, 2), took (8, 2) at slower measured times
        record(1.40, (7, 2), (8, 2), (0.36, 0.25), allreduce=0.006, times=(0.044, 0.125)),
    ]
    steps = [4 + 7 + 2 + 8, 4 + 2 + 1 + 2]
    return {
        "history": history,
        "ideal_samples_per_s": RATE,
        "samples": BATCH * sum(steps),
        "real_steps": steps,
        "train_wall_s": 1.45,
    }


def test_the_parts_add_up_to_the_gap_and_each_is_what_the_records_say():
    run = make_run()
    parts = breakdown(run)
    assert sum(parts[k] for k in KINDS) == pytest.approx(parts["wall"] - parts["ideal"], abs=1e-12)
    assert parts["warm-up"] == pytest.approx(0.50 - 8 * BATCH / RATE)
    assert parts["cut"] == pytest.approx(1.00 - 0.807 - 3 * BATCH / RATE)
    assert parts["after"] == pytest.approx(0.05)
    assert parts["all-reduce"] == pytest.approx(0.005 + 0.006)
    # fixed: the round minus its all-reduce minus the busiest rank's steps
    assert parts["fixed"] == pytest.approx(0.012 + (0.40 - 0.006 - 0.36))
    # stragglers: the busiest rank beyond its steps at the median times (the steps it took, not the plan's)
    assert parts["stragglers"] == pytest.approx((0.29 - 0.28) + (0.36 - 8 * 0.044))
    balanced_1 = 9 / (1 / 0.04 + 1 / 0.12)
    balanced_2 = 10 / (1 / 0.044 + 1 / 0.125)
    assert parts["rounding"] == pytest.approx((0.28 - balanced_1) + (8 * 0.044 - balanced_2))
    # slower medians than the ideal's: a positive speed loss in the last round only
    assert parts["speed"] == pytest.approx((balanced_1 - 9 * BATCH / RATE) + (balanced_2 - 10 * BATCH / RATE))
    assert parts["speed"] > 0.0


def test_per_round_divides_each_loss_by_the_rounds_that_paid_it():
    parts = breakdown(make_run())
    assert (parts["steady rounds"], parts["cut rounds"]) == (2, 1)  # the warm-up round is neither
    ms = per_round(parts)
    assert ms["all-reduce"] == pytest.approx(1e3 * (0.005 + 0.006) / 2)
    assert ms["rounding"] == pytest.approx(1e3 * parts["rounding"] / 2)
    assert ms["cut"] == pytest.approx(1e3 * parts["cut"])
    assert per_round({**parts, "steady rounds": 0, "cut rounds": 0})["cut"] == 0.0
