"""Ripples' group generation (seed 001), pure: which workers average their models together after an iteration.

Our reading of the seed, as implemented here and in ``ripples.py``:

* **Group.** After each of its iterations a worker takes part in exactly one *group*: the members average their
  models in one partial all-reduce. A group may be the worker alone (no exchange).
* **Group Buffer.** The generator appends every group it makes to each member's FIFO buffer, in one global order,
  and every worker performs its groups in buffer order, one per iteration. So a worker is never in two groups at
  once, and since all workers meet their groups in one total order, the earliest unfinished group always has every
  member at it: no cycle of waits, no deadlock. A worker whose buffer holds ``buffer_size`` groups beyond its
  current one is not handed more (a slow worker is not given a backlog it would make others wait on).
* **Group Division.** One generation splits *all* eligible workers into disjoint groups at once (``static``,
  ``random``), so groups made together never overlap and workers other than the requester find a group waiting.
* **Generators.**
  - ``static``: division ``d`` of a fixed cycle: the ranks rotated by ``d`` and cut into consecutive groups of
    ``group_size``. For homogeneous clusters: no randomness, and consecutive divisions overlap, so every model
    mixes with every other within a few divisions.
  - ``random``: a random division of the eligible workers.
  - ``smart``: only the requester's group, made of eligible workers expected at their next iteration's end within
    ``tolerance`` x the requester's own iteration time; among those, the ones the requester met longest ago (never
    first), then the soonest expected. A slow worker therefore joins fast ones when it is about to be ready (its
    own requests always find fast partners close to their step's end) instead of making them wait for most of its
    step; and workers that are all equally ready (equal speeds) rotate their partners instead of settling into
    fixed disjoint groups, whose models would mix only at the rounds' global averages.
* **Rounds.** Every worker takes part from the start. The board counts every worker's round ends (the strategy's
  global average follows each). A group is made only among workers in the requester's round: a worker that left
  it performs the groups already in its buffer before the global all-reduce and is never handed one it would not
  perform. (A fast worker may reach the next round's end before a slow one asks for the first time in it.)

A group's partial all-reduce replaces every member's model by the members' mean: the mixing matrix is symmetric
and doubly stochastic (:func:`mixing_matrix`); models mix across the whole cluster when the union of the groups
over a window is connected (:func:`connected`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "GENERATORS",
    "Generator",
    "Group",
    "GroupBoard",
    "connected",
    "meetings",
    "mixing_matrix",
    "static_division",
]

Generator = Literal["static", "random", "smart"]
GENERATORS: tuple[Generator, ...] = ("static", "random", "smart")
Group = tuple[int, ...]  # sorted ranks


def static_division(world_size: int, group_size: int, index: int) -> list[Group]:
    """Division ``index`` of the static cycle: ranks rotated by ``index``, cut into groups of ``group_size`` (the
    last one smaller when ``group_size`` does not divide ``world_size``)."""
    order = [(index + i) % world_size for i in range(world_size)]
    return [tuple(sorted(order[i : i + group_size])) for i in range(0, world_size, group_size)]


def mixing_matrix(world_size: int, group: Sequence[int]) -> list[list[float]]:
    """The linear map of one partial all-reduce over ``group``: members get the members' mean, others keep theirs."""
    members = set(group)
    share = 1.0 / len(members) if members else 0.0
    return [
        [(share if j in members else 0.0) if i in members else float(i == j) for j in range(world_size)]
        for i in range(world_size)
    ]


def meetings(world_size: int, groups: Iterable[Sequence[int]]) -> list[list[int]]:
    """How often each pair of workers averaged together: ``met[a][b]`` groups held both ``a`` and ``b``."""
    met = [[0] * world_size for _ in range(world_size)]
    for group in groups:
        for a in group:
            for b in group:
                met[a][b] += a != b
    return met


def connected(world_size: int, groups: Iterable[Sequence[int]]) -> bool:
    """Whether the union of ``groups`` (as edges between their members) connects all ``world_size`` workers."""
    parent = list(range(world_size))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for group in groups:
        for member in group[1:]:
            parent[root(member)] = root(group[0])
    return len({root(i) for i in range(world_size)}) == 1


@dataclass
class _Worker:
    assigned: int = 0  # groups placed in its buffer so far (this fit)
    consumed: int = 0  # groups it said it has performed
    ends: int = 0  # round ends it reported: it is in round ``ends`` (it left every earlier one)
    requested: bool = False  # asked since the start or its last round end (and so holds a group of its own)
    last_request: float | None = None
    interval: float | None = None  # smoothed seconds between its requests: its pace, waits included


