"""Unit tests of the cluster simulator (benchmarks/simulator): closed-form cases it must reproduce exactly,
the mechanisms copied from the strategy, and the validation / CLI plumbing (on benchmark results the simulator
itself generates from known inputs, which the validation must recover). Fast: no torch.distributed."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

# `python -m pytest` puts the repository root on sys.path, a bare `pytest` only tests/ (conftest.py): make
# `benchmarks` importable either way.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.simulator import (  # noqa: E402
    MIXES,
    Cluster,
    FixedPolicy,
    OscarsPolicy,
    Slowdown,
    ValidationInputs,
    _fit_to_remaining,
    _row_medians,
    fit_round_costs,
    machine_inputs,
    main,
    mix_step_times,
    parse_profile,
    parse_slowdown,
    ring_allreduce_time,
    simulate,
    simulate_bsp,
    simulate_config,
    simulate_local_sgd,
    simulate_oscars,
    validate_against,
    validation_inputs,
)
from lightning_oscars.core.solver import snap_step_times, solve_schedule  # noqa: E402


def test_ring_allreduce_cost_formula():
    assert ring_allreduce_time(1, 1e8, 1e10, 5e-6) == 0.0
    # 2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency
    assert ring_allreduce_time(2, 1e8, 1e10, 5e-6) == pytest.approx(0.01 + 1e-5)
    assert ring_allreduce_time(4, 1e8, 1e10, 5e-6) == pytest.approx(0.015 + 3e-5)
    assert ring_allreduce_time(1024, 1e8, 1e10, 5e-6) == pytest.approx(2 * 1023 / 1024 * 0.01 + 2 * 1023 * 5e-6)
    # the bandwidth term saturates at 2 x bytes / bandwidth, the latency term keeps growing
    assert ring_allreduce_time(4096, 1e8, 1e10, 0.0) < 0.02
    with pytest.raises(ValueError):
        ring_allreduce_time(0, 1.0, 1.0, 0.0)


@pytest.mark.parametrize("paradigm", ["bsp", "local_sgd", "oscars"])
def test_equal_speeds_without_communication_use_the_whole_cluster(paradigm):
    cluster = Cluster((0.1,) * 6)
    run = {"bsp": simulate_bsp, "local_sgd": simulate_local_sgd, "oscars": simulate_oscars}[paradigm]
    res = run(cluster, 6 * 200, allreduce_s=0.0)
    assert res.utilization == pytest.approx(1.0)
    assert res.idle_fraction == pytest.approx(np.zeros(6), abs=1e-12)
    assert res.throughput == pytest.approx(cluster.ideal_throughput)


def test_bsp_with_one_rank_three_times_slower():
    # Every step lasts 3 s (the slow rank); the ranks compute 1 + 3 s of it out of 2 x 3 s: (1 + 1/3) / 2.
    res = simulate_bsp(Cluster((1.0, 3.0)), 2 * 50, allreduce_s=0.0)
    assert res.utilization == pytest.approx((1 + 1 / 3) / 2)
    assert res.idle_fraction == pytest.approx([2 / 3, 0.0])
    assert res.throughput == pytest.approx(2 / 3)
    assert res.throughput / Cluster((1.0, 3.0)).ideal_throughput == pytest.approx(0.5)


def test_bsp_pays_the_exposed_part_of_the_allreduce():
    cluster = Cluster((1.0, 3.0))
    res = simulate_bsp(cluster, 2 * 10, allreduce_s=0.5, overlap=0.4)
    assert res.wall_s == pytest.approx(10 * (3.0 + 0.6 * 0.5))
    assert res.utilization == pytest.approx(4.0 / (2 * 3.3))
    with pytest.raises(ValueError, match="overlap"):
        simulate_bsp(cluster, 2, allreduce_s=0.5, overlap=1.5)


def test_fixed_local_sgd_round_is_set_by_the_slowest_rank():
    res = simulate_local_sgd(Cluster((1.0, 2.0)), 2 * 8 * 5, allreduce_s=1.0, period=8, round_overhead_s=0.25)
    assert res.rounds == 5
    assert res.wall_s == pytest.approx(5 * (16.0 + 1.0 + 0.25))
    assert res.idle_fraction[0] == pytest.approx(8.0 / 17.25)


def test_noise_free_oscars_matches_the_solver_prediction():
    times, cost = (0.1, 0.1, 0.25, 0.5), 0.02
    schedule = solve_schedule(times, cost)
    policy = OscarsPolicy(initial_step_times=times, initial_allreduce_s=cost)
    res = simulate_oscars(Cluster(times), 40 * sum(schedule.local_steps), allreduce_s=cost, policy=policy)
    assert res.final_local_steps == schedule.local_steps
    assert len(res.schedule_changes) == 1 and policy.solves == 1
    assert res.throughput == pytest.approx(schedule.throughput, rel=1e-9)
    assert res.round_utilization == pytest.approx(schedule.utilization, rel=1e-9)


def test_first_solve_is_at_cost_zero_and_the_known_cost_always_triggers_a_re_solve():
    # A round's fixed cost is measured from one averaging to the next and reported at the following one: the first
    # schedule is solved at cost 0 and kept through averaging 2. At averaging 3 the cost is known, and the schedule
    # is re-solved whatever the drift threshold: a cost of 0.05 s is only 17% of the 0.3 s round (under the 20%
    # threshold), yet rounds twice as long are 7.7% faster. (Tolerance 0.05: the example was built for it.)
    times = (0.1, 0.3)
    small = OscarsPolicy(tolerance=0.05, min_gain=0.03)
    res = simulate_oscars(Cluster(times), 400, allreduce_s=0.05, policy=small)
    assert small.solves == 2 and small.schedule.allreduce_time == pytest.approx(0.05)
    assert solve_schedule(times, 0.0, tolerance=0.05).local_steps == (3, 1)
    assert small.schedule.local_steps == solve_schedule(times, 0.05, tolerance=0.05).local_steps == (6, 2)
    # warm-up (4, 4), the cost-0 schedule for two rounds, then the re-solved one
    assert [steps for _, steps in res.schedule_changes] == [(4, 4), (3, 1), (6, 2)]
    assert res.schedule_changes[2][0] == 3
    # Re-solved, but not adopted when the gain is below min_gain: the local steps stay, priced at the cost.
    reluctant = OscarsPolicy(min_gain=0.1, tolerance=0.05)
    res = simulate_oscars(Cluster(times), 400, allreduce_s=0.05, policy=reluctant)
    assert reluctant.solves == 2 and reluctant.schedule.local_steps == (3, 1)
    assert reluctant.schedule.allreduce_time == pytest.approx(0.05)
    assert [steps for _, steps in res.schedule_changes] == [(4, 4), (3, 1)]


def test_equally_fast_ranks_are_snapped_before_the_exact_solver():
    times, cost = (0.100, 0.103, 0.4), 0.05
    # what measurement noise would cost unsnapped (tolerance 0.05 and spread bound 8: the example was built for them)
    assert solve_schedule(times, cost, max_spread=8, tolerance=0.05).local_steps == (8, 7, 2)
    pinned = OscarsPolicy(initial_step_times=times, initial_allreduce_s=cost, max_spread=8, tolerance=0.05)
    assert pinned.schedule.local_steps == (8, 8, 2)
    policy = OscarsPolicy()
    simulate_oscars(Cluster(times), 600, allreduce_s=cost, policy=policy)
    assert policy.schedule.step_times == pytest.approx(snap_step_times(times, 0.05)) == (0.103, 0.103, 0.4)
    assert policy.schedule.local_steps[0] == policy.schedule.local_steps[1]
    alg1 = OscarsPolicy(solver="alg1")  # Algorithm 1 sees the raw times, as in the strategy
    simulate_oscars(Cluster(times), 600, allreduce_s=cost, policy=alg1)
    assert alg1.schedule.step_times == times
    with pytest.raises(ValueError, match="solver"):
        OscarsPolicy(solver="nope")


def test_first_epoch_is_cut_once_the_first_schedule_is_solved():
    # The first epoch starts with units slots (speeds unknown); once solved it needs only the schedule's slots.
    # With expensive no-op slots, keeping the upper bound would cost (units - needed) x noop_s of padding.
    cluster = Cluster((0.01, 0.03), noop_s=0.05)
    policy = OscarsPolicy()
    res = simulate_oscars(
        cluster, 3 * 240, allreduce_s=0.0, policy=policy, units_per_epoch=240, record_batch_size=1, seed=0
    )
    first_epoch = [r for r in res.history if r["epoch"] == 0]
    # The time-boxed warm-up: 16 slots, the slow rank its 4 steps, the 3x faster one what it started meanwhile.
    warmup = res.history[0]["samples"]
    assert warmup[1] == 4 and 11 <= warmup[0] <= 13, warmup
    # Every unit once, and the epoch ended where its data ran out, well before the 240 slots it was sized for.
    assert sum(sum(r["samples"]) for r in first_epoch) == 240 and res.epoch_slots[0] == 240
    assert first_epoch[-1]["global_step"] < 0.8 * 240
    fixed = simulate_oscars(
        cluster, 240, allreduce_s=0.0, policy=OscarsPolicy(timed_warmup=False), record_batch_size=1, seed=0
    )
    assert fixed.history[0]["samples"] == [4, 4]
    lengths = np.diff([0.0, *res.epoch_end_s])
    assert lengths[0] < 1.2 * lengths[1:].mean()  # no tail of no-op slots


def test_the_simulated_ranks_report_what_the_round_controller_measures():
    # The simulator writes every rank's control data itself (one controller drives the fit); each row must be what
    # RoundController.contribution reports for a live rank that took the same steps at the same times.
    from simulated import SimClock, Time

    from benchmarks.simulator.engine import rank_reports
    from lightning_oscars import RoundController, SchedulePolicy
    from lightning_oscars.core.slots import SlotInfo

    rng = np.random.default_rng(3)
    draws = rng.lognormal(np.log(0.02), 0.3, size=(3, 9))
    real = np.zeros_like(draws, dtype=bool)
    real[0, :] = True  # every slot
    real[1, [0, 3, 6]] = True  # spread, as Round.real_offsets lays 3 steps over 9 slots
    # rank 2 takes no step
    noop = np.full(3, 0.001)
    expected = rank_reports(draws, real, real.sum(axis=1) * 4, real.sum(axis=1), 9, 0.0, np.zeros(3), noop)
    for rank in range(3):
        time = Time()
        controller = RoundController(SchedulePolicy(warmup_steps=2), 3, rank, clock=SimClock(time), now=time)
        controller.begin_fit()
        controller.plan_epoch(0, 9 + 3, 9)
        for slot in range(9):
            info = SlotInfo(bool(real[rank, slot]), 4 if real[rank, slot] else 0, 0.0)
            controller.begin_slot(info)
            time.now += draws[rank, slot] if info.real else noop[rank]
            controller.end_slot(slot, 1, 9)
        report = controller.contribution(global_step=9).report
        assert report.step_time == pytest.approx(expected[rank].step_time, rel=1e-12)
        assert report.error == pytest.approx(expected[rank].error, rel=1e-9, abs=1e-12)
        assert report.compute == pytest.approx(expected[rank].compute, rel=1e-12)
        assert (report.samples, report.units) == (expected[rank].samples, expected[rank].units)


def test_rounds_end_at_validations_instead_of_being_cut_by_them():
    # 2 ranks x 12 local steps, 256 units per epoch: 128 slots, validation every 32 slots. Rounds of 12 slots from
    # the epoch's start would put validations at 32 and 64 inside a round (an extra averaging each: 11 + 2 per
    # epoch); the plan ends rounds on them instead (12 + 10 + 10 before each): 12 averagings per epoch, all at ends.
    res = simulate(
        Cluster((0.01, 0.01)), FixedPolicy(12), 2 * 256, allreduce_s=0.001, units_per_epoch=256, val_check_interval=0.25
    )
    assert res.rounds == 2 * 12
    assert len(res.validation_s) == 8
    assert res.validation_s == pytest.approx([res.wall_s * k / 8 for k in range(1, 9)])  # every quarter: no cut
    aligned = simulate(
        Cluster((0.01, 0.01)), FixedPolicy(16), 2 * 256, allreduce_s=0.001, units_per_epoch=256, val_check_interval=0.25
    )
    assert aligned.rounds == 2 * 8 and len(aligned.validation_s) == 8
    ddp = simulate_bsp(Cluster((0.01, 0.01)), 2 * 256, allreduce_s=0.0, units_per_epoch=256, val_check_interval=0.25)
    assert ddp.validation_s == pytest.approx([0.01 * 32 * k for k in range(1, 9)])


@pytest.mark.parametrize("mix", MIXES)
def test_oscars_beats_bsp_and_local_sgd_on_heterogeneous_mixes(mix):
    times, _ = mix_step_times(mix, 16, 0.1)
    cluster = Cluster(times, noise=0.05)
    cost = ring_allreduce_time(16, 1e8, 1e10, 5e-6)
    bsp = simulate_bsp(cluster, 16 * 200, allreduce_s=cost, seed=1)
    local = simulate_local_sgd(cluster, 16 * 200, allreduce_s=cost, seed=1)
    oscars = simulate_oscars(cluster, 16 * 200, allreduce_s=cost, seed=1)
    assert oscars.throughput > 1.3 * bsp.throughput
    assert oscars.throughput > 1.3 * local.throughput
    assert oscars.utilization > bsp.utilization
    assert oscars.throughput <= cluster.ideal_throughput


def test_simulation_is_deterministic_given_a_seed():
    cluster = Cluster((0.1, 0.12, 0.3), noise=0.1, load=0.1, load_time_s=1.0)
    a = simulate_oscars(cluster, 600, allreduce_s=0.01, seed=7)
    b = simulate_oscars(cluster, 600, allreduce_s=0.01, seed=7)
    c = simulate_oscars(cluster, 600, allreduce_s=0.01, seed=8)
    assert a.wall_s == b.wall_s
    assert np.array_equal(a.compute_s, b.compute_s)
    assert a.schedule_changes == b.schedule_changes
    assert a.wall_s != c.wall_s


def test_noise_and_load_have_mean_one():
    res = simulate_local_sgd(Cluster((0.2,), noise=0.3), 20000, allreduce_s=0.0, period=16, seed=3)
    assert res.throughput == pytest.approx(5.0, rel=0.02)
    loaded = Cluster((0.2,), load=0.2)
    res = simulate_local_sgd(loaded, 16 * 2000, allreduce_s=0.0, period=16, seed=3, record_batch_size=1)
    assert res.throughput == pytest.approx(5.0, rel=0.03)
    # unlike per-step noise, the load moves a whole round: the rounds' mean step times spread by ~sigma
    per_round = np.log([r["compute_times"][0] / 16 for r in res.history])
    assert per_round.std() == pytest.approx(0.2, rel=0.1)
    with pytest.raises(ValueError, match="load"):
        Cluster((0.1,), load=-0.1)


def test_slowdown_profile_applies_from_its_start_time():
    cluster = Cluster((1.0,), slowdowns=(Slowdown(0, 10.0, 2.0),))
    res = simulate_bsp(cluster, 20, allreduce_s=0.0)
    assert res.wall_s == pytest.approx(10 * 1.0 + 10 * 2.0)


def test_oscars_rebalances_when_a_rank_slows_down():
    cluster = Cluster((0.1, 0.1), slowdowns=(Slowdown(1, 5.0, 3.0),))
    policy = OscarsPolicy()
    res = simulate_oscars(cluster, 2000, allreduce_s=0.0, policy=policy)
    assert res.schedule_changes[1][1] == (1, 1)  # first solve: equal speeds
    fast, slow = res.final_local_steps
    assert fast >= 3 * slow  # re-solved after the drift
    assert policy.solves >= 2


def test_epochs_follow_the_strategy_plan():
    cluster = Cluster((0.1, 0.3), noop_s=0.01)
    res = simulate(cluster, FixedPolicy(5), 3 * 23, allreduce_s=0.0, units_per_epoch=23, epoch_overhead_s=1.0)
    assert res.units == 69
    assert len(res.epoch_end_s) == 3
    # Per epoch: two rounds of (5, 5) steps (1.5 s each), then the 3 units left as (2, 1) steps: rank 1 takes
    # 0.3 s plus one no-op slot; then 1 s of epoch turnover.
    per_epoch = 2 * 1.5 + (0.3 + 0.01) + 1.0
    assert res.epoch_end_s == pytest.approx([per_epoch * k for k in (1, 2, 3)])
    even = simulate(cluster, FixedPolicy(5), 3 * 23, allreduce_s=0.0, units_per_epoch=23, planned=False)
    assert even.units == 69 and even.rounds == 3 * 3


def test_fit_to_remaining_and_row_medians():
    cut = _fit_to_remaining(np.array([10, 5, 1]), 8)
    assert cut.sum() == 8 and list(cut) == [5, 3, 0]
    assert list(_fit_to_remaining(np.array([2, 2]), 9)) == [2, 2]
    rng = np.random.default_rng(0)
    draws = rng.random((4, 6))
    steps = np.array([6, 3, 1, 0])
    med = _row_medians(draws, steps)
    assert med[:3] == pytest.approx([np.median(draws[0]), np.median(draws[1, :3]), draws[2, 0]])
    assert np.isnan(med[3])


def test_mixes():
    times, classes = mix_step_times("generations", 8, 0.1)
    assert sorted(times) == pytest.approx([0.1] * 4 + [0.25] * 4)
    times, classes = mix_step_times("stragglers", 8, 0.1)
    assert classes.count("0.2x") == 1 and max(times) == pytest.approx(0.5)
    _, classes = mix_step_times("generations+stragglers", 1024, 0.1)
    assert classes.count("0.2x") == 51 and classes.count("0.4x") == 512
    with pytest.raises(ValueError):
        mix_step_times("nope", 8, 0.1)


def test_fit_round_costs_recovers_noop_and_overhead():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(60):
        compute = rng.uniform(0.04, 0.06, 2)
        noops = np.array([0.0, float(rng.integers(0, 6))])
        rows.append((float((compute + 0.0015 * noops).max() - compute.max() + 0.003), compute, noops))
    noop, overhead = fit_round_costs(rows)
    assert noop == pytest.approx(0.0015, abs=1e-4) and overhead == pytest.approx(0.003, abs=1e-4)
    assert fit_round_costs(rows[:3]) is None


def test_profile_specs():
    assert parse_profile("1:3") == {1: [(0.0, 3.0)]}
    assert parse_profile("1:3@0,1@3;0:1@0,3@3") == {1: [(0.0, 3.0), (3.0, 1.0)], 0: [(0.0, 1.0), (3.0, 3.0)]}
    assert parse_slowdown("1:3", 2) == (1.0, 3.0)
    assert parse_slowdown("1:1@0,3@10", 2) == (1.0, 3.0)
    assert parse_slowdown("1:1@0,3@10", 2, at_s=0.0) == (1.0, 1.0)
    assert parse_slowdown({"2": 4}, 3) == (1.0, 1.0, 4.0)
    assert parse_slowdown("", 2) == (1.0, 1.0)


# ---------------------------------------------------------------------------------------------- validation

# What the fake benchmark is generated with, and what the validation must find again.
TRUTH = {
    "step_s": 0.008,  # 1x step as the strategy measures it (Lightning and data loading included)
    "solo_s": 0.004,  # a k-x rank adds (k-1) x this
    "allreduce_s": 0.004,
    "noop_s": 0.0012,
    "round_overhead_s": 0.002,
    "first_step_s": 0.3,
    "epoch_overhead_s": 0.02,
    "ddp_overhead_s": 0.003,
    "load": 0.1,
    "load_time_s": 0.2,
}
PROFILE_SPECS = {"homogeneous": "", "1x/3x": "1:3", "volatile": "1:3@0,1@1.5;0:1@0,3@1.5"}
CONFIGS = {"ddp": "ddp", "local_sgd": "local_sgd", "oscars-exact-uniform": "oscars"}


def _truth_inputs(spec: str, samples: int) -> ValidationInputs:
    t = lambda k: TRUTH["step_s"] + (k - 1.0) * TRUTH["solo_s"]  # noqa: E731
    factors = parse_slowdown(spec, 2, at_s=0.0)
    events = tuple((r, s, t(k)) for r, entries in parse_profile(spec).items() for s, k in entries if s > 0)
    return ValidationInputs(
        profile="",
        spec=spec,
        step_times=tuple(t(k) for k in factors),
        allreduce_s=TRUTH["allreduce_s"],
        ddp_overhead_s=TRUTH["ddp_overhead_s"],
        events=events,
        factors=factors,
        noop_s=TRUTH["noop_s"],
        round_overhead_s=TRUTH["round_overhead_s"],
        first_step_s=TRUTH["first_step_s"],
        epoch_overhead_s=TRUTH["epoch_overhead_s"],
        load=(TRUTH["load"],) * 2,
        load_time_s=TRUTH["load_time_s"],
        samples=samples,
        noise=0.1,
    )


def _fake_results(path: Path, repeats: int = 2, samples: int = 16384, with_history: bool = True) -> Path:
    """A benchmarks.heterogeneous JSON whose runs the simulator made from TRUTH (histories as the strategy's)."""
    profiles = {}
    for p, (profile, spec) in enumerate(PROFILE_SPECS.items()):
        truth = _truth_inputs(spec, samples)
        configs = {}
        for c, (name, paradigm) in enumerate(CONFIGS.items()):
            runs = []
            for rep in range(repeats):
                res = simulate_config(truth, paradigm, seed=1000 + 100 * p + 10 * c + rep, record_batch_size=64)
                run = {
                    "strategy": name,
                    "epochs": truth.epochs,
                    "train_wall_s": res.wall_s,
                    "samples": float(samples),
                    "samples_per_s": samples / res.wall_s,
                    "curve": [[t, 0.1, 0.9] for t in res.validation_s],
                    "rounds": 0 if name == "ddp" else len(res.history),
                    "schedule": None if name == "ddp" else list(res.final_local_steps),
                    "cluster": [{"solo_step_s": TRUTH["solo_s"], "start_factor": k} for k in truth.factors],
                }
                if name != "ddp":
                    history = res.history if with_history else []
                    run.update(history=history, step_time_s=list(truth.step_times), allreduce_s=truth.allreduce_s)
                runs.append(run)
            walls = sorted(r["train_wall_s"] for r in runs)
            configs[name] = {
                "median_train_wall_s": float(np.median(walls)),
                "median_samples_per_s": float(np.median([r["samples_per_s"] for r in runs])),
                "schedule": runs[-1]["schedule"],
                "runs": runs,
            }
        profiles[profile] = {"base_step_s": TRUTH["step_s"], "target_acc": 0.9, "configs": configs}
    data = {"meta": {"repeats": repeats, "epochs": 4, "ranks": 2, "profiles": PROFILE_SPECS}, "profiles": profiles}
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def fake_results(tmp_path_factory):
    return _fake_results(tmp_path_factory.mktemp("bench") / "heterogeneous.json")


def test_validation_recovers_the_inputs_it_was_generated_with(fake_results):
    results = json.loads(fake_results.read_text())
    machine = machine_inputs(results, {"seeds": 2})
    assert machine["samples"] == 16384 and machine["epochs"] == 4 and machine["val_check_interval"] == 0.25
    assert machine["noop_s"] == pytest.approx(TRUTH["noop_s"], abs=2e-4)
    assert machine["round_overhead_s"] == pytest.approx(TRUTH["round_overhead_s"], abs=3e-4)
    assert machine["first_step_s"] == pytest.approx(TRUTH["first_step_s"], rel=0.15)
    assert machine["epoch_overhead_s"] == pytest.approx(TRUTH["epoch_overhead_s"], abs=0.015)
    assert machine["ddp_overhead_s"] == pytest.approx(TRUTH["ddp_overhead_s"], abs=1e-3)
    assert 0.02 < machine["load_time_s"] < 2.0
    assert machine["sources"]["ddp_overhead_s"] == "fit to the homogeneous ddp runs"
    steady = validation_inputs(results, "1x/3x", machine, config="oscars-exact-uniform")
    # The load (sigma 0.1, correlated over 0.2 s) leaves ~3% standard error on the median of two runs (4% on one:
    # 40 seeds of the 1x/3x oscars run measured 0.00803 +- 0.00033 s for the 8 ms rank): 10% is over 3 of them.
    assert steady.step_times == pytest.approx((0.008, 0.016), rel=0.10)
    assert steady.allreduce_s == pytest.approx(TRUTH["allreduce_s"])
    assert steady.load == pytest.approx((0.1, 0.1), abs=0.04)
    assert steady.sources["step_times"] == "own runs"
    swap = validation_inputs(results, "volatile", machine, config="oscars-exact-uniform")
    # rank 0 is 1x for the first 1.5 s only, rank 1 3x: few rounds per regime, hence the looser tolerance
    assert swap.step_times == pytest.approx((0.008, 0.016), rel=0.12)
    assert [(r, s) for r, s, t in swap.events] == [(1, 1.5), (0, 1.5)]
    assert [t for *_, t in swap.events] == pytest.approx([0.008, 0.016], rel=0.12)
    assert swap.sources["step_times"].startswith("own runs, rounds split by speed regime")
    # ddp has no step times of its own: the strategy runs', its emulated sleep re-scaled to its calibration
    ddp = validation_inputs(results, "1x/3x", machine, config="ddp")
    assert ddp.step_times == pytest.approx((0.008, 0.016), rel=0.08)
    for run in results["profiles"]["1x/3x"]["configs"]["ddp"]["runs"]:
        run["cluster"][1]["solo_step_s"] += 0.001
    slower = validation_inputs(results, "1x/3x", machine, config="ddp")
    assert slower.step_times[0] == ddp.step_times[0]
    assert slower.step_times[1] == pytest.approx(ddp.step_times[1] + 2 * 0.001)


def test_validation_predicts_the_generated_runs(fake_results, tmp_path):
    report = validate_against(fake_results, {"seeds": 2})
    assert set(report["profiles"]) == set(PROFILE_SPECS)
    for profile in report["profiles"].values():
        assert {r["config"] for r in profile["rows"]} == set(CONFIGS)
        for row in profile["rows"]:
            # The inputs recovered from two noisy runs are off by up to ~9% (see the test above): so is the prediction.
            assert abs(row["error"]["train_s"]) < 0.10, (profile["spec"], row["config"], row["error"])
            assert row["error"]["samples_per_s"] == pytest.approx(1 / (1 + row["error"]["train_s"]) - 1, abs=0.02)
        assert profile["speedup_vs_ddp"]["oscars-exact-uniform"]["error"] == pytest.approx(0.0, abs=0.1)
    assert report["max_abs_train_error"] < 0.10
    subset = validate_against(fake_results, {"seeds": 1, "profiles": ["1x/3x"], "noop_s": 0.0})
    assert list(subset["profiles"]) == ["1x/3x"] and subset["sources"]["noop_s"] == "cli"


def test_validation_without_histories_and_of_the_old_format(tmp_path):
    path = _fake_results(tmp_path / "r.json", repeats=1, samples=8192, with_history=False)
    results = json.loads(path.read_text())
    del results["profiles"]["homogeneous"], results["profiles"]["volatile"]
    path.write_text(json.dumps(results))
    machine = machine_inputs(results, {"seeds": 1})
    assert machine["sources"]["noop_s"].startswith("default")
    assert machine["sources"]["first_step_s"].startswith("ddp's first validation")
    assert machine["ddp_overhead_s"] is None
    report = validate_against(path, {"seeds": 1})
    rows = {r["config"]: r for r in report["profiles"]["1x/3x"]["rows"]}
    assert rows["local_sgd"]["inputs"]["step_times"] == pytest.approx([0.008, 0.016])
    assert abs(rows["ddp"]["error"]["train_s"]) < 0.05  # fitted to itself
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"ddp": {"runs": []}, "oscars": {"runs": []}}))
    with pytest.raises(ValueError, match="profiles"):
        validate_against(old)


