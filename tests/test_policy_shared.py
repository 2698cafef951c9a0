"""The schedule policy is one object shared by the strategy and the simulator (``lightning_oscars.core.policy``).

Fed the same per-round medians and all-reduce costs, the simulator's oscars policy and a ``SchedulePolicy``
configured as ``OscarsStrategy`` configures it reach the same schedule after every round; the simulator sizes
epochs with the policy's bound, as the strategy sizes its loader; and unit tests of ``SchedulePolicy`` itself.
Fast: no torch.distributed."""

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.simulator import Cluster, FixedPolicy, OscarsPolicy, Slowdown, simulate, simulate_oscars  # noqa: E402
from lightning_oscars.core.partition import max_epoch_slots, planned_slots  # noqa: E402
from lightning_oscars.core.policy import SchedulePolicy  # noqa: E402
from lightning_oscars.core.solver import DEFAULT_MAX_SPREAD, snap_step_times, solve_schedule  # noqa: E402


def strategy_policy(**options) -> SchedulePolicy:
    """The ``SchedulePolicy`` that ``OscarsStrategy(**options)`` configures for a fit."""
    from lightning_oscars.lightning.strategy import OscarsStrategy

    return OscarsStrategy(**options).make_policy()


CONFIGURATION = (
    "solver",
    "max_spread",
    "max_local_steps",
    "tolerance",
    "warmup_steps",
    "rebalance_threshold",
    "min_gain",
    "smoothing",
    "pinned_step_times",
    "pinned_local_steps",
    "resolve",
    "initial_allreduce_s",
)


def test_the_simulators_oscars_is_the_strategys_default_policy():
    simulator, strategy = OscarsPolicy(), strategy_policy()
    assert isinstance(simulator, SchedulePolicy)
    assert {k: getattr(simulator, k) for k in CONFIGURATION} == {k: getattr(strategy, k) for k in CONFIGURATION}
    assert strategy.solver == "exact" and strategy.max_spread == DEFAULT_MAX_SPREAD == 16
    assert strategy.max_local_steps == 16
    assert strategy.tolerance == 0.02 and strategy.warmup_steps == 4 and strategy.rebalance_threshold == 0.2
    assert strategy.min_gain == 0.02 and strategy.smoothing == 0.5
    # fixed-period local SGD: the strategy's solver="uniform"
    local, uniform = FixedPolicy(8), strategy_policy(solver="uniform", max_local_steps=8)
    assert {k: getattr(local, k) for k in CONFIGURATION} == {k: getattr(uniform, k) for k in CONFIGURATION}


def _rounds(n_rounds=40, slow_from=15, silent_round=25, seed=0):
    """Per-round medians of 4 ranks (NaN: no step measured) and the all-reduce cost the round's wire carries.

    Rank 1 turns 3x slower from round ``slow_from``; rank 2 measures nothing in round ``silent_round``; the cost
    is 0 at the first averaging (nothing measured yet), then the previous averaging's, which grows mid-way.
    """
    rng = np.random.default_rng(seed)
    base = np.array([0.1, 0.1, 0.2, 0.3])
    for k in range(n_rounds):
        times = base * np.where(np.arange(4) == 1, 3.0 if k >= slow_from else 1.0, 1.0)
        medians = times * np.exp(0.03 * rng.standard_normal(4))
        if k == silent_round:
            medians[2] = np.nan
        cost = 0.0 if k == 0 else (0.02 if k < 30 else 0.06)
        yield medians, cost


