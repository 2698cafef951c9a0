import itertools
import math
import random
import warnings

import pytest

from lightning_oscars.core import solver as solver_module
from lightning_oscars.core.solver import (
    DEFAULT_MAX_SPREAD,
    Schedule,
    rebalance,
    schedule_drift,
    schedule_from_local_steps,
    solve_schedule,
    solve_schedule_alg1,
)

# The capped fallback warns once per process; the tests that check the warning record it themselves.
pytestmark = pytest.mark.filterwarnings("ignore:oscars. step times from:RuntimeWarning")


def brute_force(times, cost, max_spread, max_local_steps, tolerance):
    """Every local-step vector a round of length T can produce (T at every breakpoint k * t_i)."""
    periods = sorted({k * t for t in times for k in range(1, max_local_steps + 2)})
    feasible = []
    for period in periods:
        steps = tuple(math.floor(period / t + 1e-9) for t in times)
        if min(steps) < 1 or max(steps) > max_local_steps or max(steps) - min(steps) >= max_spread:
            continue
        feasible.append((max(s * t for s, t in zip(steps, times)), steps))
    best = max((sum(s) / (p + cost) for p, s in feasible), default=None)
    return best, feasible


def capped_steps(period, times, spread, cap):
    """The documented fallback rule: fill the round, but no rank beyond the slowest's steps + spread - 1, or cap."""
    most = min(math.floor(period / max(times) + 1e-9) + spread - 1, cap)
    return tuple(max(1, min(math.floor(period / t + 1e-9), most)) for t in times)


def capped_brute_force(times, cost, spread, cap):
    """(rate, period) of every round the fallback can choose, T at every multiple k * t_i from max(t) until all ranks
    sit at the cap: no T is skipped where a rank's steps could change, so this also checks the solver's candidates."""
    rounds = []
    for t in times:
        for k in range(1, math.ceil(cap * max(times) / t) + 2):
            if k * t < max(times) * (1 - 1e-12):
                continue
            steps = capped_steps(k * t, times, spread, cap)
            period = max(s * x for s, x in zip(steps, times))
            rounds.append((sum(steps) / (period + cost), period))
    return rounds


@pytest.mark.parametrize("seed", range(40))
def test_exact_solver_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    times = [rng.uniform(0.01, 0.2) for _ in range(n)]
    cost = rng.choice([0.0, 0.005, 0.05])
    spread, cap = rng.randint(2, 10), rng.randint(2, 12)
    schedule = solve_schedule(times, cost, max_spread=spread, max_local_steps=cap, tolerance=0.0)
    best, feasible = brute_force(times, cost, spread, cap, 0.0)
    if not feasible:  # the capped fallback (it was one step each)
        assert schedule.throughput == pytest.approx(max(capped_brute_force(times, cost, spread, cap))[0], rel=1e-9)
        return
    assert schedule.throughput == pytest.approx(best, rel=1e-9)
    assert max(schedule.local_steps) <= cap
    assert max(schedule.local_steps) - min(schedule.local_steps) < spread


def test_tolerance_prefers_the_shortest_good_round():
    # 1 : 3.5 speeds: the best throughput needs 7 : 2 steps (0.7 s rounds); 3 : 1 is within 20% at half the length.
    times = [0.1, 0.35]
    tight = solve_schedule(times, 0.0, tolerance=0.0, max_local_steps=12)
    loose = solve_schedule(times, 0.0, tolerance=0.2, max_local_steps=12)
    assert tight.local_steps == (7, 2) and loose.local_steps == (3, 1)
    assert loose.period < tight.period and loose.throughput >= 0.8 * tight.throughput
    # A tighter tolerance settles between the two: (4, 1) loses 2.8%, within 5%, and 3 : 1's 11% is not.
    assert solve_schedule(times, 0.0, tolerance=0.05, max_local_steps=12).local_steps == (4, 1)


def test_allreduce_cost_lengthens_rounds():
    times = [0.01, 0.01]
    cheap = solve_schedule(times, 0.0)
    costly = solve_schedule(times, 0.05)
    assert cheap.local_steps == (1, 1)
    assert max(costly.local_steps) > 1
    assert costly.utilization > solve_schedule(times, 0.05, max_local_steps=1).utilization


def test_fast_rank_gets_proportionally_more_steps():
    schedule = solve_schedule([0.1, 0.3])
    fast, slow = schedule.local_steps
    assert fast == 3 * slow
    assert max(schedule.idle_times) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("times", [[0.1, 0.1], [1e-6, 1e-6], [1e3, 1e3], [1e-6, 1e3]])
