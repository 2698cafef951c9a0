"""The in-job parameter server: pure shard logic here, two real gloo workers through Lightning's launcher below."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from subproc import ROOT, clean_env, run

from lightning_oscars.param_server import Shard, shard_bounds
from lightning_oscars.staleness import ASP, BSP, SSP


def test_shards_cover_the_parameters_contiguously_and_evenly():
    for numel, world in [(10, 3), (3, 4), (0, 2), (1_000_003, 7)]:
        bounds = shard_bounds(numel, world)
        assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [e - s for s, e in bounds]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        shard_bounds(5, 0)


def test_a_shard_applies_the_mean_update_and_holds_replies_by_the_rule():
    shard = Shard(torch.zeros(3), 2, BSP(), now=lambda: 0.0)
    shard.push(0, torch.tensor([2.0, 4.0, 6.0]), clock=1, busy_s=0.1)
    assert not shard.may_start(0), "BSP: worker 0 waits for worker 1's first update"
    shard.push(1, torch.tensor([0.0, 2.0, 0.0]), clock=1, busy_s=0.3)
    assert shard.may_start(0) and shard.may_start(1)
    assert torch.equal(shard.grant(0), torch.tensor([1.0, 3.0, 3.0])), "the mean of the two deltas"
    assert shard.staleness == [0]


def test_a_stopped_worker_holds_nobody_back_and_a_wait_times_out_naming_the_laggard():
    shard = Shard(torch.zeros(1), 2, SSP(1), now=lambda: 0.0)
    for clock in (1, 2):
        shard.push(0, torch.zeros(1), clock=clock, busy_s=0.1)
    assert not shard.may_start(0), "two ahead of a worker at 0 with staleness 1"
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        shard.wait(0, timeout_s=0.05)
    shard.stop(1)
    assert shard.may_start(0)
    assert torch.equal(shard.wait(0, timeout_s=0.05), torch.zeros(1))


def test_asp_never_holds_a_reply():
    shard = Shard(torch.zeros(1), 3, ASP(), now=lambda: 0.0)
    for clock in range(1, 50):
        shard.push(0, torch.ones(1), clock=clock, busy_s=0.01)
        assert shard.may_start(0)
    assert float(shard.values) == pytest.approx(49 / 3)


def _run(case: str, tmp_path: Path) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    code, log = run([sys.executable, str(ROOT / "tests" / "ps_case.py"), case, str(tmp_path)], 120, clean_env())
    assert code == 0, log[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiprocess
def test_bsp_on_the_server_reproduces_ddp_for_sgd_with_momentum(tmp_path):
    fast, slow = _run("bsp", tmp_path)
    for r in (fast, slow):
        assert r["trained"] == pytest.approx(r["ddp"], abs=2e-6), "the ddp trajectory, 20 steps"
        assert r["final"] == pytest.approx(r["ddp"], abs=2e-6)
        assert max(r["staleness"]) == 0 and not r["server_alive"]
    assert fast["final"] == slow["final"]


@pytest.mark.multiprocess
def test_ssp_bounds_the_staleness_and_asp_never_waits(tmp_path):
    fast, slow = _run("ssp", tmp_path / "ssp")
    # Rank 0 (6x faster) ran ahead to the bound and waited there; no grant was ever staler than 2 clocks.
    assert max(fast["staleness"]) == 2 and max(slow["staleness"]) <= 2
    assert fast["other_clock_at_finish"] >= 20 - 2
    assert fast["final"] == slow["final"] and not fast["server_alive"] and not slow["server_alive"]
    fast, slow = _run("asp", tmp_path / "asp")
    # Nobody held rank 0 back: it finished while the slow rank had pushed well under half of its updates.
    assert fast["other_clock_at_finish"] < 10, fast["other_clock_at_finish"]
    assert max(fast["staleness"]) > 2
    assert fast["final"] == slow["final"] and not fast["server_alive"]
