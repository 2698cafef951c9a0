"""RoundLedger: what every rank agreed on at each averaging (costs, jitters, requests), unit-tested directly."""

from __future__ import annotations

import pytest

from lightning_oscars.core.control import ControlData, RankReport
from lightning_oscars.core.ledger import COST_WINDOW, JITTER_SMOOTHING, RoundLedger


def summed(*reports: RankReport, stop: bool = False, requeue: bool = False) -> ControlData:
    return ControlData(tuple(reports), float(len(reports)), stop, False, requeue)


def test_the_round_cost_is_the_median_of_recent_rounds_and_the_fastest_all_reduce():
    clock = {"now": 0.0}
    ledger = RoundLedger(2, 0, now=lambda: clock["now"])
    costs = []
    for overhead in (0.5, 0.01, 0.02, 0.03, 9.0):  # one slow round (a checkpoint write) among ordinary ones
        ledger.enter(
            summed(RankReport(allreduce=0.004, overhead=overhead), RankReport(allreduce=0.001, overhead=2 * overhead)),
            allreduce_s=0.004,
            compute_s=0.0,
        )
        costs.append(ledger.round_cost)
    assert ledger.allreduce_time == 0.001  # the last to arrive waited least
    assert costs[-1] == pytest.approx(0.03)  # the median of 0.5, 0.01, 0.02, 0.03, 9.0: one slow round moves nothing
    assert ledger.num_averagings == 5


def test_jitter_is_smoothed_per_rank_and_unreported_jitter_keeps_the_last():
    ledger = RoundLedger(2, 1)
    ledger.enter(summed(RankReport(jitter=0.2), RankReport(jitter=0.0)), allreduce_s=0.0, compute_s=0.0)
    ledger.enter(summed(RankReport(jitter=0.4), RankReport(jitter=0.0)), allreduce_s=0.0, compute_s=0.0)
    assert ledger.jitter == [pytest.approx(0.2 + JITTER_SMOOTHING * 0.2), 0.0]


def test_ranks_that_disagree_on_the_step_are_an_error():
    ledger = RoundLedger(2, 0)
    with pytest.raises(RuntimeError, match="disagree on global_step"):
        ledger.enter(summed(RankReport(global_step=3), RankReport(global_step=4)), allreduce_s=0.0, compute_s=0.0)


def test_requests_are_answered_by_the_averaging_that_carried_them():
    ledger = RoundLedger(2, 0)
    ledger.request_stop()
    ledger.request_requeue()
    assert ledger.request_sigterm() and not ledger.request_sigterm()  # only the first one counts
    ledger.requests_answered(summed(RankReport(), RankReport(), stop=True, requeue=False))
    assert not ledger.stop and ledger.requeue and ledger.sigterm  # the requeue waits for a round that carried it
    ledger.requests_answered(summed(RankReport(), RankReport(), requeue=True))
    assert not ledger.requeue and ledger.sigterm  # SIGTERM ends the fit: it stays


def test_training_time_leaves_out_excluded_time_and_so_does_the_next_rounds_cost():
    clock = {"now": 10.0}
    ledger = RoundLedger(1, 0, now=lambda: clock["now"])
    ledger.begin_fit()
    ledger.enter(summed(RankReport()), allreduce_s=0.0, compute_s=0.0)  # the round started now
    clock["now"] = 13.0
    ledger.exclude_time(2.0)  # a validation
    now = ledger.enter(summed(RankReport()), allreduce_s=0.0, compute_s=0.5)
    assert ledger.training_time(now) == pytest.approx(1.0)
    assert ledger.last_overhead == pytest.approx(0.5)  # 3 s - 2 s of validation - 0.5 s of steps


def test_state_round_trips_and_older_checkpoints_resume():
    ledger = RoundLedger(2, 0)
    for overhead in range(1, COST_WINDOW + 3):
        ledger.enter(summed(RankReport(overhead=0.01 * overhead), RankReport()), allreduce_s=0.0, compute_s=0.0)
    resumed = RoundLedger(2, 0)
    resumed.load_state_dict(ledger.state_dict())
    assert resumed.state_dict() == ledger.state_dict()
    assert len(ledger.state_dict()["round_costs"]) == COST_WINDOW
    older = RoundLedger(2, 0)
    older.load_state_dict({"allreduce_time": 0.25, "num_averagings": 7})  # the key before "round_cost"
    assert older.round_cost == 0.25 and older.num_averagings == 7