def test_extreme_and_equal_speeds_terminate(times):
    for solver in (solve_schedule, solve_schedule_alg1):
        schedule = solver(times)
        assert all(s >= 1 for s in schedule.local_steps)


def test_alg1_minimises_largest_wait_on_its_grid():
    times = [0.1, 0.25]
    schedule = solve_schedule_alg1(times, max_spread=8, increment=0.001)
    # T = 0.5 is a common multiple: no rank waits; the scan finds it (or an equally idle-free period).
    assert max(schedule.idle_times) == pytest.approx(0.0, abs=1e-6)
    assert schedule.local_steps[0] > schedule.local_steps[1]


def test_alg1_spread_bound():
    schedule = solve_schedule_alg1([0.1, 0.25], max_spread=3)
    assert schedule.local_steps[0] - schedule.local_steps[1] < 3


@pytest.mark.parametrize(
    "bad",
    [[], [0.0, 1.0], [-1.0, 1.0], [float("nan"), 1.0], [float("inf"), 1.0]],
)
def test_bad_step_times_raise(bad):
    with pytest.raises(ValueError, match="step_times"):
        solve_schedule(bad)


@pytest.mark.parametrize("kwargs", [{"max_spread": 0}, {"max_local_steps": 0}, {"tolerance": 1.5}])
def test_bad_bounds_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        solve_schedule([0.1, 0.2], **kwargs)


def test_pinned_schedule_and_pricing():
    schedule = schedule_from_local_steps([4, 2], [0.1, 0.2], 0.05)
    assert schedule.period == pytest.approx(0.4)
    assert schedule.utilization == pytest.approx(0.8 / (2 * 0.45))
    repriced = schedule.evaluated_at([0.1, 0.4])
    assert repriced.idle_times == pytest.approx((0.4, 0.0))
    with pytest.raises(ValueError, match="local_steps"):
        schedule_from_local_steps([2, 0])
    assert isinstance(schedule, Schedule)


def test_solver_is_deterministic():
    times = [random.Random(1).uniform(0.01, 0.1) for _ in range(64)]
    assert solve_schedule(times, 0.01) == solve_schedule(list(times), 0.01)


def test_large_cluster_is_solved_within_bounds():
    rng = random.Random(3)
    times = [rng.uniform(0.05, 0.25) for _ in range(1024)]
    for spread in (4, 8, DEFAULT_MAX_SPREAD):
        schedule = solve_schedule(times, 0.02, max_spread=spread)
        assert len(schedule.local_steps) == 1024
        assert max(schedule.local_steps) - min(schedule.local_steps) < spread
        assert max(schedule.local_steps) <= 16


def test_brute_force_helper_is_not_vacuous():
    _, feasible = brute_force([0.1, 0.3], 0.0, 8, 16, 0.0)
    assert any(steps == (3, 1) for _, steps in feasible)
    assert len(list(itertools.islice(feasible, 3))) == 3


def test_snap_gives_equally_fast_ranks_one_time_and_keeps_distinct_speeds_apart():
    from lightning_oscars.core.solver import snap_step_times

    times = [0.100, 0.103, 0.30, 0.101, 0.31, 0.5]
    assert snap_step_times(times, 0.05) == (0.103, 0.103, 0.31, 0.103, 0.31, 0.5)
    assert snap_step_times(times, 0.0) == tuple(times)
    # Grouping starts at the fastest member: a chain of small steps does not merge far-apart ranks.
    chain = [1.0, 1.04, 1.08, 1.12]
    assert snap_step_times(chain, 0.05) == (1.04, 1.04, 1.12, 1.12)
    with pytest.raises(ValueError, match="tolerance"):
        snap_step_times(times, 1.5)


def test_snapping_stops_noise_from_splitting_identical_ranks():
    from lightning_oscars.core.solver import snap_step_times

    noisy = [0.0982, 0.1008, 0.1019, 0.1004, 0.2489, 0.2467]  # two speed classes measured with noise
    # A spread bound that binds (8): the round's length then sits at a boundary the noise moves rank by rank.
    raw = solve_schedule(noisy, 0.02, max_spread=8, tolerance=0.05).local_steps
    snapped = solve_schedule(snap_step_times(noisy), 0.02, max_spread=8, tolerance=0.05).local_steps
    assert len(set(snapped[:4])) == 1 and len(set(snapped[4:])) == 1
    assert snapped[0] > snapped[4]
    assert raw != snapped  # the raw times would have split a class