def test_cli_writes_json_markdown_and_plot(fake_results, tmp_path):
    out = tmp_path / "out"
    argv = ["--validate", str(fake_results), "--out", str(out), "--ranks", "8,16", "--steps-per-rank", "40"]
    report = main([*argv, "--val-seeds", "1", "--profiles", "homogeneous,1x/3x"])
    assert {p.name for p in out.iterdir()} == {"simulator.json", "simulator.md", "simulator.png"}
    saved = json.loads((out / "simulator.json").read_text())
    assert len(saved["scaling"]["rows"]) == 2 * len(MIXES)
    assert saved["validation"]["sensitivity"]["profile"] == "1x/3x"
    assert set(saved["validation"]["profiles"]) == {"homogeneous", "1x/3x"}
    text = (out / "simulator.md").read_text()
    assert "## Validation" in text and "### 1x/3x" in text and "### stragglers" in text and "Sensitivity" in text
    first = report["scaling"]["rows"][0]
    assert first["oscars"]["fraction_of_ideal"] > first["bsp"]["fraction_of_ideal"]
    assert math.isfinite(first["oscars_oracle"]["throughput"])


def test_deadline_round_steps_while_the_quantile_fits():
    from benchmarks.simulator.jitter import deadline_steps

    times = np.array([1.0, 3.0])
    draws = np.array([[1.0, 1.2, 0.9, 1.0, 1.0], [3.0, 3.5, 3.0, 3.0, 3.0]])
    # sigma 0: the quantile is the mean. Rank 0 starts steps at 0, 1, 2.2, 3.1 (3.1 + 1 > 4: stops after 3 steps,
    # ending at 3.1); rank 1 always takes its first step, and its second (start 3 + 3 > 4) not.
    steps, finish = deadline_steps(draws, times, deadline=4.0, sigma=0.0, quantile=0.9, cap=5)
    assert steps.tolist() == [3, 1] and finish.tolist() == pytest.approx([3.1, 3.0])
    steps, _ = deadline_steps(draws, times, deadline=100.0, sigma=0.0, quantile=0.9, cap=5)
    assert steps.tolist() == [5, 5]  # never beyond the round's slots


def test_deadline_rounds_beat_a_fixed_tau_under_jitter_at_scale():
    from benchmarks.simulator.jitter import jitter_study

    rows = jitter_study(n=256, sigmas=(0.0, 0.15), caps=(32,), rounds=12)
    calm, noisy = rows
    assert calm["fixed_fraction"] > 0.95 and calm["deadline_fraction"] > 0.95  # no jitter: both near ideal
    # a fixed tau waits for the slowest of 256 jittered sums; deadline rounds lose a fraction of a step per rank
    assert noisy["fixed_fraction"] < 0.87 and noisy["deadline_fraction"] > noisy["fixed_fraction"] + 0.07