@dataclass
class GroupBoard:
    """The group generator's state (on one coordinator): buffers, activity and pace of every worker.

    Args:
        world_size: the number of workers.
        group_size: the most members of a group.
        generator: ``"static"``, ``"random"`` or ``"smart"`` (see the module docstring).
        buffer_size: a worker whose buffer holds this many groups is not placed in another.
        tolerance: ``smart``: a partner is expected at most this many of the requester's iterations away.
        seed: for ``random``.
    """

    world_size: int
    group_size: int = 2
    generator: Generator = "smart"
    buffer_size: int = 2
    tolerance: float = 0.1
    seed: int = 0
    history: list[Group] = field(default_factory=list)  # every group of two or more, in the global order
    _workers: list[_Worker] = field(init=False, repr=False)
    _divisions: int = field(default=0, init=False, repr=False)
    _random: random.Random = field(init=False, repr=False)
    # round (a count of round ends) -> when it began, as estimated from its first requests: ``smart`` expects a
    # worker that has not asked in its round yet one pace after that, not at once
    _round_start: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    # (lower rank, higher rank) -> index in ``history`` of the last group that held both: ``smart`` rotates partners
    _last_met: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        validate_options(self.world_size, self.group_size, self.generator, self.buffer_size, self.tolerance)
        self._workers = [_Worker() for _ in range(self.world_size)]
        self._random = random.Random(self.seed)

    def backlog(self, worker: int) -> int:
        """Groups waiting in ``worker``'s buffer beyond the one it took at its last request (if it asked this round):
        what it performs at its coming iteration ends before a new group. It reports what it performed only when it
        asks again, so the one it took then counts as performed."""
        w = self._workers[worker]
        return max(0, w.assigned - w.consumed - int(w.requested))

    def assigned(self, worker: int) -> int:
        return self._workers[worker].assigned

    def know_paces(self, seconds: Sequence[float], now: float) -> None:
        """Every worker's seconds per iteration, known before it asks (a profiling warm-up): ``smart`` then expects
        each worker's next iteration end one pace after ``now``."""
        for worker, pace in zip(self._workers, seconds, strict=True):
            worker.last_request, worker.interval = now, float(pace)

    def request(self, worker: int, consumed: int, now: float) -> list[tuple[int, int, Group]]:
        """``worker`` ended an iteration at ``now`` and has performed ``consumed`` groups: make what it needs.

        Returns the placements made, ``(member, buffer index, group)``, in order; none when its next group already
        waits in its buffer."""
        w = self._workers[worker]
        w.requested = True
        w.consumed = max(w.consumed, consumed)
        if w.last_request is None and w.interval is not None:  # its first request in the round: one pace after start
            self._round_start[w.ends] = min(self._round_start.get(w.ends, now), now - w.interval)
        if w.last_request is not None:
            gap = max(0.0, now - w.last_request)
            w.interval = gap if w.interval is None else 0.7 * w.interval + 0.3 * gap
        w.last_request = now
        if w.assigned > w.consumed:
            return []
        eligible = [
            # Only workers in the requester's round: one that left it drained its buffer already, and one cannot be
            # in an earlier round (the requester is past that round's all-reduce, which everybody reached).
            i
            for i, x in enumerate(self._workers)
            if i == worker or (x.ends == w.ends and self.backlog(i) < self.buffer_size)
        ]
        if self.generator == "smart":
            groups = [self._smart_group(worker, eligible, now)]
        else:
            groups = self._division(eligible)
        placements = []
        for group in groups:
            if len(group) < 2 and worker not in group:
                continue  # nothing to exchange, and not the requester's: nobody is waiting for it
            if len(group) >= 2:
                for a in group:
                    for b in group:
                        if a < b:
                            self._last_met[a, b] = len(self.history)
                self.history.append(group)
            for member in group:
                placements.append((member, self._workers[member].assigned, group))
                self._workers[member].assigned += 1
        return placements

    def end_round(self, worker: int) -> int:
        """``worker`` reached its round's end: no new group of that round includes it. Returns how many groups its
        buffer received in all: it performs the ones left before the round's global all-reduce, and is grouped
        again with the workers that reached the next round."""
        w = self._workers[worker]
        w.ends += 1
        w.requested = False
        w.consumed = w.assigned  # drained before the all-reduce
        w.last_request = None  # the pause is not its pace
        oldest = min(x.ends for x in self._workers)
        for done in [r for r in self._round_start if r < oldest]:  # rounds nobody is in any more
            del self._round_start[done]
        return w.assigned

    def _division(self, eligible: list[int]) -> list[Group]:
        if self.generator == "static":
            allowed = set(eligible)
            division = static_division(self.world_size, self.group_size, self._divisions)
            self._divisions += 1
            return [g for g in (tuple(m for m in group if m in allowed) for group in division) if g]
        order = list(eligible)
        self._random.shuffle(order)
        return [tuple(sorted(order[i : i + self.group_size])) for i in range(0, len(order), self.group_size)]

    def _smart_group(self, worker: int, eligible: list[int], now: float) -> Group:
        own = self._workers[worker].interval
        if own is None:  # no pace known yet: a static-like pairing with whoever is eligible
            limit = float("inf")
        else:
            limit = self.tolerance * own
        candidates = []
        for i in eligible:
            x = self._workers[i]
            if i == worker or self.backlog(i) > 0:
                continue  # a worker with a group waiting reaches a new one only after that one
            wait = max(0.0, self._expected(x, now))
            if wait <= limit:  # any of these is ready soon enough: prefer the partner met longest ago, to mix
                last_met = self._last_met.get((min(worker, i), max(worker, i)), -1)
                candidates.append((last_met, wait, i))
        candidates.sort()
        return tuple(sorted([worker] + [i for _, _, i in candidates[: self.group_size - 1]]))

    def _expected(self, x: _Worker, now: float) -> float:
        """Seconds until worker ``x`` is expected to ask next: one pace after its last request, or after its round
        began if it has not asked in it yet (after a round's end a slow worker is a whole slow step away, not due);
        0 while its pace is unknown."""
        if x.interval is None:
            return 0.0
        if x.last_request is not None:
            return x.last_request + x.interval - now
        start = self._round_start.get(x.ends)
        return 0.0 if start is None else start + x.interval - now


def validate_options(world_size: int, group_size: int, generator: str, buffer_size: int, tolerance: float) -> None:
    """Raise ``ValueError`` naming the bad option."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if generator not in GENERATORS:
        raise ValueError(f"generator must be one of {', '.join(GENERATORS)}; got {generator!r}")
    if not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