def test_a_difference_within_the_measurements_noise_is_not_a_speed_difference():
    from lightning_oscars.core.solver import snap_step_times

    # Two identical ranks with 2 ms steps, each measured over a few jittery steps: 8% apart, beyond the 5% tolerance.
    times = [0.0020, 0.00216]
    assert snap_step_times(times, 0.05) == tuple(times)
    # A median of 4 steps with a log-spread of 0.15 is known to about 9%: the 8% gap is noise.
    assert snap_step_times(times, 0.05, uncertainty=[0.09, 0.09]) == (0.00216, 0.00216)
    # Well-measured (many steps, 0.5%), the same gap is a speed difference.
    assert snap_step_times(times, 0.05, uncertainty=[0.005, 0.005]) == tuple(times)
    # A 3x straggler stays apart even when measured coarsely.
    assert snap_step_times([0.002, 0.006], 0.05, uncertainty=[0.09, 0.2]) == (0.002, 0.006)
    with pytest.raises(ValueError, match="uncertainties"):
        snap_step_times(times, 0.05, uncertainty=[0.1])


def test_the_policy_gives_noisily_measured_identical_ranks_equal_local_steps():
    from lightning_oscars import SchedulePolicy

    # Lightning's EMA resume test: 4 units per epoch on 2 identical ranks. Local steps split by noise make an epoch
    # of 3 slots instead of 2 (a different optimizer step count from ddp's, depending on timing).
    policy = SchedulePolicy(warmup_steps=4)
    policy.begin(2)
    policy.observe([0.00263, 0.00249], 0.0005)  # 5.5% apart, no spread known: told apart
    assert len(set(policy.local_steps)) == 2
    policy = SchedulePolicy(warmup_steps=4)
    policy.begin(2)
    policy.observe([0.00263, 0.00249], 0.0005, errors=[0.06, 0.05])
    assert len(set(policy.local_steps)) == 1
    # Rounds of well-measured steps shrink the uncertainty; a real 1x/3x difference is always told apart.
    policy = SchedulePolicy(warmup_steps=4)
    policy.begin(2)
    policy.observe([0.002, 0.006], 0.0005, errors=[0.3, 0.3])
    assert policy.local_steps[0] > policy.local_steps[1]


def test_step_times_outside_the_plausible_range_are_rejected():
    with pytest.raises(ValueError, match=r"step_times\[1\]"):
        solve_schedule([0.1, 1e308])
    with pytest.raises(ValueError, match=r"step_times\[0\]"):
        solve_schedule_alg1([5e-324, 0.1])


# ---------------------------------------------------------------- re-balancing rule


def _exact(times, cost):
    return solve_schedule(times, cost, max_spread=8, max_local_steps=16, tolerance=0.05)


def test_drift_is_the_largest_relative_move():
    schedule = _exact((1.0, 2.0), 0.5)
    assert schedule_drift(schedule, (1.0, 2.0), 0.5) == 0.0
    assert schedule_drift(schedule, (1.3, 2.0), 0.5) == pytest.approx(0.3)
    assert schedule_drift(schedule, (1.0, 1.0), 0.5) == pytest.approx(0.5)
    # The all-reduce cost counts relative to the whole round.
    assert schedule_drift(schedule, (1.0, 2.0), 0.5 + schedule.period) == pytest.approx(
        schedule.period / (schedule.period + 0.5)
    )
    with pytest.raises(ValueError, match="1 entries, the schedule 2"):
        schedule_drift(schedule, (1.0,), 0.5)


def test_cost_known_for_the_first_time_always_triggers_a_re_solve():
    # Solved after the warm-up, before any all-reduce was timed: cost 0, shortest good round.
    first = _exact((1.0, 1.0, 2.5, 2.5), 0.0)
    # A cost of 0.3 s moves less than the 20% threshold relative to the round ...
    assert 0.3 / first.period < 0.2
    assert schedule_drift(first, first.step_times, 0.3) == math.inf
    # ... yet a re-solve priced with it picks longer rounds with more throughput, and is adopted.
    schedule, changed = rebalance(first, first.step_times, 0.3, _exact, rebalance_threshold=0.2, min_gain=0.03)
    assert changed and schedule.period > first.period
    assert schedule.throughput > first.evaluated_at(first.step_times, 0.3).throughput * 1.03


def test_rebalance_keeps_the_schedule_below_the_threshold():
    schedule = _exact((1.0, 3.0), 0.1)
    kept, changed = rebalance(schedule, (1.1, 3.0), 0.1, _exact, rebalance_threshold=0.2, min_gain=0.03)
    assert kept is schedule and not changed


