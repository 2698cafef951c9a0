"""The parameter-server paradigms' staleness rules (``lightning_oscars.core.staleness``), run by the discrete-event
parameter server of ``benchmarks.simulator.server``: bounds never exceeded, ASP never waits, DSSP's threshold
follows the speeds, DASP moves a worker that turns slow out of the synchronous group and back."""

from __future__ import annotations

import random

import pytest

from benchmarks.simulator.server import simulate_paradigm
from lightning_oscars.core.staleness import ASP, BSP, DASP, DSSP, SSP, WorkerTimes

MIXED = (0.03, 0.03, 0.06, 0.15)  # 1x, 1x, 2x, 5x


def test_bsp_meets_after_every_iteration():
    run = simulate_paradigm(BSP(), MIXED, duration_s=6.0)
    assert all(lead == 0 for _, lead in run.lead)
    assert max(run.iterations) - min(run.iterations) <= 1
    assert run.waited_s[0] > 0.7 * 6.0, "the 1x workers spend most of the time waiting for the 5x one"


@pytest.mark.parametrize("staleness", [0, 3, 15])
def test_ssp_never_lets_a_worker_run_more_than_s_clocks_ahead(staleness):
    run = simulate_paradigm(SSP(staleness), MIXED, duration_s=12.0)
    leads = [lead for _, lead in run.lead]
    assert max(leads) == staleness, "the bound is reached (not vacuous) and never exceeded"
    assert run.iterations[0] > run.iterations[3]


def test_asp_never_waits_and_its_staleness_is_unbounded():
    run = simulate_paradigm(ASP(), MIXED, duration_s=12.0)
    assert run.waited_s == [0.0] * 4
    assert run.iterations[0] == pytest.approx(12.0 / 0.03, abs=1)
    assert max(lead for _, lead in run.lead) > 100


def test_dssp_stays_within_its_range_and_its_threshold_follows_the_speeds():
    def speeds(worker: int, iteration: int, now: float) -> float:
        slow = 0.06 if now < 10.0 else 0.15  # worker 1 goes from 2x to 5x at 10 s
        return 0.03 if worker == 0 else slow

    rule = DSSP(s_low=2, s_range=10)
    run = simulate_paradigm(rule, speeds, duration_s=20.0, world_size=2)
    assert max(lead for _, lead in run.lead) <= 12
    assert all(2 <= t <= 12 for _, _, t in run.thresholds)
    before = [t for at, w, t in run.thresholds if w == 0 and 3.0 < at < 10.0 and t > 2]
    after = [t for at, w, t in run.thresholds if w == 0 and at > 13.0 and t > 2]
    assert before and after
    # Worker 0 is granted extra iterations until the slow worker's next push: about one slow iteration's worth.
    assert max(before) < min(after), (sorted(set(before)), sorted(set(after)))
    assert sum(run.waited_s) < sum(simulate_paradigm(SSP(2), speeds, 20.0, world_size=2).waited_s)


def test_dasp_moves_a_worker_that_turns_slow_out_of_the_synchronous_group_and_back():
    def speeds(worker: int, iteration: int, now: float) -> float:
        return 0.09 if worker == 2 and 5.0 <= now < 15.0 else 0.03

    rule = DASP(leave=1.5, rejoin=1.2, patience=2)
    run = simulate_paradigm(rule, speeds, duration_s=25.0, world_size=4)
    moves = [(at, state) for at, worker, state in run.switches if worker == 2]
    assert [state for _, state in moves] == ["async", "sync"], run.switches
    assert 5.0 < moves[0][0] < 5.0 + 6 * 0.09, "out within a few of its slow iterations"
    assert 15.0 < moves[1][0] < 15.0 + 6 * 0.09, "back within a few of its fast iterations"
    assert not [s for s in run.switches if s[1] != 2], "nobody else moved"
    # While it was asynchronous the others did not wait for it: they kept their own pace (BSP: the slow one's).
    assert run.iterations[0] >= 0.98 * 25.0 / 0.03
    assert simulate_paradigm(BSP(), speeds, 25.0, world_size=4).iterations[0] < 0.75 * 25.0 / 0.03


@pytest.mark.parametrize(
    "make", [BSP, ASP, lambda: SSP(2), lambda: DSSP(1, 4), DASP], ids=["bsp", "asp", "ssp-2", "dssp-1-4", "dasp"]
)
def test_no_rule_deadlocks_on_random_clusters(make):
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(2, 6)
        base = [rng.uniform(0.01, 0.1) for _ in range(n)]

        def speeds(worker: int, iteration: int, now: float, base=base) -> float:
            return base[worker] * rng.lognormvariate(0.0, 0.3)

        run = simulate_paradigm(make(), speeds, duration_s=3.0, world_size=n)  # raises on a deadlock
        assert min(run.iterations) >= 1


def test_invalid_options_are_rejected_naming_the_option():
    with pytest.raises(ValueError, match="staleness"):
        SSP(-1)
    with pytest.raises(ValueError, match="s_range"):
        DSSP(2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rejoin"):
        DASP(leave=1.2, rejoin=1.5)
    with pytest.raises(ValueError, match="smoothing"):
        WorkerTimes(2, smoothing=0.0)


def test_asking_under_another_view_leaves_dssps_grant_as_it_was():
    # Three workers: 0 fast, 1 slow, 2 ended the round at clock 1 (a shard's "released" view makes it exempt). The
    # grant worker 0 holds at the slowest clock must survive that question: asked under the other view, DSSP would
    # reset it to s_low and draw it again (a second call of the rule per query, with 3 or more workers).
    rule = DSSP(s_low=1, s_range=4)
    times = WorkerTimes(3)
    times.iteration_s = [1.0, 5.0, 3.0]
    times.last_push = [0.0, 0.0, 0.0]
    clocks = [4, 2, 1]
    assert rule.may_start(0, clocks, times, now=0.0)  # the bounded view: worker 2 at its final clock 1
    granted, threshold = dict(rule.granted), rule.threshold(0)
    assert granted == {0: 1} and threshold == 4  # s_low + 3: worker 2's next push is 3 of worker 0's steps away
    rule.would_start(0, clocks, times, now=0.0, exempt={2})  # the released view: worker 2 exempt
    assert rule.granted == granted and rule.threshold(0) == threshold
    rule.may_start(0, clocks, times, now=0.0, exempt={2})  # the state-changing question would have redrawn it
    assert rule.granted != granted or rule.threshold(0) != threshold
