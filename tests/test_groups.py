"""Ripples' group generator (pure): no conflicts, no deadlock, mixing, and smart groups around a slow worker."""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest

from lightning_oscars.core.groups import GroupBoard, connected, meetings, mixing_matrix, static_division


def drive(
    board: GroupBoard,
    step_s: list[float],
    steps: int,
    round_end_at: float | None = None,
    seed: int = 0,
    round_ends: tuple[float, ...] = (),
    jitter: float = 0.2,
):
    """Drive ``board`` as ``ripples.py``'s workers do, in simulated time (every step ``jitter`` x its time apart
    from it, uniformly).

    A worker ends a step, asks for its next group and waits at its buffer's head group; a group is performed (an
    instant exchange) once every member waits at it as its head. Rounds end at the times ``round_ends`` (or
    ``round_end_at``), the last one when a worker has done ``steps`` steps: a worker ending a step after its
    round's end leaves the round instead (``end_round``), performs what its buffer still holds and waits at the
    barrier; when all are there (the round's global all-reduce) the next round begins. Raises on a deadlock
    (somebody waits and no event is left). Returns per worker the groups performed in order, the seconds waited,
    the steps done, and the round each of its groups was performed in."""
    rng = random.Random(seed)
    n = len(step_s)
    ends = sorted(round_ends if round_end_at is None else (round_end_at,))
    buffers: list[list[tuple[int, ...]]] = [[] for _ in range(n)]
    consumed, done, waited = [0] * n, [0] * n, [0.0] * n
    sequence: list[list[tuple[int, ...]]] = [[] for _ in range(n)]
    rounds: list[list[int]] = [[] for _ in range(n)]
    waiting: dict[int, float] = {}
    leaving: set[int] = set()
    barrier: dict[int, float] = {}
    current = [0]  # the round in progress
    events = [(step_s[i] * rng.uniform(1 - jitter, 1 + jitter), i) for i in range(n)]
    heapq.heapify(events)

    def arrive(i: int, now: float) -> None:
        if buffers[i]:
            waiting[i] = now
            return
        assert i in leaving, "a stepping worker always has a group after it asked"
        barrier[i] = now
        if len(barrier) == n and current[0] < len(ends):  # the global all-reduce: the next round begins
            start = max(barrier.values())
            barrier.clear()
            leaving.clear()
            current[0] += 1
            for m in range(n):
                heapq.heappush(events, (start + step_s[m] * rng.uniform(1 - jitter, 1 + jitter), m))

    def perform_ready() -> None:
        progressed = True
        while progressed:
            progressed = False
            for i in list(waiting):
                if i not in waiting:
                    continue
                group = buffers[i][0]
                if not all(m in waiting and buffers[m][0] == group for m in group):
                    continue
                finish = max(waiting[m] for m in group)
                for m in group:
                    waited[m] += finish - waiting.pop(m)
                    sequence[m].append(group)
                    rounds[m].append(current[0])
                    buffers[m].pop(0)
                    consumed[m] += 1
                    if m in leaving:
                        arrive(m, finish)
                    else:
                        heapq.heappush(events, (finish + step_s[m] * rng.uniform(1 - jitter, 1 + jitter), m))
                progressed = True

    while events:
        now, i = heapq.heappop(events)
        done[i] += 1
        last_round = current[0] >= len(ends)
        if (not last_round and now >= ends[current[0]]) or (last_round and done[i] >= steps):
            leaving.add(i)
            assert board.end_round(i) == consumed[i] + len(buffers[i]), "the drain target is the buffer's end"
            arrive(i, now)
        else:
            for member, index, group in board.request(i, consumed[i], now):
                assert index == consumed[member] + len(buffers[member]), "buffer indices are consecutive"
                buffers[member].append(group)
            arrive(i, now)
        perform_ready()
    if waiting:
        raise AssertionError(f"deadlock: {sorted(waiting)} wait at {[buffers[i][0] for i in sorted(waiting)]}")
    assert set(barrier) == set(range(n)) and current[0] == len(ends), "every round ended"
    return sequence, waited, done, rounds


