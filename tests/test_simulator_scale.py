"""Ripples in the discrete-event simulator (``benchmarks.simulator.ripples``) and the paradigms-at-scale study
(``benchmarks.simulator.scale_paradigms``): the protocol of ``test_groups.drive``, waits where groups wait, smart
groups around a slow worker, the study's fast staleness rules against the originals, and its table. Small N: fast."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from test_groups import drive  # noqa: E402

from benchmarks.simulator.cluster import Cluster  # noqa: E402
from benchmarks.simulator.engine import simulate_bsp  # noqa: E402
from benchmarks.simulator.ripples import log_scaled_exchange, simulate_ripples  # noqa: E402
from benchmarks.simulator.scale_paradigms import (  # noqa: E402
    CLUSTERS,
    PARADIGMS,
    ScaleConfig,
    StepDraws,
    Windowed,
    _FastASP,
    _FastDASP,
    _FastDSSP,
    _FastSSP,
    cluster_times,
    main,
    markdown,
    scale_study,
)
from benchmarks.simulator.server import simulate_paradigm  # noqa: E402
from lightning_oscars.core.groups import GroupBoard  # noqa: E402
from lightning_oscars.core.staleness import ASP, DASP, DSSP, SSP  # noqa: E402


@pytest.mark.parametrize("generator", ["static", "random", "smart"])
def test_ripples_follows_the_protocol_of_the_group_tests(generator):
    """Same step times as ``drive`` (its uniform draws, in its order): the board makes the same groups, and every
    worker performs the same number of exchanges."""
    for seed in range(12):
        rng = random.Random(seed)
        n = rng.randint(2, 8)
        speeds = [rng.choice([1.0, 1.0, 2.0, 5.0]) * 0.01 for _ in range(n)]
        size, buffer = rng.randint(2, n + 1), rng.randint(1, 3)
        board = GroupBoard(n, group_size=size, generator=generator, buffer_size=buffer, seed=seed)
        sequence, _, done, _ = drive(board, speeds, steps=25, seed=seed)
        draw = random.Random(seed)
        run = simulate_ripples(
            lambda w, i, now, speeds=speeds, draw=draw: speeds[w] * draw.uniform(0.8, 1.2),
            n,
            iterations=25,
            group_size=size,
            generator=generator,
            buffer_size=buffer,
            seed=seed,
        )
        assert run.made == board.history
        assert run.groups == [sum(len(g) > 1 for g in seq) for seq in sequence]
        assert run.iterations == done
        # every group of two or more was performed by each of its members: the drain left nothing behind
        assert sum(run.groups) == sum(len(g) for g in run.made)


def test_static_groups_on_a_homogeneous_cluster_hardly_wait():
    n, step, exchange = 16, 0.1, 0.002
    run = simulate_ripples([step] * n, duration_s=30.0, warmup_s=5.0, generator="static", exchange_s=exchange)
    assert run.idle_fraction < 0.01
    ideal = n / (step + exchange)  # every step followed by one exchange, nobody waiting
    assert run.updates_per_s == pytest.approx(ideal, rel=0.02)
    assert min(run.groups) > 0.9 * 25.0 / (step + exchange)  # one exchange per step, with others
    # the window's accounting adds up: busy + exchange + waiting = the window, per worker
    for i in range(n):
        assert run.busy_s[i] + run.exchange_s[i] + run.waited_s[i] == pytest.approx(run.window_s)


@pytest.mark.parametrize("warm", [False, True])
def test_smart_groups_beat_random_groups_and_the_allreduce_with_one_slow_worker(warm):
    n, step, allreduce = 8, 0.1, 0.02
    times = [step] * (n - 1) + [5 * step]
    draws = StepDraws(times, 0.05, seed=3)
    exchange = log_scaled_exchange(allreduce, n)
    kw = dict(duration_s=40.0, warmup_s=10.0, exchange_s=exchange, slow=[n - 1], warm_start=warm)
    if warm:
        kw["paces"] = times
    runs = {g: simulate_ripples(draws, n, generator=g, seed=1, **kw) for g in ("random", "smart")}
    bsp = simulate_bsp(Cluster(tuple(times), noise=0.05), n * 300, allreduce_s=allreduce, seed=3)
    smart, rand = runs["smart"], runs["random"]
    assert smart.updates_per_s > 1.5 * rand.updates_per_s
    assert smart.updates_per_s > 1.5 * bsp.throughput
    assert smart.idle_fraction < rand.idle_fraction / 2
    # fast workers meet the slow one less often, but it is not cut off: it still averages with them
    fast = range(n - 1)
    share = {g: sum(r.slow_groups[i] for i in fast) / sum(r.groups[i] for i in fast) for g, r in runs.items()}
    assert share["smart"] < share["random"]
    assert smart.groups[n - 1] > 0


def test_the_log_scaled_exchange_charges_a_share_of_the_allreduce():
    cost = log_scaled_exchange(0.02, 1024)
    assert cost(1) == 0.0
    assert cost(1024) == pytest.approx(0.02)
    assert 0 < cost(2) < cost(4) < cost(1024)
    assert log_scaled_exchange(0.02, 1)(4) == 0.0


def test_ripples_rejects_ambiguous_runs():
    with pytest.raises(ValueError, match="exactly one"):
        simulate_ripples([0.1, 0.1], iterations=5, duration_s=1.0)
    with pytest.raises(ValueError, match="world_size"):
        simulate_ripples(lambda w, i, now: 0.1, iterations=5)
    with pytest.raises(ValueError, match="warm_start"):
        simulate_ripples([0.1, 0.1], iterations=5, paces=[0.1, 0.1])


@pytest.mark.parametrize(
    ("original", "fast"),
    [
        (ASP, _FastASP),
        (lambda: SSP(0), lambda: _FastSSP(0)),
        (lambda: SSP(2), lambda: _FastSSP(2)),
        (lambda: DSSP(1, 6), lambda: _FastDSSP(1, 6)),
        (DASP, _FastDASP),
        (lambda: DASP(1.3, 1.1, 1), lambda: _FastDASP(1.3, 1.1, 1)),
    ],
    ids=["asp", "bsp", "ssp2", "dssp", "dasp", "dasp-eager"],
)
def test_the_studys_fast_rules_decide_as_the_rules_do(original, fast):
    """Same runs, update for update, on random clusters where a worker turns 3x slower for a while (DASP moves
    workers, DSSP grants extra iterations)."""
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(2, 8)
        base = [rng.choice([0.01, 0.01, 0.02, 0.05]) for _ in range(n)]

        def step(worker, iteration, now, base=base, seed=seed):
            slow = 3.0 if worker == 0 and 1.0 < now < 2.0 else 1.0
            return base[worker] * slow * random.Random(hash((seed, worker, iteration))).lognormvariate(0.0, 0.3)

        a = simulate_paradigm(original(), step, 4.0, push_s=0.001, world_size=n)
        b = simulate_paradigm(Windowed(fast(), 1.0, 4.0), step, 4.0, push_s=0.001, world_size=n)
        assert (a.iterations, a.staleness, a.waited_s) == (b.iterations, b.staleness, b.waited_s)
        assert a.switches == b.switches


def test_the_windowed_rule_counts_the_window_only():
    times = [0.01, 0.01, 0.05]
    rule = Windowed(_FastSSP(2), 1.0, 3.0)
    run = simulate_paradigm(rule, times, 3.0, world_size=3)
    assert rule.before + rule.pushes == sum(run.iterations)
    # SSP's steady state: everybody at the slow worker's pace (bursts aligned on its pushes)
    assert rule.throughput() == pytest.approx(3 / 0.05, rel=0.05)
    assert 0.5 < rule.idle(3) < 1.0  # the two fast workers wait for most of the slow one's step


def test_clusters_have_the_named_speed_mixes():
    mixed = cluster_times("mixed", 1024, 0.1)
    assert sorted(set(mixed.round(6))) == [0.1, 0.25, 0.5]
    assert (mixed == 0.5).sum() == round(0.05 * 1024)
    one = cluster_times("one_in_16", 64, 0.1)
    assert (one == 0.5).sum() == 4 and one[15] == 0.5
    with pytest.raises(ValueError, match="unknown cluster"):
        cluster_times("nope", 8, 0.1)


def test_step_draws_do_not_depend_on_the_order_they_are_asked_in():
    a, b = StepDraws([0.1, 0.2], 0.05, seed=4), StepDraws([0.1, 0.2], 0.05, seed=4)
    forward = [a(w, i, 0.0) for w in range(2) for i in range(300)]
    backward = [b(w, i, 0.0) for w in (1, 0) for i in reversed(range(300))]
    assert forward == [b(w, i, 0.0) for w in range(2) for i in range(300)]
    assert len(set(backward)) == len(backward)
    assert StepDraws([0.1], 0.05, seed=5)(0, 0, 0.0) != forward[0]


def _tiny(n: int = 16) -> ScaleConfig:
    windows = {"sync": (2.0, 8.0), "ps": (2.0, 6.0), "ripples": (3.0, 8.0)}
    return ScaleConfig(ranks=(n,), seeds=(0, 1), windows=lambda n: windows)


def test_the_scale_study_has_a_row_for_every_configuration():
    cfg = _tiny()
    rows = scale_study(cfg)
    assert {(r["cluster"], r["paradigm"]) for r in rows} == {(c, p) for c in CLUSTERS for p in PARADIGMS}
    assert len(rows) == len(CLUSTERS) * len(PARADIGMS)
    for r in rows:
        assert r["throughput"] > 0 and 0 <= r["idle"] < 1 and len(r["seeds"]) == 2
        assert r["of_ideal"] < 1.05  # nobody beats the cluster's solo throughput (window edges aside)
        if r["paradigm"] == "ddp":
            assert r["vs_ddp"] == 1.0
    by = {(r["cluster"], r["paradigm"]): r for r in rows}
    # a persistently slow class holds ddp back, not ASP (which never waits) nor oscars
    assert by["one_in_16", "asp"]["vs_ddp"] > 1.5 and by["one_in_16", "oscars"]["vs_ddp"] > 1.5
    assert by["one_in_16", "asp"]["idle"] == 0.0
    assert all("staleness_mean" in by[c, p] for c in CLUSTERS for p in ("asp", "ssp3", "ssp15", "dssp", "dasp"))
    assert by["one_in_16", "ripples_smart"]["slow_group_share"] < by["one_in_16", "ripples_random"]["slow_group_share"]
    text = markdown(rows, cfg)
    assert all(p in text for p in PARADIGMS) and "16 ranks" in text and "not convergence" in text
    json.dumps(rows)


def test_main_writes_the_markdown_and_the_json(tmp_path, capsys):
    out = tmp_path / "paradigms"
    main(["--out", str(out), "--ranks", "16", "--seeds", "0", "--clusters", "one_in_16"])
    payload = json.loads(out.with_suffix(".json").read_text())
    assert {r["paradigm"] for r in payload["rows"]} == set(PARADIGMS)
    assert payload["cold_start"]["16"]["ripples_static"] > 0
    report = out.with_suffix(".md").read_text()
    assert "| ripples_smart |" in report and "cold board" in report


def test_sharded_replicas_at_scale_hold_a_kth_of_the_state_and_beat_a_fixed_sync_period():
    from benchmarks.simulator.sharded import ShardedCluster, sharded_row

    cluster = ShardedCluster(4, mix="generations")
    row = sharded_row(cluster, steps_per_replica=60)
    assert row["memory_gb_sharded"] == pytest.approx(row["memory_gb_ddp_replica"] / 8) == pytest.approx(14.0)
    assert row["shard_averaging_ms"] < row["ddp_replica_averaging_ms"], "a GPU sends 1/k of the model, nothing inside"
    # Half the nodes at 0.4x: a fixed sync period holds the fast nodes to the slow ones' pace (about 0.57 of ideal
    # at best), balanced rounds do not.
    assert row["fixed sync_every (torchft-style)"] < 0.6 < row["oscars, sharded replicas"]
