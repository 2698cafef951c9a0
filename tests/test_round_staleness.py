"""The staleness bound holds from every round's start, and every worker starts a round from the same server state.

A pure :class:`Shard` is driven through deadline rounds in simulated time, as ``server_scheme.py`` drives the real
one: a worker steps while its next step fits before the round's deadline, pushes after every step and waits for
the rule's grant; at the deadline it ends its round (END_ROUND) and waits for the meeting; after the meeting every
worker pulls the round's start, the slow one late. The model has one coordinate per worker and every push adds 1 to
its own worker's coordinate, so a grant's parameters tell how many of the other's pushes the worker has seen:
its *lead* is its own pushes in the round minus the other's pushes it has seen, over the whole round: one that ended
the round still bounds the other by the steps it took, and a worker the bound would hold for it gets a *closed*
grant (``Shard.closed``): it takes no further step and ends its round too.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_oscars.core.shard import Shard
from lightning_oscars.core.staleness import BSP, DASP, DSSP, SSP, StalenessRule

FAST, SLOW = 0, 1
STEP_S = {FAST: 1.0, SLOW: 5.0}  # 1x / 5x
# Meetings (round ends and a validation in the middle of the third round), and how late the slow worker comes out
# of each meeting: the fast one pulls, steps and pushes first.
MEETINGS = (23.0, 47.0, 58.0, 81.0, 104.0)
SLOW_PULL_DELAY_S = 3.0


@dataclass
class Run:
    leads: list[int] = field(default_factory=list)  # per open grant (one that starts an iteration), in order
    starts: list[dict[int, list[float]]] = field(default_factory=list)  # per round: every worker's start state
    pushes: list[dict[int, int]] = field(default_factory=list)  # per round: every worker's pushes
    shard: Shard | None = None


def drive(rule: StalenessRule) -> Run:
    """Deadline rounds on one shard of two workers (see the module docstring)."""
    now = [0.0]
    shard = Shard(torch.zeros(2), 2, rule, now=lambda: now[0])
    run = Run(shard=shard)
    order = itertools.count()
    events: list[tuple[float, int, str, int]] = []
    clock = {FAST: 0, SLOW: 0}
    start_of_round: dict[int, torch.Tensor] = {}
    ended: set[int] = set()
    waiting: set[int] = set()

    def begin_step(worker: int, deadline: float) -> None:
        if now[0] + STEP_S[worker] > deadline:  # the next step would not fit: end the round, wait for the meeting
            shard.end_round(worker)
            ended.add(worker)
        else:
            heapq.heappush(events, (now[0] + STEP_S[worker], next(order), "pushes", worker))

    def grant(worker: int, deadline: float) -> None:
        other = 1 - worker
        seen = shard.grant(worker)
        if shard.closed[worker]:  # the bound holds it for a worker that ended the round: no further step in it
            shard.end_round(worker)
            ended.add(worker)
            return
        other_seen = round(float(seen[other] - start_of_round[worker][other]))
        # Behind the other, a worker misses none of its updates: a lead of 0, not negative.
        run.leads.append(max(0, clock[worker] - other_seen))
        begin_step(worker, deadline)

    def start_round(worker: int) -> None:
        start_of_round[worker] = shard.round_start(worker)
        run.starts[-1][worker] = start_of_round[worker].tolist()
        clock[worker] = 0
        begin_step(worker, deadline_of(len(run.starts) - 1))

    def deadline_of(round_index: int) -> float:
        return MEETINGS[round_index] if round_index < len(MEETINGS) else float("inf")

    run.starts.append({})
    run.pushes.append({})
    for worker in (FAST, SLOW):
        start_round(worker)
    while len(run.starts) <= len(MEETINGS) or SLOW not in run.starts[-1]:
        round_index = len(run.starts) - 1
        if ended == {FAST, SLOW}:  # the meeting; then the next round
            run.pushes[-1] = dict(clock)
            ended.clear()
            run.starts.append({})
            run.pushes.append({})
            start_round(FAST)
            heapq.heappush(events, (now[0] + SLOW_PULL_DELAY_S, next(order), "pulls", SLOW))
            continue
        assert events, f"round {round_index}: both workers wait (clocks {clock}, ended {ended}, waiting {waiting})"
        now[0], _, what, worker = heapq.heappop(events)
        if what == "pulls":
            start_round(worker)
        else:
            clock[worker] += 1
            shard.push(worker, torch.eye(2)[worker] * 2, clock[worker], STEP_S[worker])
            waiting.add(worker)
        # A grant can end its worker's round, which can release the other: ask until nobody moves.
        while released := [w for w in sorted(waiting) if shard.may_start(w)]:
            waiting.discard(released[0])
            grant(released[0], deadline_of(round_index))
    run.pushes.pop()  # the open last round
    return run


@pytest.mark.parametrize(
    ("make_rule", "bound"),
    [(BSP, 0), (lambda: SSP(3), 3), (lambda: SSP(0), 0), (lambda: DSSP(s_low=1, s_range=2), 3)],
    ids=["bsp", "ssp3", "ssp0", "dssp1+2"],
)
def test_the_lead_is_bounded_from_every_rounds_start(make_rule: Callable[[], StalenessRule], bound: int) -> None:
    run = drive(make_rule())
    assert len(run.pushes) >= 4 and all(p[SLOW] >= 1 for p in run.pushes), "every round has steps of both"
    assert max(run.leads) == bound, "the bound is reached and never exceeded, counted from every round's start"
    # What the server reports is the same lead, at every grant that starts an iteration.
    assert run.shard is not None
    assert run.shard.staleness == run.leads


def test_every_worker_starts_a_round_from_the_meetings_state() -> None:
    run = drive(BSP())
    total = [0.0, 0.0]
    for index, starts in enumerate(run.starts[1:]):
        for worker, count in run.pushes[index].items():
            total[worker] += count
        assert starts[FAST] == starts[SLOW] == total, (
            f"round {index + 1}: the slow worker pulled after the fast one pushed, and must still start from the"
            " meeting's state (every push before it, none after)"
        )


def test_under_bsp_both_workers_step_alike_until_one_ends_its_round() -> None:
    run = drive(BSP())
    for pushes in run.pushes:
        # The fast worker may step on alone only once the slow one ended the round (less than one slow step).
        assert 0 <= pushes[FAST] - pushes[SLOW] <= STEP_S[SLOW] / STEP_S[FAST]


def test_dasp_runs_through_the_rounds_without_a_deadlock() -> None:
    run = drive(DASP(leave=1.5, rejoin=1.2, patience=2))
    assert all(p[FAST] > p[SLOW] for p in run.pushes), "the slow worker left the synchronous group"


def test_a_worker_whose_end_of_round_is_still_on_the_way_counts_from_the_new_rounds_start() -> None:
    """On a remote shard the fast worker's first push of a round can arrive before the slow worker's END_ROUND
    (different links): the slow worker is then at clock 0 of that round, not exempt and not at its old clock."""
    shard = Shard(torch.zeros(2), 2, BSP(), now=lambda: 0.0)
    for clock in (1, 2, 3):
        shard.push(SLOW, torch.tensor([0.0, 2.0]), clock, 1.0)
        shard.push(FAST, torch.tensor([2.0, 0.0]), clock, 1.0)
    shard.end_round(FAST)  # the fast worker met the others; the slow one's END_ROUND has not arrived yet
    shard.push(FAST, torch.tensor([2.0, 0.0]), 1, 1.0)
    assert shard.lead(FAST) == 1 and not shard.may_start(FAST), "held until the slow worker's first push"
    shard.end_round(SLOW)
    assert torch.equal(shard.round_start(SLOW), torch.tensor([3.0, 3.0])), "the meeting's state, not the push"
    assert not shard.may_start(FAST)
    shard.push(SLOW, torch.tensor([0.0, 2.0]), 1, 1.0)
    assert shard.may_start(FAST) and shard.lead(FAST) == 0
    assert torch.equal(shard.round_start(SLOW), torch.tensor([4.0, 4.0])), "after its own push: the current state"


@settings(max_examples=150, deadline=None)
@given(
    peers=st.lists(
        st.tuples(st.integers(1, 12), st.sampled_from(["active", "stopped", "ended"])), min_size=2, max_size=5
    ),
    rejoiner_clock=st.integers(0, 12),
)
def test_dasp_counts_a_rejoining_worker_from_its_furthest_peer_that_still_holds_anybody_back(
    peers: list[tuple[int, str]], rejoiner_clock: int
) -> None:
    """A worker that turns fast again rejoins the synchronous group at the furthest count among the synchronous
    workers that still hold anybody back: a stopped worker's clock, or that of one past the round's end, must not
    set it (it would wait for iterations nobody runs)."""
    rejoiner, workers = 0, len(peers) + 1
    rule = DASP(leave=1.5, rejoin=1.2, patience=1)
    shard = Shard(torch.zeros(0), workers, rule, now=lambda: 0.0)
    for peer, (clock, _) in enumerate(peers, start=1):
        shard.push(peer, torch.zeros(0), clock, busy_s=1.0)
    clock = rejoiner_clock + 1
    shard.push(rejoiner, torch.zeros(0), clock, busy_s=10.0)
    assert rule.state(rejoiner) == "async", "10x slower than the others: it left the synchronous group"
    for peer, (_, state) in enumerate(peers, start=1):
        if state == "stopped":
            shard.stop(peer)
        elif state == "ended":
            shard.end_round(peer)
    while rule.state(rejoiner) == "async":  # fast again: its smoothed time falls below 1.2x the others'
        clock += 1
        shard.push(rejoiner, torch.zeros(0), clock, busy_s=0.0)
        assert clock < 40
    active = [clock for clock, state in peers if state == "active"]
    counted_at = rule.rounds(shard.clocks)[rejoiner]
    assert counted_at == (max(active) if active else clock)
    if len(set(active)) <= 1:
        assert shard.may_start(rejoiner), "every peer that holds anybody back is where it counts from"