def test_rebalance_adopts_a_faster_schedule_and_resets_the_reference_otherwise():
    schedule = _exact((1.0, 3.0), 0.1)
    # Rank 1 became as fast as rank 0: the old 3:1 split idles rank 0; the new schedule is adopted.
    new, changed = rebalance(schedule, (1.0, 1.0), 0.1, _exact, rebalance_threshold=0.2, min_gain=0.03)
    assert changed and new.local_steps[0] == new.local_steps[1]
    # A drift that the solver answers with the same local steps: not adopted, priced at the new times.
    slower = tuple(2 * t for t in schedule.step_times)
    kept, changed = rebalance(schedule, slower, 0.2, _exact, rebalance_threshold=0.2, min_gain=0.03)
    assert not changed and kept.local_steps == schedule.local_steps and kept.step_times == slower
    assert schedule_drift(kept, slower, 0.2) == 0.0


def test_rebalance_hysteresis_ignores_small_gains():
    schedule = _exact((1.0, 3.0), 0.1)
    times = (1.0, 2.5)
    candidate = _exact(times, 0.1)
    current = schedule.evaluated_at(times, 0.1)
    assert candidate.local_steps != current.local_steps
    gain = candidate.throughput / current.throughput - 1.0
    adopted, changed = rebalance(schedule, times, 0.1, _exact, rebalance_threshold=0.1, min_gain=gain + 0.01)
    assert not changed and adopted.local_steps == schedule.local_steps
    adopted, changed = rebalance(schedule, times, 0.1, _exact, rebalance_threshold=0.1, min_gain=gain / 2)
    assert changed and adopted.local_steps == candidate.local_steps


def test_cap_holds_when_a_slower_rank_breaks_at_cap_plus_one_fast_steps():
    # (cap + 1) * t_fast == t_slow: the slack that keeps k * t_i breakpoints exact must not admit that round.
    assert solve_schedule([1.0, 0.5], 0.0, max_spread=2, max_local_steps=1, tolerance=0.0).local_steps == (1, 1)
    for cap in range(1, 6):
        schedule = solve_schedule([1.0, 1.0 / (cap + 1)], 0.0, max_spread=16, max_local_steps=cap, tolerance=0.0)
        assert max(schedule.local_steps) <= cap, (cap, schedule)


# ---------------------------------------------------------------- fallback when no round satisfies the bounds


@pytest.mark.parametrize("solver", [solve_schedule, solve_schedule_alg1])
def test_no_cliff_where_the_spread_bound_stops_being_satisfiable(solver):
    # t_max / t_min = 8.99: the shortest round gives (8, 1), spread 7 < 8. At exactly 9 it gives (9, 1), spread 8,
    # and no round satisfies the bound any more: the old fallback was (1, 1), 2/9 steps per second, 4.5x lower.
    below = solver([1.0, 8.99], max_spread=8) if solver is solve_schedule else solver([1.0, 8.99], 8)
    at = solver([1.0, 9.0], max_spread=8) if solver is solve_schedule else solver([1.0, 9.0], 8)
    assert below.local_steps == at.local_steps == (8, 1)
    assert at.throughput >= 0.97 * below.throughput
    assert at.throughput > 4 * schedule_from_local_steps([1, 1], [1.0, 9.0]).throughput
    far = solver([1.0, 50.0], max_spread=8) if solver is solve_schedule else solver([1.0, 50.0], 8)
    assert far.local_steps == (8, 1) and max(far.idle_times) == pytest.approx(42.0)


def test_fallback_prefers_longer_capped_rounds_when_the_all_reduce_is_expensive():
    # With a 40 s all-reduce, longer rounds pay off: at best the slowest rank takes 9 steps, the fast one the cap.
    best = solve_schedule([1.0, 9.0], 40.0, max_spread=8, tolerance=0.0)
    assert best.local_steps == (16, 9)
    assert best.throughput == pytest.approx(max(capped_brute_force([1.0, 9.0], 40.0, 8, 16))[0], rel=1e-12)
    # Within 5% of that, the shortest round: the slowest rank takes 4 steps, the fast one 4 + 8 - 1 = 11.
    short = solve_schedule([1.0, 9.0], 40.0, max_spread=8, tolerance=0.05)
    assert short.local_steps == (11, 4) and short.throughput >= 0.95 * best.throughput