@pytest.mark.parametrize("solver", ["exact", "alg1"])
def test_simulator_and_strategy_policies_reach_the_same_schedules(solver):
    simulator = OscarsPolicy(solver=solver)
    strategy = strategy_policy(solver=solver)
    simulator.begin(4)
    strategy.begin(4)
    assert simulator.local_steps == strategy.local_steps == (4, 4, 4, 4)  # the warm-up round
    seen = []
    for medians, cost in _rounds():
        # The strategy's wire format carries 0.0 for "no step measured", the simulator NaN.
        wire = [0.0 if math.isnan(m) else float(m) for m in medians]
        changed = simulator.observe(medians, cost)
        assert strategy.observe(wire, cost) == changed
        assert simulator.schedule == strategy.schedule
        assert simulator.local_steps == strategy.local_steps
        assert simulator.solves == strategy.solves
        assert simulator.epoch_slot_bound(1000) == strategy.epoch_slot_bound(1000)
        seen.append(simulator.local_steps)
    # not vacuous: solved, then re-solved after the slowdown (rank 1 now takes fewer steps than rank 0)
    assert len(set(seen)) >= 2
    assert seen[-1][1] < seen[-1][0]


def test_the_simulated_run_feeds_the_strategy_policy_the_same_schedules():
    """Replay what the simulator's round controller handed its policy (a rank turning 3x slower, validations cutting
    rounds so that a rank measures nothing) into a fresh strategy policy: the same schedule after every averaging."""

    class Recording(OscarsPolicy):
        def __init__(self):
            super().__init__()
            self.calls = []

        def observe(self, medians, allreduce_s, errors=None):
            changed = super().observe(medians, allreduce_s, errors)
            self.calls.append((list(medians), allreduce_s, errors, changed, self.schedule))
            return changed

    cluster = Cluster((0.01, 0.01, 0.02, 0.04), noise=0.05, slowdowns=(Slowdown(1, 2.0, 3.0),), noop_s=0.001)
    policy = Recording()
    simulate_oscars(cluster, 4 * 400, allreduce_s=0.005, policy=policy, units_per_epoch=400, val_check_interval=0.1)
    assert any(0.0 in medians for medians, *_ in policy.calls)  # a round where a rank measured nothing
    assert len({schedule for *_, schedule in policy.calls}) >= 3
    assert any(cost > 0 for _, cost, *_ in policy.calls), "the measured round cost reached the policy"
    strategy = strategy_policy()
    strategy.begin(4)
    for medians, cost, errors, changed, schedule in policy.calls:
        assert strategy.observe(medians, cost, errors) == changed
        assert strategy.schedule == schedule