def _random_cluster(generator: str, n: int, seed: int) -> tuple[random.Random, list[float], GroupBoard]:
    """Speeds of 1x, 2x and 5x (10 ms at 1x) and a board of random group and buffer sizes."""
    rng = random.Random(seed)
    speeds = [rng.choice([1.0, 1.0, 2.0, 5.0]) * 0.01 for _ in range(n)]
    board = GroupBoard(
        n, group_size=rng.randint(2, n + 1), generator=generator, buffer_size=rng.randint(1, 3), seed=seed
    )
    return rng, speeds, board


def _assert_each_group_performed_once_by_each_member(board: GroupBoard, sequence: list[list[tuple[int, ...]]]):
    performed = Counter(g for seq in sequence for g in seq if len(g) > 1)
    made = Counter(board.history)
    assert all(performed[g] == made[g] * len(g) for g in made) and set(performed) <= set(made)


@pytest.mark.parametrize("generator", ["static", "random", "smart"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_no_conflicting_groups_and_no_deadlock_over_many_random_schedules(generator, n):
    for seed in range(30):
        rng, speeds, board = _random_cluster(generator, n, seed)
        end = rng.choice([None, 0.2])
        sequence, *_ = drive(board, speeds, steps=30, round_end_at=end, seed=seed)
        _assert_each_group_performed_once_by_each_member(board, sequence)
        # No conflicts: any two workers perform their common groups in one order (the board's global order).
        for a in range(n):
            for b in range(a + 1, n):
                common_a = [g for g in sequence[a] if b in g]
                common_b = [g for g in sequence[b] if a in g]
                assert common_a == common_b
        assert all(len(set(g)) == len(g) <= board.group_size for seq in sequence for g in seq)


@pytest.mark.parametrize("generator", ["static", "random", "smart"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_no_deadlock_and_no_group_across_a_round_end_over_many_rounds(generator, n):
    for seed in range(20):
        rng, speeds, board = _random_cluster(generator, n, seed)
        # Rounds of random lengths, some shorter than the slowest worker's step (it leaves them without a request).
        ends, t = [], 0.0
        for _ in range(rng.randint(2, 8)):
            t += rng.choice([0.005, 0.03, 0.1, 0.25])
            ends.append(t)
        sequence, _, done, rounds = drive(board, speeds, steps=len(ends) + 25, seed=seed, round_ends=tuple(ends))
        _assert_each_group_performed_once_by_each_member(board, sequence)
        for a in range(n):
            for b in range(a + 1, n):
                # Common groups in one order, each performed by both in the same round: none spans a round's end.
                common_a = [(r, g) for r, g in zip(rounds[a], sequence[a]) if b in g]
                common_b = [(r, g) for r, g in zip(rounds[b], sequence[b]) if a in g]
                assert common_a == common_b
        assert min(done) >= len(ends) + 1, "every worker stepped in every round"


def test_meetings_count_each_pair_once_per_group_and_are_symmetric():
    met = meetings(4, [(0, 1), (0, 1, 2), (2, 3), (1,)])
    assert met == [[0, 2, 1, 0], [2, 0, 1, 0], [1, 1, 0, 1], [0, 0, 1, 0]]
    board = GroupBoard(5, group_size=3, generator="random", seed=2)
    drive(board, [0.01, 0.01, 0.02, 0.03, 0.05], steps=40)
    met = meetings(5, board.history)
    assert all(met[a][b] == met[b][a] for a in range(5) for b in range(5))
    assert sum(map(sum, met)) == sum(len(g) * (len(g) - 1) for g in board.history)


def test_static_divisions_are_disjoint_and_mix_everybody():
    for n in range(2, 12):
        for k in range(2, n + 1):
            divisions = [static_division(n, k, d) for d in range(n)]
            for division in divisions:
                assert sorted(m for g in division for m in g) == list(range(n))  # a partition
            # Consecutive divisions overlap: their union connects the cluster within two divisions.
            assert connected(n, divisions[0] + divisions[1])


def test_the_mixing_matrix_is_doubly_stochastic_and_the_groups_connect_the_cluster():
    n = 6
    board = GroupBoard(n, group_size=3, generator="random", seed=3)
    drive(board, [0.01] * 5 + [0.05], steps=40)
    for group in board.history:
        w = mixing_matrix(n, group)
        assert all(abs(sum(row) - 1) < 1e-12 for row in w)
        assert all(abs(sum(w[i][j] for i in range(n)) - 1) < 1e-12 for j in range(n))
        assert all(w[i][j] == w[j][i] for i in range(n) for j in range(n))
    assert connected(n, board.history)
    # A product of doubly stochastic matrices stays doubly stochastic and, over connected groups, contracts the
    # spread of the workers' models towards their mean.
    values = [float(i) for i in range(n)]
    mean = sum(values) / n
    for group in board.history:
        w = mixing_matrix(n, group)
        values = [sum(w[i][j] * values[j] for j in range(n)) for i in range(n)]
    assert abs(sum(values) / n - mean) < 1e-9
    assert max(values) - min(values) < 1e-3 * n


def test_smart_groups_leave_a_slow_worker_out_of_most_fast_groups():
    speeds = [0.01, 0.01, 0.01, 0.05]  # worker 3 is 5x slower
    shares, waits = {}, {}
    for generator in ("random", "smart"):
        board = GroupBoard(4, group_size=2, generator=generator, seed=1)
        _, waited, done, _ = drive(board, speeds, steps=200)
        fast_groups = [g for g in board.history if any(m != 3 for m in g)]
        shares[generator] = sum(3 in g for g in fast_groups) / len(fast_groups)
        waits[generator] = sum(waited[:3]) / sum(done[:3])
        assert connected(4, board.history)  # the slow worker still mixes with the others
        assert any(3 in g for g in board.history)
    assert shares["smart"] < 0.35 and shares["smart"] < shares["random"] / 1.5
    assert waits["smart"] < waits["random"] / 2  # fast workers hardly wait for the slow one


def test_a_worker_that_left_the_round_is_not_grouped_until_a_new_round_begins():
    board = GroupBoard(3, group_size=3, generator="random", seed=0)
    assert [g for _, _, g in board.request(0, 0, 0.0)] == [(0, 1, 2)] * 3  # everybody takes part from the start
    assert board.request(1, 0, 0.0) == [] and board.request(2, 0, 0.0) == []  # theirs waits in their buffers
    assert board.end_round(2) == 1  # it still has to perform its one group before the round's all-reduce
    placements = board.request(0, 1, 1.0)
    assert placements and all(2 not in group for _, _, group in placements)
    assert board.end_round(0) == 2 and board.end_round(1) == 2
    # A request after a round's end means that round's all-reduce is over: everybody is back.
    assert [g for _, _, g in board.request(1, 2, 2.0)] == [(0, 1, 2)] * 3


@pytest.mark.parametrize("generator", ["static", "random", "smart"])
def test_a_worker_that_left_the_next_round_already_is_not_grouped_by_a_slow_one(generator):
    # The deadlock the 4-rank benchmark found: after a round's all-reduce worker 0 leaves the next round (no step
    # of its own fitted in it: a short round) before the slow worker 2 asks for the first time in that round.
    # Worker 2's groups must not include worker 0, who drained its buffer already and would never perform them.
    board = GroupBoard(3, group_size=3, generator=generator, seed=0)
    for worker in range(3):
        board.request(worker, board.assigned(worker), 0.0)
        board.end_round(worker)  # round 0 over, everybody met
    board.end_round(0)  # worker 0 left round 1 without a step
    placements = board.request(2, board.assigned(2), 1.5)
    assert placements and all(0 not in group for _, _, group in placements)
    board.request(1, board.assigned(1), 1.6)
    assert all(0 not in group for g in board.history[-2:] for group in [g])


def test_smart_does_not_expect_a_slow_worker_at_once_after_a_round_end():
    # Paces known: workers 0-2 take 40 ms per step, worker 3 takes 200 ms. All meet at a round's end at t = 1.0; the
    # fast ones ask 40 ms later. Worker 3 is a slow step from its first request, so no fast group waits for it.
    board = GroupBoard(4, group_size=2, generator="smart", tolerance=0.5)
    board.know_paces([0.04, 0.04, 0.04, 0.2], 0.0)
    for worker in range(4):
        board.end_round(worker)
    first = [g for w in (0, 1, 2) for _, _, g in board.request(w, board.assigned(w), 1.04)]
    assert first and all(3 not in g for g in first), first
    assert (0, 1) in first, "two fast workers due together still pair"
    # Its own first request, when it is due, still finds a fast partner: it is not left out of the mixing.
    placements = board.request(3, board.assigned(3), 1.2)
    assert [g for _, _, g in placements if 3 in g][0] != (3,), placements
    assert 1 in board._round_start
    for worker in range(4):  # the next round: the estimate of the one everybody left is dropped
        board.end_round(worker)
    assert 1 not in board._round_start


def test_smart_does_not_pick_a_worker_twice_before_it_is_ready():
    # At the start nobody has asked yet; the even workers ask first. A worker that has not asked holds no group of
    # its own, so one group from somebody else is all it may be given: a second would make its partner wait.
    board = GroupBoard(8, group_size=2, generator="smart", seed=0)
    for worker in (0, 2, 4, 6):
        board.request(worker, 0, 0.0)
    assert all(board.assigned(i) <= 1 for i in (1, 3, 5, 7))
    assert all(board.backlog(i) <= 1 for i in range(8))  # smart only picks a worker with nothing waiting


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"group_size": 1}, "group_size"),
        ({"generator": "nearest"}, "generator"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"tolerance": -1.0}, "tolerance"),
    ],
)
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        GroupBoard(4, **options)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"group_size": 1}, "group_size"), ({"generator": "nearest"}, "generator"), ({"overlap": "yes"}, "overlap")],
)
def test_the_strategy_names_a_bad_option_before_anything_is_built(options, match):
    from lightning_oscars import RipplesStrategy

    with pytest.raises(ValueError, match=match):
        RipplesStrategy(**options)