def test_fallback_warns_once_per_process():
    solver_module._reset_fallback_warning()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the guard, not Python's once-per-location filter, must hold it back
        solve_schedule([1.0, 2.0])  # a feasible solve does not warn
        assert not caught
        for _ in range(5):
            solve_schedule([1.0, 9.0], 0.1, max_spread=8)
            solve_schedule_alg1([1.0, 9.0], 8)
            solve_schedule([1.0, 9.0], 0.1)  # the default bound lets 9x apart ranks be balanced: no warning
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    message = str(caught[0].message)
    assert "break max_spread=8" in message and "fastest rank would take 9 steps" in message
    assert "local steps 1 (slowest) to 8 (fastest)" in message and "Raise max_spread" in message
    assert caught[0].filename == __file__  # points at the caller of the solver
    solver_module._reset_fallback_warning()
    with pytest.warns(RuntimeWarning, match=r"break max_local_steps=4: .* Raise max_local_steps to"):
        solve_schedule([1.0, 5.0], max_spread=16, max_local_steps=4)


@pytest.mark.parametrize("seed", range(20))
def test_alg1_falls_back_to_the_same_capped_schedule(seed):
    rng = random.Random(seed)
    spread, cap = rng.randint(1, 8), rng.randint(1, 20)
    fast = rng.uniform(0.01, 0.1)
    # The fastest and the slowest rank break the spread bound already in the shortest round; others anywhere.
    times = [fast, fast * (spread + 1.5 + rng.random())]
    times += [fast * rng.uniform(1.0, 30.0) for _ in range(rng.randint(0, 4))]
    rng.shuffle(times)
    expected = solve_schedule(times, 0.0, max_spread=spread, max_local_steps=cap, tolerance=0.0)
    assert max(expected.local_steps) - min(expected.local_steps) < spread
    assert solve_schedule_alg1(times, spread, max_local_steps=cap) == expected


@pytest.mark.parametrize("solver", [solve_schedule, solve_schedule_alg1])
def test_fallback_respects_max_local_steps(solver):
    def solve(times, spread, cap):
        if solver is solve_schedule:
            return solver(times, max_spread=spread, max_local_steps=cap)
        return solver(times, spread, max_local_steps=cap)

    assert solve([1.0, 9.0], 8, 4).local_steps == (4, 1)  # spread and cap broken
    assert solve([1.0, 100.0], 200, 16).local_steps == (16, 1)  # only the cap broken: it was (1, 1)
    assert solve([1.0, 9.0], 8, 1).local_steps == (1, 1)
    for cap in range(1, 12):
        schedule = solve([0.05, 0.3, 1.0], 3, cap)
        assert max(schedule.local_steps) <= cap and max(schedule.local_steps) - min(schedule.local_steps) < 3


@pytest.mark.parametrize("seed", range(60))
def test_capped_fallback_matches_brute_force(seed):
    rng = random.Random(seed)
    fast = rng.uniform(0.01, 0.05)
    # The slowest rank so slow that already the shortest round breaks the bounds: the spread bound, or (a quarter
    # of the cases) only the cap. Some ranks in between, some as fast as the fastest.
    if seed % 4:
        spread, cap = rng.randint(1, 6), rng.randint(1, 12)
        slowest = fast * rng.uniform(spread + 1.01, 14.0)
    else:
        spread, cap = 20, rng.randint(1, 6)
        slowest = fast * rng.uniform(cap + 1.01, 14.0)
    times = [fast] * rng.randint(1, 2) + [fast * rng.uniform(1.0, 14.0) for _ in range(rng.randint(0, 3))]
    times = [min(t, slowest) for t in times] + [slowest]
    rng.shuffle(times)
    assert not brute_force(times, 0.0, spread, cap, 0.0)[1]
    cost = rng.choice([0.0, 0.002, 0.05, 1.0])
    tolerance = rng.choice([0.0, 0.0, 0.05, 0.3])
    schedule = solve_schedule(times, cost, max_spread=spread, max_local_steps=cap, tolerance=tolerance)
    rounds = capped_brute_force(times, cost, spread, cap)
    best = max(rate for rate, _ in rounds)
    shortest = min(period for rate, period in rounds if rate >= (1.0 - tolerance) * best * (1.0 - 1e-12))
    if tolerance == 0.0:
        assert schedule.throughput == pytest.approx(best, rel=1e-9)
    assert schedule.period == pytest.approx(shortest, rel=1e-9)
    assert schedule.local_steps == capped_steps(schedule.period, times, spread, cap)
    assert schedule.throughput >= (1.0 - tolerance) * best * (1.0 - 1e-9)
