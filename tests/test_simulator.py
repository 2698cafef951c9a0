"""Unit tests of the cluster simulator (benchmarks/simulator.py): closed-form cases it must reproduce exactly,
the mechanisms copied from the strategy, and the validation / CLI plumbing. Fast: no torch.distributed."""

import json
import statistics
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
    _fit_to_remaining,
    _row_medians,
    main,
    mix_step_times,
    parse_slowdown,
    ring_allreduce_time,
    simulate,
    simulate_bsp,
    simulate_local_sgd,
    simulate_oscars,
    validate_against,
    validation_inputs,
)
from lightning_oscars.solver import solve_schedule  # noqa: E402


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
    res = simulate_local_sgd(Cluster((1.0, 2.0)), 2 * 8 * 5, allreduce_s=1.0, period=8)
    assert res.rounds == 5
    assert res.wall_s == pytest.approx(5 * (16.0 + 1.0))
    assert res.idle_fraction[0] == pytest.approx(8.0 / 17.0)


def test_noise_free_oscars_matches_the_solver_prediction():
    times, cost = (0.1, 0.1, 0.25, 0.5), 0.02
    schedule = solve_schedule(times, cost)
    policy = OscarsPolicy(initial_step_times=times, initial_allreduce_s=cost)
    res = simulate_oscars(Cluster(times), 40 * sum(schedule.local_steps), allreduce_s=cost, policy=policy)
    assert res.final_local_steps == schedule.local_steps
    assert res.throughput == pytest.approx(schedule.throughput, rel=1e-9)
    assert res.round_utilization == pytest.approx(schedule.utilization, rel=1e-9)


def test_oscars_first_solve_sees_no_allreduce_cost_like_the_strategy():
    # The strategy's first averaging carries no all-reduce time yet, so the first schedule is solved at cost 0.
    policy = OscarsPolicy()
    simulate_oscars(Cluster((0.1, 0.3), noise=0.0), 200, allreduce_s=0.05, policy=policy)
    assert policy.solves == 1
    assert policy.schedule is not None and policy.schedule.allreduce_time == 0.0
    assert policy.schedule.local_steps == solve_schedule((0.1, 0.3), 0.0).local_steps


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
    cluster = Cluster((0.1, 0.12, 0.3), noise=0.1)
    a = simulate_oscars(cluster, 600, allreduce_s=0.01, seed=7)
    b = simulate_oscars(cluster, 600, allreduce_s=0.01, seed=7)
    c = simulate_oscars(cluster, 600, allreduce_s=0.01, seed=8)
    assert a.wall_s == b.wall_s
    assert np.array_equal(a.compute_s, b.compute_s)
    assert a.schedule_changes == b.schedule_changes
    assert a.wall_s != c.wall_s


def test_noise_has_mean_one():
    res = simulate_local_sgd(Cluster((0.2,), noise=0.3), 20000, allreduce_s=0.0, period=16, seed=3)
    assert res.throughput == pytest.approx(5.0, rel=0.02)


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


def test_epochs_cut_rounds_and_pad_the_first_epoch():
    cluster = Cluster((0.1, 0.3), noop_s=0.01)
    res = simulate(
        cluster,
        FixedPolicy(5),
        3 * 23,
        allreduce_s=0.0,
        units_per_epoch=23,
        epoch_overhead_s=1.0,
        first_epoch_slots=30,
    )
    assert res.units == 69
    assert len(res.epoch_end_s) == 3
    # Per epoch: two rounds of (5, 5) steps (1.5 s each), then the 3 units left as (2, 1) steps: rank 1 takes
    # 0.3 s plus one no-op slot; then 1 s of validation. The first epoch used 12 slots and pads to 30.
    per_epoch = 2 * 1.5 + (0.3 + 0.01) + 1.0
    assert res.epoch_end_s[0] == pytest.approx(per_epoch + 18 * 0.01)
    assert res.wall_s == pytest.approx(3 * per_epoch + 18 * 0.01)


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


