"""The parameter-server paradigms keep their promises on 2 real ranks (one launch of ``lockstep_case.py``, every fit
in the same two processes): ``bsp`` takes one step per clock on every rank, so within every round the ranks take the
same steps and SGD with momentum follows ddp's trajectory across rounds, a validation and unequal speeds; and the
lead of any rank over the other, counted from every round's start, stays within each paradigm's bound."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from lockstep_case import (
    DSSP_LOW,
    DSSP_RANGE,
    EPOCHS,
    LR,
    MOMENTUM,
    SAMPLES,
    SSP_STALENESS,
    IndexedBlobs,
    make_mlp,
)
from subproc import ROOT, assert_clean_exit, clean_env, run
from torch import nn

TIMEOUT_S = 240
BOUNDS = {"bsp": 0, "ssp": SSP_STALENESS, "dssp": DSSP_LOW + DSSP_RANGE}

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    out = tmp_path_factory.mktemp("lockstep")
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT_S - 20))
    code, log = run([sys.executable, str(ROOT / "tests" / "lockstep_case.py"), str(out)], TIMEOUT_S, env)
    assert_clean_exit(code, log, TIMEOUT_S)
    ranks = [json.loads(Path(out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        for fit, result in rank.items():
            assert "error" not in result, f"{fit}: {result['error']}"
    return ranks


def steps_per_round(steps: list[list]) -> dict[int, int]:
    return dict(Counter(round_index for _, round_index, _ in steps))


def test_bsp_ranks_take_the_same_steps_in_every_round(results: list[dict[str, dict]]) -> None:
    fast, slow = (r["trajectory"] for r in results)
    assert fast["rounds"] == slow["rounds"] >= 4 and fast["validations"] == EPOCHS * 2
    per_round = [steps_per_round(r["steps"]) for r in (fast, slow)]
    assert len(per_round[0]) >= 3 and sum(n > 1 for n in per_round[0].values()) >= 2, "rounds of several steps"
    assert per_round[0] == per_round[1], "under BSP every rank takes exactly one step per clock"
    # One clock, one round: the k-th step of both ranks ran in the same round.
    assert [s[1] for s in fast["steps"]] == [s[1] for s in slow["steps"]]


def test_bsp_trains_every_sample_once_per_epoch(results: list[dict[str, dict]]) -> None:
    trained = sorted(i for r in results for _, _, indices in r["trajectory"]["steps"] for i in indices)
    assert trained == sorted(list(range(SAMPLES)) * EPOCHS)


def test_bsp_with_sgd_and_momentum_follows_ddps_trajectory(results: list[dict[str, dict]]) -> None:
    fast, slow = (r["trajectory"] for r in results)
    assert fast["weights"] == slow["weights"], "one model at the end of fit"
    assert len(fast["steps"]) == len(slow["steps"])
    # ddp, recomputed: at clock k the mean of both ranks' gradients on their k-th batches, SGD with momentum on it.
    data = IndexedBlobs()
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for (clock_a, _, batch_a), (clock_b, _, batch_b) in zip(fast["steps"], slow["steps"]):
        assert clock_a == clock_b
        grads = []
        for indices in (batch_a, batch_b):
            model.zero_grad()
            nn.functional.cross_entropy(model(data.x[indices]), data.y[indices]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g_a, g_b in zip(model.parameters(), *grads):
            p.grad = (g_a + g_b) / 2
        optimizer.step()
    for name, expected in model.state_dict().items():
        got = torch.tensor(fast["weights"][name]).reshape(expected.shape)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{name} left ddp's trajectory")


def leads(recorded: list[list], other: int) -> dict[int, list[int]]:
    """Per round, at every step: this rank's steps before it in the round minus the other's steps it had seen."""
    by_round: dict[int, list[list[float]]] = {}
    for round_index, coordinates in recorded:
        by_round.setdefault(round_index, []).append(coordinates)
    return {
        index: [k - round(seen[other] - starts[0][other]) for k, seen in enumerate(starts)]
        for index, starts in by_round.items()
    }


@pytest.mark.parametrize("paradigm", sorted(BOUNDS))
def test_the_lead_stays_within_the_paradigms_bound_from_every_rounds_start(
    results: list[dict[str, dict]], paradigm: str
) -> None:
    fast, slow = (r[f"lead/{paradigm}"] for r in results)
    assert fast["validations"] == 2
    fast_leads, slow_leads = leads(fast["seen"], other=1), leads(slow["seen"], other=0)
    assert len(fast_leads) >= 4, "several rounds (the warm-up's, then deadline rounds, a validation between)"
    largest = max(max(v) for v in (*fast_leads.values(), *slow_leads.values()))
    assert largest <= BOUNDS[paradigm], f"{paradigm}: a lead of {largest} from a round's start"
    if paradigm == "bsp":
        assert {k: len(v) for k, v in fast_leads.items()} == {k: len(v) for k, v in slow_leads.items()}
    else:  # the fast rank does use its slack
        assert largest == BOUNDS[paradigm] or paradigm == "dssp" and largest >= DSSP_LOW
    # The staleness the server reports (what the benchmarks show) counts the same lead, BSP's grants included.
    reported = fast["reported"] + slow["reported"]
    assert reported and max(reported) <= BOUNDS[paradigm], (paradigm, reported)
    # Both ranks' pushes all reached the server, and both ended with its state.
    assert fast["final"] == slow["final"] == [float(len(fast["seen"])), float(len(slow["seen"]))]