def test_the_simulator_sizes_the_first_epoch_with_the_shared_bound():
    units, n = 240, 4
    policy = OscarsPolicy()
    res = simulate_oscars(
        Cluster((0.01, 0.01, 0.02, 0.03)),
        3 * units,
        allreduce_s=0.001,
        policy=policy,
        units_per_epoch=units,
        record_batch_size=1,
    )
    bound = policy.epoch_slot_bound(units)
    # the default spread bound does not bind below the cap of 16 local steps: the cap bounds the busiest rank
    assert res.epoch_slots[0] == bound == max_epoch_slots(units, n, 16, last_round=16) < units
    tight = OscarsPolicy(max_spread=8)
    tight.begin(n)
    assert tight.epoch_slot_bound(units) == max_epoch_slots(units, n, 8, last_round=8) < bound
    strategy = strategy_policy()
    strategy.begin(n)
    assert strategy.epoch_slots(units, strategy.epoch_slot_bound(units)) == (bound, True)
    # later epochs start solved: the slots their schedule needs, never beyond the bound
    second = next(r for r in res.history if r["epoch"] == 1)["local_steps"]
    assert res.epoch_slots[1] == min(planned_slots(second, units), bound) < bound
    # fixed-period local SGD knows its epochs' length from the start
    local = simulate(Cluster((0.01,) * n), FixedPolicy(8), 2 * units, allreduce_s=0.0, units_per_epoch=units)
    assert local.epoch_slots == [planned_slots((8,) * n, units)] * 2 == [units // n] * 2


# ---------------------------------------------------------------------------------------------- SchedulePolicy


def test_pinned_schedules_must_match_the_world_size():
    policy = SchedulePolicy(local_steps=(3, 1))
    with pytest.raises(ValueError, match="local_steps has 2 entries for 3 ranks"):
        policy.begin(3)
    policy.begin(2)
    assert policy.local_steps == (3, 1) and policy.solved and not policy.resolve
    with pytest.raises(ValueError, match="step_times has 2 entries for 3 ranks"):
        SchedulePolicy(step_times=(0.1, 0.3)).begin(3)
    with pytest.raises(ValueError, match="not both"):
        SchedulePolicy(step_times=(0.1, 0.3), local_steps=(3, 1))
    with pytest.raises(ValueError, match="solver"):
        SchedulePolicy("nope")


def test_pinned_step_times_solve_once():
    policy = SchedulePolicy(step_times=(0.1, 0.3), initial_allreduce_s=0.05)
    policy.begin(2)
    assert policy.schedule == solve_schedule((0.1, 0.3), 0.05) and policy.solves == 1
    assert not policy.observe([0.1, 0.9], 0.05)  # pinned: never re-solved
    assert policy.schedule == solve_schedule((0.1, 0.3), 0.05) and policy.solves == 1
    assert policy.epoch_slot_bound(100) == planned_slots(policy.local_steps, 100)


def test_uniform_is_max_local_steps_everywhere():
    policy = SchedulePolicy("uniform", max_local_steps=6)
    policy.begin(3)
    assert policy.local_steps == (6, 6, 6) and policy.solved
    assert not policy.observe([0.1, 0.2, 0.9], 0.01)
    assert policy.local_steps == (6, 6, 6) and policy.solves == 0
    assert policy.epoch_slot_bound(100) == planned_slots((6, 6, 6), 100) == 34
    assert policy.epoch_slots(100, policy.epoch_slot_bound(100)) == (34, False)


def test_warmup_shrinks_to_max_steps():
    policy = SchedulePolicy(warmup_steps=4)
    for max_steps, warmup in ((2, 2), (10, 4), (-1, 4), (None, 4), (0, 4)):
        policy.begin(2, max_steps=max_steps)
        assert policy.local_steps == (warmup, warmup) and not policy.solved
    policy.begin(2, max_steps=2)
    bound = max_epoch_slots(1000, 2, 16, last_round=16)
    assert policy.epoch_slot_bound(1000) == bound < 1000
    assert policy.epoch_slots(1000, bound) == (bound, True)
    assert policy.epoch_slots(1000, 30) == (30, True)
    long_warmup = SchedulePolicy(warmup_steps=12, max_spread=8)
    long_warmup.begin(2)
    assert long_warmup.epoch_slot_bound(1000) == max_epoch_slots(1000, 2, 8, last_round=12)


def test_step_times_are_smoothed_per_rank():
    policy = SchedulePolicy(smoothing=0.25)
    policy.begin(2)
    assert not policy.observe([0.1, math.nan], 0.0)  # rank 1 measured nothing: nothing to solve from yet
    assert policy.estimate == [0.1, 0.0] and not policy.solved
    assert not policy.observe([0.15, 0.0], 0.0)  # 0.0 also means "not measured"
    assert policy.estimate == pytest.approx([0.25 * 0.15 + 0.75 * 0.1, 0.0])
    assert policy.observe([0.2, 0.4], 0.0)  # the first measurement of a rank is taken as it is
    first = 0.25 * 0.2 + 0.75 * (0.25 * 0.15 + 0.75 * 0.1)
    assert policy.estimate == pytest.approx([first, 0.4])
    assert policy.schedule.step_times == pytest.approx(snap_step_times((first, 0.4), 0.05))
    assert policy.solves == 1


def test_resolve_false_keeps_the_first_schedule():
    frozen, adaptive = SchedulePolicy(resolve=False), SchedulePolicy()
    for policy in (frozen, adaptive):
        policy.begin(2)
        assert policy.observe([0.1, 0.1], 0.0)
        assert policy.local_steps == (1, 1)
    for _ in range(4):
        assert not frozen.observe([0.1, 0.5], 0.0)
        adaptive.observe([0.1, 0.5], 0.0)
    assert frozen.local_steps == (1, 1) and frozen.solves == 1
    assert adaptive.local_steps[0] > adaptive.local_steps[1] and adaptive.solves >= 2
    # once solved, an adaptive epoch is sized by its schedule (never beyond the bound)
    bound = adaptive.epoch_slot_bound(100)
    assert adaptive.epoch_slots(100, bound) == (min(planned_slots(adaptive.local_steps, 100), bound), False)


def test_state_dict_resumes_an_adaptive_schedule():
    policy = SchedulePolicy()
    policy.begin(2)
    policy.observe([0.1, 0.3], 0.0)
    state = policy.state_dict()
    resumed = SchedulePolicy()
    resumed.begin(2)
    resumed.load_state_dict(state, allreduce_s=0.0)
    assert resumed.schedule == policy.schedule and resumed.estimate == policy.estimate
    pinned = SchedulePolicy(local_steps=(2, 2))
    pinned.begin(2)
    pinned.load_state_dict(state, allreduce_s=0.0)
    assert pinned.local_steps == (2, 2)


@pytest.mark.parametrize("speeds", [(1.0, 3.0), (1.0, 1.0), (1.0, 5.0), (1.0, 1.0, 2.0, 4.0)])
@pytest.mark.parametrize("noise", [0.02, 0.05])
def test_steady_speeds_change_the_schedule_at_most_3_times_in_100_rounds(speeds, noise):
    # Per-round medians of 38 ms x speed with lognormal noise, and a fixed cost per round of 4-12 ms that itself
    # jitters (the round-cost median of the strategy): what the GPU-like benchmark measures. The first solve counts.
    rng = random.Random(7)
    policy = SchedulePolicy()
    policy.begin(len(speeds))
    changes = 0
    for rnd in range(100):
        medians = [0.038 * s * math.exp(rng.gauss(0.0, noise)) for s in speeds]
        cost = 0.0 if rnd < 2 else 0.008 * math.exp(rng.gauss(0.0, 0.3))
        changes += policy.observe(medians, cost)
    assert 1 <= changes <= 3, f"{changes} schedule changes in 100 rounds under steady speeds"


def test_a_rank_turning_3x_slower_is_rebalanced_within_a_few_rounds_despite_the_hysteresis():
    rng = random.Random(3)
    policy = SchedulePolicy()
    policy.begin(2)
    for _ in range(20):
        policy.observe([0.038 * math.exp(rng.gauss(0.0, 0.03)), 0.038 * math.exp(rng.gauss(0.0, 0.03))], 0.008)
    before = policy.local_steps
    assert before[0] == before[1]
    rounds = 0
    while policy.local_steps[0] < 2 * policy.local_steps[1] and rounds < 5:
        policy.observe([0.038, 0.114], 0.008)
        rounds += 1
    assert policy.local_steps[0] >= 2 * policy.local_steps[1] and rounds <= 3, (rounds, policy.local_steps)


def test_a_speed_jump_replaces_the_estimate_and_noise_is_smoothed():
    policy = SchedulePolicy(smoothing=0.5)
    policy.begin(2)
    policy.observe([0.03, 0.09], 0.005)
    policy.observe([0.045, 0.09], 0.005)  # 1.5x: noise or drift, smoothed
    assert policy.estimate == pytest.approx([0.0375, 0.09])
    # The volatile profile: the ranks swap speeds (3x each way). Both estimates jump in one round, and the schedule
    # follows the swap at once instead of passing through a half-way estimate.
    assert policy.observe([0.09, 0.03], 0.005)
    assert policy.estimate == pytest.approx([0.09, 0.03])
    assert policy.local_steps[1] >= 2.5 * policy.local_steps[0], policy.local_steps