def test_the_strategy_overlaps_the_exchange_by_default_and_hands_its_options_to_the_scheme():
    from lightning_oscars import RipplesStrategy, SSPStrategy

    assert RipplesStrategy().make_scheme().overlap is True
    # The time-boxed warm-up: off by default for the step-synchronised paradigms (measured so), on when asked.
    assert RipplesStrategy().timed_warmup and not RipplesStrategy(timed_warmup=False).timed_warmup
    assert not SSPStrategy().timed_warmup and SSPStrategy(timed_warmup=True).timed_warmup
    scheme = RipplesStrategy(overlap=False, group_size=2, generator="random").make_scheme()
    assert scheme.overlap is False and scheme.board_options["generator"] == "random"


def _groups_per_round(sequence, rounds, count: int) -> list[list[tuple[int, ...]]]:
    """The groups of two or more performed in each of the first ``count`` rounds (from ``drive``'s results)."""
    per_round: list[list[tuple[int, ...]]] = [[] for _ in range(count)]
    for groups, performed_in in zip(sequence, rounds):
        for group, index in zip(groups, performed_in):
            if len(group) > 1 and index < count:
                per_round[index].append(group)
    return per_round


ROUND_ENDS = (0.3, 0.6, 0.9, 1.2)  # rounds of 30 steps of a 1x worker


