"""The peers benchmark's plumbing: the emulated device every configuration shares, the summary the reports read,
and a real 2-rank plain-loop run of torch's model averager and of a plain DDP loop (torchft's runs only when
torchft is installed: it is in the ``bench`` extra, not the test one)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import benchmarks.task as task  # noqa: E402
from benchmarks.peers import _rank_key, peer_summary, run_peer  # noqa: E402
from benchmarks.task import EmulatedDevice  # noqa: E402

TINY = ["--step-ms", "5", "--hidden", "32", "--n-train", "1024", "--val-check-interval", "0.5"]


@pytest.fixture
def sleeps(monkeypatch):
    """The delays the emulated device asks for, instead of sleeping them."""
    asked: list[float] = []
    monkeypatch.setattr(task.time, "sleep", asked.append)
    return asked


def test_a_k_times_slower_rank_sleeps_k_minus_one_device_times_more(sleeps):
    fast = EmulatedDevice(0, slowdown="1:3", step_ms=30)
    slow = EmulatedDevice(1, slowdown="1:3", step_ms=30)
    for device in (fast, slow):
        device.solo_step_s = 0.032  # 2 ms of compute beside the 30 ms sleep
        device.step(elapsed=0.0)
    assert sleeps == pytest.approx([0.030, 0.030 + 2 * 0.032])
    assert (fast.real_steps, slow.real_steps) == (1, 1)
    assert slow.busy_s == pytest.approx(3 * fast.busy_s)


def test_a_volatile_profile_changes_the_factor_at_its_time(sleeps):
    device = EmulatedDevice(0, slowdown="0:1@0,3@2")
    device.solo_step_s = 0.01
    device.step(elapsed=1.0)
    device.step(elapsed=2.5)
    assert sleeps == pytest.approx([0.02])  # 1x with no regime sleep: nothing to sleep
    assert device.busy_s == pytest.approx(0.01 + 0.03)


def test_jitter_keeps_the_mean_step_and_spreads_it(sleeps):
    device = EmulatedDevice(0, step_ms=30, jitter=0.3)
    device.solo_step_s = 0.03
    for _ in range(4000):
        device.step(elapsed=0.0)
    mean = sum(sleeps) / len(sleeps)
    spread = math.sqrt(sum((s - mean) ** 2 for s in sleeps) / len(sleeps))
    assert mean == pytest.approx(0.03, rel=0.03)
    assert spread == pytest.approx(0.03 * math.sqrt(math.exp(0.3**2) - 1.0), rel=0.1)


def test_peer_summary_counts_every_rank_and_takes_the_slowest_wall():
    ranks = [
        {
            "wall_s": 2.0,
            "curve": [(1.0, 0.0, 0.5), (2.0, 0.0, 0.8)],
            "syncs": 4,
            "sync_s": 1.5,
            "solo_step_s": 0.03,
            "start_factor": 1.0,
            "real_steps": 16,
            "busy_s": 0.48,
            "param_checksum": 1.0,
        },
        {
            "wall_s": 2.5,
            "curve": [(1.0, 0.0, 0.4), (2.5, 0.0, 0.7)],
            "syncs": 4,
            "sync_s": 0.1,
            "solo_step_s": 0.03,
            "start_factor": 3.0,
            "real_steps": 16,
            "busy_s": 1.44,
            "param_checksum": 1.0,
        },
    ]
    s = peer_summary("torch-averager", 4, ranks)
    assert s["train_wall_s"] == 2.5 and s["samples"] == 2 * 16 * 64
    assert s["samples_per_s"] == pytest.approx(2 * 16 * 64 / 2.5)
    assert s["val_acc"] == 0.8 and s["rounds"] == 4 and s["schedule"] == [4, 4]
    assert [c["start_factor"] for c in s["cluster"]] == [1.0, 3.0]


def test_the_sweep_prefers_reaching_the_target_then_throughput():
    never = {"median_time_to_target_s": None, "median_samples_per_s": 9000.0}
    slow_reach = {"median_time_to_target_s": 9.0, "median_samples_per_s": 3000.0}
    fast_reach = {"median_time_to_target_s": 5.0, "median_samples_per_s": 1000.0}
    tie = {"median_time_to_target_s": 5.0, "median_samples_per_s": 2000.0}
    ranked = sorted([never, slow_reach, fast_reach, tie], key=_rank_key)
    assert ranked == [tie, fast_reach, slow_reach, never]


@pytest.mark.multiprocess
@pytest.mark.extended  # the benchmark harness end to end (CI runs the extended run)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algo, sync_every, syncs", [("torch-averager", 4, 2), ("torch-ddp", 1, 0)])
def test_a_plain_loop_peer_trains_every_shard_and_ends_averaged(algo, sync_every, syncs):
    r = run_peer(algo, sync_every, TINY, epochs=1, slowdown="1:2")
    # 1,024 samples, 2 ranks, batch 64: 8 steps each, every sample once
    assert [c["real_steps"] for c in r["cluster"]] == [8, 8] and r["samples"] == 1024
    assert r["rounds"] == syncs
    assert len(r["curve"]) == 2 and 0.0 < r["curve"][0][0] < r["curve"][1][0]
    first, second = r["param_checksums"]
    assert first == pytest.approx(second, rel=1e-6, abs=1e-6), "the last step averaged: the ranks agree"
    # the 2x rank's emulated device time is twice the fast one's (each mostly the 5 ms regime sleep)
    fast, slow = r["cluster"]
    assert slow["busy_s"] == pytest.approx(2 * fast["busy_s"], rel=0.2)


@pytest.mark.multiprocess
@pytest.mark.extended  # the benchmark harness end to end (CI runs the extended run)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algo", ["torchft-localsgd", "torchft-diloco"])
def test_torchft_runs_on_loopback_and_ends_averaged(algo):
    # torchft is in the test extra: CI installs it, so this never skips there.
    r = run_peer(algo, 4, TINY, epochs=1, slowdown="1:2")
    assert [c["real_steps"] for c in r["cluster"]] == [8, 8] and r["rounds"] == 2
    first, second = r["param_checksums"]
    assert first == pytest.approx(second, rel=1e-6, abs=1e-6)
