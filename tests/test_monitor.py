"""The schedule monitor's pure parts: metric flattening and the end-of-fit summary."""

import dataclasses

import pytest

from lightning_oscars import RoundRecord, ScheduleMonitor, round_metrics, summarize_history
from lightning_oscars.lightning.monitor import run_fraction_of_ideal


def record(round_: int, local_steps, step_times, compute, allreduce=0.01, rebalanced=False):
    return RoundRecord(
        round=round_,
        time=0.0,
        epoch=0,
        global_step=3 * round_,
        local_steps=tuple(local_steps),
        step_times=tuple(step_times),
        samples=tuple(16 * t for t in local_steps),
        compute_times=tuple(compute),
        allreduce_time=allreduce,
        rebalanced=rebalanced,
    )


def test_round_metrics_per_rank_and_summarised():
    r = record(2, [3, 1], [0.1, 0.29], [0.3, 0.29], rebalanced=True)
    per_rank = round_metrics(r, per_rank=True)
    assert per_rank["oscars/tau/rank0"] == 3 and per_rank["oscars/tau/rank1"] == 1
    assert per_rank["oscars/idle_s/rank1"] == pytest.approx(0.01)
    assert per_rank["oscars/utilization/rank0"] == pytest.approx(0.3 / 0.31)
    assert per_rank["oscars/period_s"] == 0.3 and per_rank["oscars/rebalanced"] == 1.0
    summary = round_metrics(r, per_rank=False)
    assert not any("rank" in k for k in summary)
    assert summary["oscars/tau/max"] == 3 and summary["oscars/tau/min"] == 1 and summary["oscars/tau/median"] == 2
    replicas = round_metrics(r, per_rank=True, unit="replica")  # with replica groups an entry is a replica
    assert replicas["oscars/tau/replica0"] == 3 and not any("/rank" in k for k in replicas)


def test_summary_totals_idle_and_counts_changes():
    history = [
        record(1, [4, 4], [0.1, 0.3], [0.4, 1.2], rebalanced=True),
        record(2, [3, 1], [0.1, 0.3], [0.3, 0.3]),
        record(3, [3, 1], [0.1, 0.3], [0.3, 0.31]),
    ]
    text = summarize_history(history)
    assert "3 rounds, 1 schedule changes" in text
    assert "final tau per rank: [3, 1]" in text
    assert "idle per rank (s, total): [0.81, 0.0]" in text
    assert summarize_history([]) == "oscars: no averaging round ran"
    many = [record(1, list(range(1, 41)), [0.1] * 40, [0.1] * 40)]
    assert "(40 ranks)" in summarize_history(many)


def test_run_fraction_of_ideal_spans_the_records_training_time():
    # Two rounds at 0.1 / 0.3 s per step. The second record comes 1.0 s after the first although its round's
    # compute took 0.6 s: the 0.4 s between rounds (Lightning's work, no-op slots) count as lost.
    first = dataclasses.replace(record(1, [6, 2], [0.1, 0.3], [0.6, 0.6]), time=0.6)
    second = dataclasses.replace(record(2, [6, 2], [0.1, 0.3], [0.6, 0.6]), time=1.6)
    assert run_fraction_of_ideal([first]) == pytest.approx(1.0)
    assert run_fraction_of_ideal([first, second]) == pytest.approx((8 + 8) / (1.6 * (10 + 10 / 3)))
    assert "of ideal throughput" in summarize_history([first, second])
    assert "(50.0 per 100 rounds)" in summarize_history([dataclasses.replace(first, rebalanced=True), second])
    assert run_fraction_of_ideal([]) == 0.0


def test_monitor_rejects_bad_interval():
    with pytest.raises(ValueError, match="log_every_n_rounds"):
        ScheduleMonitor(log_every_n_rounds=0)


def test_per_rank_batch_sizes_reach_the_metrics_and_the_summary():
    sized = dataclasses.replace(record(1, [3, 1], [0.1, 0.3], [0.3, 0.3]), batch_sizes=(64, 32))
    metrics = round_metrics(sized, per_rank=True)
    assert metrics["oscars/batch_size/rank0"] == 64 and metrics["oscars/batch_size/rank1"] == 32
    assert round_metrics(sized, per_rank=False)["oscars/batch_size/max"] == 64
    assert "batch size per rank: [64, 32]" in summarize_history([sized])
    plain = record(1, [3, 1], [0.1, 0.3], [0.3, 0.3])  # one batch size for all: nothing per rank to show
    assert not any("batch_size" in k for k in round_metrics(plain, per_rank=True))
    assert "batch size" not in summarize_history([plain])
    assert sized["batch_sizes"] == [64, 32] and plain["batch_sizes"] == []
