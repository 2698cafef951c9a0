"""Ripples (seed 001) on torch.distributed: groups of workers average their models after every iteration.

* **Coordinator** (:class:`GroupCoordinator`): a thread on rank 0 runs the group generator
  (:class:`~lightning_oscars.core.groups.GroupBoard`) over the rendezvous store's queues, on its own store connection.
  Workers push requests onto one queue; the coordinator pops them in order and pushes each group onto every
  member's own queue, which *is* the member's Group Buffer: first in, first out, one global order.
* **Worker** (:class:`GroupClient`): after each iteration a worker asks (reporting how many groups it performed and
  its busy time), pops its next group and averages with the members (:class:`GroupExchange`, waited for at once);
  with ``overlap`` it posts the exchange and applies it after its next step, as a correction. At its round's end
  it says so, performs what its queue still holds up to an end marker the coordinator appends (no group is made
  with it afterwards), and joins the round's global all-reduce.
* **Partial all-reduce**: every member sends its flat parameters to every other member and receives theirs over
  point-to-point operations on one gloo group created at setup, then takes the mean in rank order (every member
  computes the same sum). With ``k`` members that is ``k - 1`` sends per member: for the small groups Ripples uses
  (2-4) it costs about one exchange's latency, and it needs no process group per subset of ranks (``2^n`` of
  them, each created by every rank at setup).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oscars.dist._c10d import default_store, new_gloo_group, retire_group
from lightning_oscars.dist.averaging import add_flat, flat_copy, load_flat
from lightning_oscars.core.groups import GroupBoard, meetings
from lightning_oscars.dist.schemes import ModelAveraging, RoundMeeting

__all__ = ["GroupClient", "GroupCoordinator", "GroupExchange", "RipplesScheme"]

_STOP = "S"
_REQUEST = "R"
_END = "E"
_END_MARK = "end"
_SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval on the coordinator's rank (measured: -2.5% wall at 4 ranks)
_FITS = itertools.count(1)  # the process's fits, numbered in order: the same numbers on every rank


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GroupCoordinator:
    """The group generator on one rank: a daemon thread popping requests from ``{prefix}/requests``.

    Args:
        store: a ``torch.distributed.Store`` with queues (cloned here: the thread blocks on its own connection).
        prefix: unique per fit, the same on every rank.
        board: the generator's state.
    """

    def __init__(self, store: Any, prefix: str, board: GroupBoard) -> None:
        self.board = board
        self.prefix = prefix
        self._control = store  # stop() pushes here: the thread's own connection is busy in its blocking pop
        self._store = store.clone()
        self._store.set_timeout(timedelta(days=365))  # waits for requests for as long as the fit lasts
        self.error: BaseException | None = None
        # Every request waits for this thread to get the GIL from the training thread, which may be running Python
        # (Lightning's per-batch work, kernel launches): at the default 5 ms switch interval that is up to 5 ms per
        # group, on every rank. A shorter interval while the fit lasts; restored by stop().
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, _SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._serve, name="oscars-ripples-groups", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while True:
                op, *fields = _text(self._store.queue_pop(f"{self.prefix}/requests")).split(",")
                if op == _STOP:
                    return
                worker = int(fields[0])
                if op == _REQUEST:
                    placements = self.board.request(worker, int(fields[1]), time.monotonic())
                    for member, _, group in placements:
                        self._store.queue_push(f"{self.prefix}/groups/{member}", ",".join(map(str, group)))
                elif op == _END:
                    self.board.end_round(worker)
                    self._store.queue_push(f"{self.prefix}/groups/{worker}", _END_MARK)
        except BaseException as error:  # noqa: BLE001 - the store went away (rank 0 exiting); workers see it too
            self.error = error

    def stop(self, wait_s: float = 10.0) -> None:
        sys.setswitchinterval(self._switch_interval)
        if self._thread.is_alive():
            try:
                self._control.queue_push(f"{self.prefix}/requests", _STOP)
            except Exception:  # noqa: BLE001 - the store is gone: the daemon thread ends with the process
                return
            self._thread.join(wait_s)


class GroupClient:
    """One worker's side: ask for groups, receive them, say when the round ends."""

    def __init__(self, store: Any, prefix: str, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.prefix = prefix
        self._store = store.clone()
        self._store.set_timeout(timedelta(seconds=timeout_s))
        self.performed = 0  # groups taken from the buffer this fit

    def next_group(self) -> tuple[int, ...]:
        """Ask for the group after this iteration and take it from the buffer (it may already have been there)."""
        self._store.queue_push(f"{self.prefix}/requests", f"{_REQUEST},{self.rank},{self.performed}")
        group = self._pop()
        if group is None:
            raise RuntimeError("ripples: the group generator ended this rank's round while it was stepping")
        return group

    def leave_round(self) -> None:
        """Leave the round without performing what the buffer holds (a peer is lost): the generator makes no more
        groups with this rank in it."""
        self._store.queue_push(f"{self.prefix}/requests", f"{_END},{self.rank}")

    def end_round(self) -> list[tuple[int, ...]]:
        """Leave the round: the groups left in the buffer, which must still be performed, in order."""
        self.leave_round()
        left = []
        while (group := self._pop()) is not None:
            left.append(group)
        return left

    def _pop(self) -> tuple[int, ...] | None:
        item = _text(self._store.queue_pop(f"{self.prefix}/groups/{self.rank}"))
        if item == _END_MARK:
            return None
        self.performed += 1
        return tuple(int(m) for m in item.split(","))


class GroupExchange:
    """One group's exchange of flat buffers (CPU tensors of one size on every member), point to point: posted when
    made, finished by :meth:`mean`. Gloo moves the data on its own threads, so a rank may train meanwhile."""

    def __init__(self, flat: Tensor, members: Sequence[int], rank: int, group: Any) -> None:
        self.flat = flat  # this rank's values as sent: kept (and not modified) until the exchange is finished
        self.members = tuple(sorted(members))
        self.rank = rank
        others = [m for m in self.members if m != rank]
        self._received = {m: torch.empty_like(flat) for m in others}
        self._works = [dist.irecv(self._received[m], src=m, group=group) for m in others]
        self._works += [dist.isend(flat, dst=m, group=group) for m in others]

    def mean(self, timeout: timedelta) -> Tensor:
        """Wait for every member's values and return their mean."""
        for work in self._works:
            if work is not None:  # None only for a rank outside the group, which every member is in
                work.wait(timeout)
        total = torch.zeros_like(self.flat)
        for m in self.members:  # one order on every member: the same mean, bit for bit
            total += self.flat if m == self.rank else self._received[m]
        return total / len(self.members)


class RipplesScheme(ModelAveraging):
    """A partial all-reduce with the worker's group after every real step; a global average at every round's end.

    Args:
        board_options: :class:`~lightning_oscars.core.groups.GroupBoard`'s options (``group_size``, ``generator``,
            ``buffer_size``, ``tolerance``, ``seed``).
        device: where the round-end all-reduce runs.
        timeout_s: the longest a worker waits for its group or a member before it gives up.
        overlap: post each group's exchange at a step's end and apply it at the next step's end, as the
            correction ``mean - sent`` (the rank's own progress meanwhile is kept). Nobody waits for a member's step
            to end; a group's average reaches the model one step late. ``False``: the seed's synchronous partial
            all-reduce.
    """

    name = "ripples"
    waits_within_rounds = True

    def __init__(
        self,
        board_options: dict[str, Any],
        device: torch.device | str | None = None,
        timeout_s: float = 1800.0,
        overlap: bool = True,
    ) -> None:
        super().__init__(device)
        self.board_options = dict(board_options)
        self.timeout_s = timeout_s
        self.overlap = overlap
        self._pending: GroupExchange | None = None  # overlap: the exchange posted at the last step's end
        self.coordinator: GroupCoordinator | None = None
        self.client: GroupClient | None = None
        self._exchange_group: Any = None
        self._params: list[Tensor] = []
        self._rank = 0
        # This fit's figures, kept after it stopped: the size of every group this rank performed, its seconds in
        # groups (waiting for members and exchanging); on rank 0, how often each pair of ranks met.
        self.sizes: list[int] = []
        self.applied_late = 0  # overlap: exchanges applied as a correction after a later step
        self.waited_s = 0.0
        self.asked_s = 0.0  # of waited_s: asking the coordinator for the next group (the store's round trips)
        self.report: dict[str, Any] = {}

    def bind(self, parameters: Iterable[Tensor]) -> None:
        """Start this fit's groups (collective: every rank, at the same point)."""
        self.release()
        self._params = list(parameters)
        self.sizes, self.applied_late, self.waited_s, self.asked_s, self.report = [], 0, 0.0, 0.0, {}
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return  # one process: nobody to average with
        self._rank, n = dist.get_rank(), dist.get_world_size()
        self._exchange_group = new_gloo_group()
        prefix = f"oscars/ripples/{next(_FITS)}"
        store = default_store()
        if self._rank == 0:
            self.coordinator = GroupCoordinator(store, prefix, GroupBoard(n, **self.board_options))
        self.client = GroupClient(store, prefix, self._rank, self.timeout_s)

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def _perform(self, members: tuple[int, ...], overlap: bool = False) -> None:
        self.sizes.append(len(members))
        if len(members) > 1:
            exchange = GroupExchange(flat_copy(self._params), members, self._rank, self._exchange_group)
            if overlap:
                self._pending = exchange
            else:
                load_flat(self._params, exchange.mean(self._timeout))

    def _finish_pending(self) -> None:
        """Apply the exchange posted at the last step's end: what the group's mean adds to what this rank sent."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.applied_late += 1
            add_flat(self._params, pending.mean(self._timeout).sub_(pending.flat))

    def after_step(self) -> None:
        """A real optimizer step just ended: average with this iteration's group (with ``overlap``: apply the last
        iteration's group and post this one's)."""
        if self.client is None:
            return
        started = time.perf_counter()
        self._finish_pending()
        asked = time.perf_counter()
        members = self.client.next_group()
        self.asked_s += time.perf_counter() - asked
        self._perform(members, self.overlap)
        self.waited_s += time.perf_counter() - started

    def abandon(self) -> None:
        """A peer is lost: take no more groups (an exchange in flight is left unfinished; the survivors grouped
        with this rank see its connection close when it exits)."""
        client, self.client = self.client, None
        if client is not None:
            try:
                client.leave_round()
            except Exception:  # noqa: BLE001 - the store died with rank 0: nobody is grouped with this rank any more
                pass

    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        if self.client is not None:
            started = time.perf_counter()
            self._finish_pending()  # before the buffer's rest: a member's exchanges complete in the buffer's order
            for members in self.client.end_round():  # members still count on this rank for these
                self._perform(members)
            self.waited_s += time.perf_counter() - started
        self.average(tensors, meeting)

    def release(self) -> None:
        super().release()
        pending, self._pending = self._pending, None  # only left by a fit that failed: its members may be gone
        group, self._exchange_group = self._exchange_group, None
        if pending is None:  # no exchange of this rank can still use it
            retire_group(group)
        coordinator, self.coordinator, self.client = self.coordinator, None, None
        if self.sizes:
            self.report = {
                "groups": len(self.sizes),
                "mean_group_size": sum(self.sizes) / len(self.sizes),
                "applied_late": self.applied_late,
                "waited_s": self.waited_s,
                "asked_s": self.asked_s,
            }
        if coordinator is not None:
            coordinator.stop()
            self.report["met"] = meetings(coordinator.board.world_size, coordinator.board.history)
