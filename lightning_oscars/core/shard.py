"""One shard of the in-job parameter server: its values, every worker's clock on it and the staleness rule's
decisions (``param_server.py`` serves it over torch.distributed; its module docstring describes the protocol).

Pure: no torch.distributed, thread-safe (the server thread and the local worker both use a shard), unit-tested
directly and driven by the simulator's paradigms alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_oscars.core.staleness import StalenessRule, WorkerTimes

__all__ = ["Shard", "shard_bounds"]


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every rank's shard of ``numel`` flat parameters: contiguous, sizes differing by at most
    one, the larger ones first (a rank with an empty shard still serves it)."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"cannot shard {numel} parameters over {world_size} ranks")
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        end = start + base + (rank < extra)
        bounds.append((start, end))
        start = end
    return bounds


class Shard:
    """One shard's parameters, every worker's clock on it and the rule's decisions. Pure: no torch.distributed;
    thread-safe (the server thread and the local worker both use it).

    Args:
        values: the shard's parameters (owned: updated in place).
        world_size: workers; every push is applied as ``delta / world_size``.
        rule: when a worker may start its next iteration.
        now: clock for the rule's timing (DSSP's predictions).
        momentum: the server's own heavy-ball momentum (``0``: none). Every push then updates a velocity,
            ``v = momentum * v + delta / world_size``, and the shard moves by ``v``: the update rule's momentum lives
            on the server, where every worker's pushes meet, instead of in each worker's optimizer.
    """

    def __init__(
        self,
        values: Tensor,
        world_size: int,
        rule: StalenessRule,
        now: Callable[[], float] = time.perf_counter,
        momentum: float = 0.0,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"the server's momentum must be in [0, 1), got {momentum}")
        self.values = values
        self.world_size = world_size
        self.rule = rule
        self.momentum = float(momentum)
        self.velocity = torch.zeros_like(values) if momentum else None
        self.clocks = [0] * world_size  # pushes within the worker's current round
        self.rounds = [0] * world_size  # rounds every worker ended (its END_ROUNDs this shard has seen)
        self.final = [0] * world_size  # every worker's clock when it ended its last round
        self.times = WorkerTimes(world_size)
        self.stopped: set[int] = set()
        # At every grant, the lead of the worker within its round: its pushes minus the fewest of any worker that
        # still holds it back (counted from the round's start, whether that worker has pushed in it yet or not).
        self.staleness: list[int] = []
        self.held = 0  # replies the rule held back (never under ASP)
        self._now = now
        self._changed = threading.Condition()
        # The shard as it stood before the first push of a round (round, values): what a round starts from.
        self._round_start: tuple[int, Tensor] | None = None
        # Lockstep rules (BSP): whether each worker said, at its last push, that it takes another step in its round;
        # and whether the round was *closed* for each worker at its last grant (somebody takes no further step in
        # it, so nobody may: see :meth:`closing`).
        self.more = [True] * world_size
        self.closed = [False] * world_size
        # Lockstep rules: the workers that pushed and wait for a grant, and the grants (values, closed) taken the
        # moment the rule let each start. Taken then, not when the worker is woken: a peer released at the same
        # clock may push its next step (or end its round) before this worker's thread runs, and BSP's iteration
        # starts from exactly the clock's parameters.
        self._asking: set[int] = set()
        self._ready: dict[int, tuple[Tensor, bool]] = {}

    def view(self, worker: int) -> tuple[list[int], frozenset[int]]:
        """The clocks as ``worker``'s round sees them, and the workers exempt from holding it back (a stopped one,
        or one that ended ``worker``'s round). A worker still counted in an earlier round has ended it (its
        END_ROUND is on the way) and starts ``worker``'s round from clock 0."""
        with self._changed:
            own = self.rounds[worker]
            clocks = [c if r == own else 0 for c, r in zip(self.clocks, self.rounds)]
            exempt = frozenset(w for w, r in enumerate(self.rounds) if w != worker and (w in self.stopped or r > own))
            return clocks, exempt

    def bounded_view(self, worker: int) -> tuple[list[int], frozenset[int]]:
        """As :meth:`view`, but a worker that ended ``worker``'s round counts at the clock it ended it at: the bound
        still holds against the steps it took. Only a stopped worker is exempt."""
        with self._changed:
            own = self.rounds[worker]
            clocks = [c if r == own else (f if r > own else 0) for c, r, f in zip(self.clocks, self.rounds, self.final)]
            exempt = frozenset(w for w in self.stopped if w != worker)
            return clocks, exempt

    def push(
        self,
        worker: int,
        delta: Tensor,
        clock: int,
        busy_s: float,
        decided: Sequence[float] | None = None,
        more: bool = True,
    ) -> tuple[float, ...]:
        """Apply ``worker``'s update; ``clock`` is the number of updates it has pushed, this one included.
        ``decided``: the rule's decision for ``worker`` from its own shard, adopted here; ``None`` on the worker's own
        shard, which decides it. ``more``: the worker takes another step in its round if allowed (its next step is
        already fetched). Returns the decision (to carry to the other shards)."""
        with self._changed:
            this_round = self.rounds[worker]
            if self._round_start is None or self._round_start[0] < this_round:
                self._round_start = (this_round, self.values.clone())  # the first push of the round
            if delta.numel():
                self._apply(delta)
            self.clocks[worker] = clock
            self.more[worker] = bool(more)
            now = self._now()
            self.times.pushed(worker, now, busy_s)
            if decided is None or not self.rule.decision_size:
                clocks, exempt = self.view(worker)
                self.rule.pushed(worker, clocks, self.times, now, exempt)
            else:
                self.rule.adopt(worker, decided, now)
            if self.rule.lockstep:
                self._ready.pop(worker, None)
                self._asking.add(worker)
                self._take_ready()
            self._changed.notify_all()
            return self.rule.decision(worker)

    def _apply(self, delta: Tensor) -> None:
        if self.velocity is None:
            self.values.add_(delta, alpha=1.0 / self.world_size)
        else:
            self.velocity.mul_(self.momentum).add_(delta, alpha=1.0 / self.world_size)
            self.values.add_(self.velocity)

    def velocity_copy(self) -> Tensor | None:
        """The server's momentum buffer for this shard (a copy; ``None`` without server momentum)."""
        with self._changed:
            return None if self.velocity is None else self.velocity.clone()

    def load_velocity(self, velocity: Tensor) -> None:
        """Resume the momentum buffer (a checkpoint's); ignored without server momentum."""
        with self._changed:
            if self.velocity is not None:
                self.velocity.copy_(velocity.reshape(self.velocity.shape))

    def stop(self, worker: int) -> None:
        with self._changed:
            self.stopped.add(worker)
            self._take_ready()
            self._changed.notify_all()

    def closing(self, worker: int) -> bool:
        """Whether ``worker``'s round is closed at its clock (it may take no further step in it). Under any rule: when
        only peers that already ended the round hold it back (they push no more in it, and it must not wait for them
        past its bound). Under a lockstep rule also: it, or a peer at the same clock, takes no further step in the
        round, or a peer already ended the round (or stopped). Every worker granted at a clock gets the same answer
        (BSP grants once every peer pushed that clock), so all take the same steps."""
        with self._changed:
            if not self._allowed(worker):
                return True
            if not self.rule.lockstep:
                return False
            clocks, exempt = self.view(worker)
            if not self.more[worker] or exempt:
                return True
            return any(not self.more[w] and clocks[w] == clocks[worker] for w in range(self.world_size) if w != worker)

    def _take_ready(self) -> None:
        """Lockstep rules: take the grant of every asking worker the rule now lets start (call on every change)."""
        if not self.rule.lockstep:
            return
        for worker in sorted(self._asking - self._ready.keys()):
            if self._allowed(worker) or self._released(worker):
                self._ready[worker] = (self.values.clone(), self.closing(worker))

    def end_round(self, worker: int) -> None:
        """``worker`` ended its round (it is about to meet the others): it holds nobody back for the rest of that
        round, and it starts the next one at clock 0, counted from the start (its next push is clock 1)."""
        with self._changed:
            self.rounds[worker] += 1
            self.final[worker] = self.clocks[worker]
            self.clocks[worker] = 0
            self.more[worker] = True
            self.rule.restart(worker)
            self._take_ready()
            self._changed.notify_all()

    def round_start(self, worker: int) -> Tensor:
        """The parameters ``worker`` starts (or continues) from without pushing: before its first push of its
        round, the shard as it stood before anybody's push of that round (every worker starts a round from the same
        state); after it, the current parameters."""
        with self._changed:
            this_round = self.rounds[worker]
            if self.clocks[worker]:
                return self.values.clone()
            if self._round_start is None or self._round_start[0] < this_round:
                # Nobody pushed in this round yet (that push would have kept the state), so the shard holds it.
                self._round_start = (this_round, self.values.clone())
            elif self._round_start[0] > this_round:
                raise RuntimeError(
                    f"worker {worker} asks for the start of round {this_round}, but round"
                    f" {self._round_start[0]} already started: a worker skipped a meeting"
                )
            return self._round_start[1].clone()

    def may_start(self, worker: int, first: bool = False) -> bool:
        """Whether ``worker`` may start its next iteration (``first``: the first time this push asks)."""
        with self._changed:
            allowed = self._may(worker)
            self.held += first and not allowed
            return allowed

    def _may(self, worker: int) -> bool:
        return worker in self._ready or self._allowed(worker) or self._released(worker)

    def _allowed(self, worker: int) -> bool:
        """The rule lets ``worker`` start its next iteration, counting a peer that ended the round at its last clock."""
        clocks, exempt = self.bounded_view(worker)
        return self.rule.may_start(worker, clocks, self.times, self._now(), exempt)

    def _released(self, worker: int) -> bool:
        """Only peers that ended ``worker``'s round hold it back: it gets a reply (it must reach the round's collective
        too), but a closed one (:meth:`closing`): it takes no further step in the round."""
        clocks, exempt = self.view(worker)
        return self.rule.would_start(worker, clocks, self.times, self._now(), exempt)

    def lead(self, worker: int) -> int:
        """How many more pushes ``worker`` made in its round than the fewest of any other worker's in it (one that
        ended the round at its last clock; 0 when it leads nobody: behind everybody, it misses none of their
        updates)."""
        with self._changed:
            clocks, exempt = self.bounded_view(worker)
            others = [c for w, c in enumerate(clocks) if w != worker and w not in exempt]
            return max(0, clocks[worker] - min(others)) if others else 0

    def grant(self, worker: int) -> Tensor:
        """The parameters ``worker`` starts its next iteration from (call once :meth:`may_start` said so); under a
        lockstep rule, :attr:`closed` says whether its round was closed then."""
        with self._changed:
            self._asking.discard(worker)
            ready = self._ready.pop(worker, None)
            if ready is None:
                ready = (self.values.clone(), self.closing(worker))
            values, self.closed[worker] = ready
            if not self.closed[worker]:  # a closed grant starts no iteration
                self.staleness.append(self.lead(worker))
            return values

    def wake(self) -> None:
        """Wake a :meth:`wait` to ask its ``peer_failure`` now (something outside the shard failed)."""
        with self._changed:
            self._changed.notify_all()

    def wait(
        self,
        worker: int,
        timeout_s: float,
        peer_failure: Callable[[], str | None] | None = None,
        on_hold: Callable[[], None] | None = None,
    ) -> Tensor:
        """Block until ``worker`` may start, then :meth:`grant` (the local worker's path). ``peer_failure`` is asked
        every second while waiting: a reason it returns (a peer reported an error) ends the wait. ``on_hold`` is
        called once, before the first wait, if the rule holds ``worker`` back."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            if not self._may(worker):
                self.held += 1
                if on_hold is not None:
                    on_hold()
            while not self._may(worker):
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [w for w in range(self.world_size) if w != worker and w not in self.stopped]
                    raise TimeoutError(f"rank {worker} waited {timeout_s:.0f} s for ranks {waiting} to push")
                self._changed.wait(min(left, 1.0))
                reason = peer_failure() if peer_failure is not None else None
                if reason:
                    raise RuntimeError(f"rank {worker} stopped waiting for its next iteration: {reason}")
        return self.grant(worker)