@pytest.mark.parametrize("generator", ["static", "random", "smart"])
def test_equal_workers_without_jitter_mix_everybody_within_every_round(generator):
    """Eight equal workers in lock-step: every worker is equally ready at every request, and ``smart`` must not
    settle into fixed disjoint groups (models would then mix only at the rounds' global averages)."""
    board = GroupBoard(8, group_size=3, generator=generator, buffer_size=2)
    sequence, _, _, rounds = drive(board, [0.01] * 8, steps=400, round_ends=ROUND_ENDS, jitter=0.0)
    for index, groups in enumerate(_groups_per_round(sequence, rounds, len(ROUND_ENDS))):
        assert connected(8, groups), f"round {index}: the groups left the workers in disjoint sets"


@pytest.mark.parametrize("generator", ["static", "random", "smart"])
def test_the_groups_of_any_three_rounds_connect_every_worker_on_equal_and_mixed_speeds(generator):
    for seed in range(40):
        rng = random.Random(seed)
        n = rng.choice([4, 5, 8])
        speeds = [0.01] * n if seed % 2 == 0 else [rng.choice([1.0, 1.0, 2.0, 5.0]) * 0.01 for _ in range(n)]
        board = GroupBoard(n, group_size=rng.randint(2, 4), generator=generator, buffer_size=rng.randint(1, 3))
        jitter = rng.choice([0.0, 0.1])
        sequence, _, _, rounds = drive(board, speeds, steps=400, round_ends=ROUND_ENDS, jitter=jitter, seed=seed)
        per_round = _groups_per_round(sequence, rounds, len(ROUND_ENDS))
        for start in range(len(per_round) - 2):
            window = [g for groups in per_round[start : start + 3] for g in groups]
            assert connected(n, window), f"seed {seed} ({speeds}, jitter {jitter}): rounds {start}-{start + 2}"