def _fake_results(tmp_path: Path, extra: dict) -> Path:
    def run(strategy, wall, curve_end, schedule=None, util=None):
        return {
            "strategy": strategy,
            "wall_s": wall,
            "curve": [[curve_end * (i + 1) / 4, 0.1, 0.9] for i in range(4)],
            "samples": 65536,
            "schedule": schedule,
            "mean_utilization": util,
            **extra,
        }

    data = {
        "ddp": {"median_wall_s": 21.0, "median_samples_per_s": 3120.0, "runs": [run("ddp", 21.0, 18.3)]},
        "oscars": {
            "median_wall_s": 8.3,
            "median_samples_per_s": 7900.0,
            "runs": [run("oscars", 8.3, 5.1, [7, 2], 0.84)],
        },
    }
    path = tmp_path / "heterogeneous.json"
    path.write_text(json.dumps(data))
    return path


def test_validation_reads_optional_fields_and_cli_overrides(tmp_path):
    path = _fake_results(tmp_path, {"step_time_s": [0.004, 0.011], "allreduce_s": 0.002})
    results = json.loads(path.read_text())
    inputs = validation_inputs(results, {})
    assert inputs.step_times == (0.004, 0.011)
    assert inputs.sources["step_times"] == "json" and inputs.sources["ddp_overhead_s"] == "default"
    assert inputs.startup_s == pytest.approx(statistics.median([21.0 - 18.3, 8.3 - 5.1]))
    override = validation_inputs(results, {"step_times": 0.002, "allreduce_s": 0.001})
    assert override.step_times == pytest.approx((0.002, 0.006))  # a scalar is the unslowed time, x slowdown 1:3
    assert override.sources["allreduce_s"] == "cli"

    report = validate_against(path, {"seeds": 2})
    rows = {r["strategy"]: r for r in report["rows"]}
    assert set(rows) == {"ddp", "oscars"}
    assert rows["oscars"]["measured"]["train_s"] == pytest.approx(5.1)
    assert rows["oscars"]["measured"]["first_epoch_s"] == pytest.approx(5.1 / 4)
    assert rows["oscars"]["measured"]["steady_epoch_s"] == pytest.approx(5.1 / 4)
    assert len(rows["oscars"]["predicted"]["epoch_end_s"]) == 4
    assert rows["oscars"]["error"]["train_s"] == pytest.approx(rows["oscars"]["predicted"]["train_s"] / 5.1 - 1)
    assert report["speedup_vs_ddp"]["wall_s"]["predicted"] > 1.0


def test_cli_writes_json_markdown_and_plot(tmp_path):
    path = _fake_results(tmp_path, {})
    out = tmp_path / "out"
    report = main(
        ["--validate", str(path), "--out", str(out), "--ranks", "8,16", "--steps-per-rank", "40", "--val-seeds", "1"]
    )
    assert {p.name for p in out.iterdir()} == {"simulator.json", "simulator.md", "simulator.png"}
    saved = json.loads((out / "simulator.json").read_text())
    assert len(saved["scaling"]["rows"]) == 2 * len(MIXES)
    assert saved["validation"]["sources"]["step_times"] == "default"
    text = (out / "simulator.md").read_text()
    assert "## Validation" in text and "### stragglers" in text
    first = report["scaling"]["rows"][0]
    assert first["oscars"]["fraction_of_ideal"] > first["bsp"]["fraction_of_ideal"]


def test_slowdown_specs_and_malformed_runs_are_tolerated(tmp_path):
    assert parse_slowdown("1:3", 2) == (1.0, 3.0)
    assert parse_slowdown("1:1@0,3@10", 2) == (1.0, 3.0)
    assert parse_slowdown({"2": 4}, 3) == (1.0, 1.0, 4.0)
    results = {
        "ddp": {"median_wall_s": 20.0, "runs": [{"curve": "broken"}, {"wall_s": 20.0}]},
        "oscars": {"runs": [{"curve": [[1.0, 0.1, 0.9], [2.0, 0.1, 0.9]], "wall_s": 5.0, "samples": 32768}]},
        "setup": {"slowdown": "1:2", "step_time_s": 0.01},
    }
    inputs = validation_inputs(results, {})
    assert inputs.step_times == pytest.approx((0.01, 0.02))
    assert inputs.epochs == 2 and inputs.samples == 32768 and inputs.startup_s == pytest.approx(3.0)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    rows = {r["strategy"]: r for r in validate_against(path, {"seeds": 1})["rows"]}
    assert rows["ddp"]["measured"]["train_s"] is None and rows["ddp"]["error"]["train_s"] is None
    assert rows["ddp"]["error"]["wall_s"] is not None
