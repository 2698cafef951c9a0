"""A parameter server inside the job, on torch.distributed point-to-point operations.

Every rank is a *worker* (it trains) and the *server* of one contiguous shard of the model's flat parameters
(:func:`shard_bounds`). A worker's iteration ends with one round trip per shard: it sends the shard's slice of its
update (the delta of its local optimizer step) with its new clock, and the server answers with the shard's current
parameters once the staleness rule (``staleness.py``) lets the worker start its next iteration. The waiting of
BSP, SSP, DSSP and DASP is a reply the server holds back; ASP's server never holds one.

Why a delta, applied as ``delta / world_size``: the user's optimizer runs unchanged on the worker (its state,
momentum included, stays local), and for an update linear in the gradient the mean of the workers' deltas from
the same parameters is exactly the step ddp takes on the mean gradient. So BSP on this server reproduces ddp's
trajectory for SGD with or without momentum (a test proves it), and every paradigm has ddp's per-sample learning
rate. A non-linear optimizer (Adam) gives the mean of the workers' steps instead: local SGD's usual reading.

The rule runs on every shard's own clocks (the pushes that shard applied): a reply from shard ``j`` holds every
update the rule requires *of shard* ``j``, which is the staleness guarantee, with one round trip and no coordinator.
Shards see the same pushes per worker in order, but interleaved differently with other workers' pushes. DSSP's
grants may then differ between shards for a moment: a worker waits for the strictest, and the slowest worker is
allowed on every shard, so somebody always moves. DASP's states and offsets must not differ: two shards that put
a rejoining worker's count at different offsets can each hold one of two workers for the other, for ever. So a
rule's per-worker state (``StalenessRule.decision``) is decided by the worker's own shard, at its push, and the
push carries it to the other shards, which adopt it.

Plumbing (gloo): two process groups made once, by every rank in the same order: requests (workers to servers)
and replies (servers to workers), so that a server's receive-from-anyone never takes a reply. A worker posts its
reply receives before it sends, and before it waits on its own shard, so that no server blocks sending a reply
nobody receives. Its own shard it serves in-process (gloo has no send-to-self). Wire format: one flat float32
buffer per message, a 4-number header and the shard's payload. Every wait has a timeout that names the rank it
waited for. A worker that finishes sends STOP; its clock no longer holds anybody back, and a server thread ends
once every other worker has stopped.

Rounds (the strategies meet at every round's end, ``server_scheme.py``): a worker sends END_ROUND before the round's
collective. Every shard counts each worker's ended rounds, and clocks count pushes within a round, so the rule
compares a worker with the others *in its own round*: one that has not pushed in it yet counts at clock 0 (its
END_ROUND may still be on the way: everybody who passed the collective starts the round from the same base, so the
bound holds from the round's first step); one that already ended it counts at the clock it ended it at, and a worker
the rule would hold back only for such workers is answered at once with a *closed* grant (it takes no further step
in the round: the push it would wait for comes only after the collective it must reach). Under a lockstep rule (BSP)
a round is also closed for everybody at the clock where one worker takes no further step (each push says whether it
does), so that every worker takes the same steps. A round starts from one
server state for every rank: a worker's pull before its first push of a round returns the shard as it stood before
anybody's push of that round (:meth:`Shard.round_start`), however late the worker comes out of the collective.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oscars.dist._c10d import new_gloo_group, retire_group
from lightning_oscars.core.shard import Shard, shard_bounds
from lightning_oscars.core.staleness import StalenessRule

__all__ = ["ParameterServer", "Shard", "shard_bounds"]

# Header of every request: operation, worker rank, the worker's clock after the push, its busy seconds, whether it
# takes another step in its round (1 or 0), and the rule's decision for the worker (``StalenessRule.decision``,
# zero-padded).
_DECISION = 2
_HEADER = 5 + _DECISION
_PUSH, _PULL, _STOP, _END_ROUND = 1.0, 2.0, 3.0, 4.0


class ParameterServer:
    """Every rank's part of the parameter server: the server of its own shard (a background thread) and the
    worker's round trips to every shard. Collective to build (every rank, same order); see the module docstring.

    Args:
        flat: the initial parameters, flat (the same on every rank); copied.
        rule: the staleness rule every shard applies.
        group_factory: makes a process group over every rank (``torch.distributed.new_group`` by default).
        timeout_s: the longest a worker waits for a reply before it names the server rank.
        peer_failure: asked about once a second while a worker waits on its own shard: a reason it returns (another
            rank reported an error, e.g. in the rendezvous store) ends the wait instead of the timeout.
    """

    def __init__(
        self,
        flat: Tensor,
        rule: StalenessRule,
        *,
        group_factory: Callable[[], Any] | None = None,
        timeout_s: float = 1800.0,
        peer_failure: Callable[[], str | None] | None = None,
        momentum: float = 0.0,
    ) -> None:
        self.peer_failure = peer_failure
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        make = group_factory or new_gloo_group
        self._requests: Any = make()
        self._replies: Any = make()
        self.bounds = shard_bounds(flat.numel(), self.world_size)
        start, end = self.bounds[self.rank]
        values = flat.detach().to("cpu", torch.float32).reshape(-1)[start:end].clone()
        self.shard = Shard(values, self.world_size, rule, momentum=momentum)
        self.timeout_s = float(timeout_s)
        self.clock = 0
        self.waited_s = 0.0
        self.round_closed = False  # at the last push_pull, under a lockstep rule (see push_pull)
        self._closed = False
        self._error: BaseException | None = None
        self._pending: list[int] = []  # remote workers whose reply from this shard waits for the rule
        self._farewell: list[tuple[int, Any, Tensor]] = []  # STOP messages posted by abandon(), never waited for
        self._replying = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"oscars-ps-{self.rank}", daemon=True)
        self._thread.start()

    @property
    def numel(self) -> int:
        return self.bounds[-1][1]

    # ------------------------------------------------------------------ the server

    def _serve(self) -> None:
        start, end = self.bounds[self.rank]
        buffer = torch.empty(_HEADER + end - start, dtype=torch.float32)
        running = self.world_size - 1
        try:
            while running > 0:
                src = dist.recv(buffer, group=self._requests)
                op, worker = float(buffer[0]), int(buffer[1])
                if worker != src:
                    raise RuntimeError(f"request from rank {src} claims to come from rank {worker}")
                if op == _STOP:
                    running -= 1
                    self.shard.stop(worker)
                elif op == _PUSH:
                    decided = buffer[5 : 5 + self.shard.rule.decision_size].tolist()
                    more = bool(buffer[4] > 0.5)
                    self.shard.push(worker, buffer[_HEADER:], int(buffer[2]), float(buffer[3]), decided, more)
                    self.shard.may_start(worker, first=True)  # counts a held reply
                    with self._replying:
                        self._pending.append(worker)
                elif op == _END_ROUND:
                    self.shard.end_round(worker)
                else:  # a pull: the parameters to continue from, whatever the clocks
                    with self._replying:
                        self._reply(worker, self.shard.round_start(worker))
                self._answer()
        except BaseException as error:  # noqa: BLE001 - a peer died: the workers' timeouts name it
            self._error = error

    def _answer(self) -> None:
        """Reply to every remote worker the rule now lets start. Called by the server thread after each request and
        by the local worker after its own push (which may release a remote worker while the server thread sleeps
        in its receive)."""
        with self._replying:
            still = []
            for waiting in self._pending:
                if self.shard.may_start(waiting):
                    self._reply(waiting, self.shard.grant(waiting))
                else:
                    still.append(waiting)
            self._pending = still

    def _reply(self, worker: int, values: Tensor) -> None:
        """Send ``worker`` its reply (under ``_replying``). A worker that died meanwhile is stopped on this shard
        instead: its clock holds nobody back, and the server goes on serving the others (a server thread that died
        on it would leave every live worker's next push to this rank unreceived, a gloo send waiting for ever)."""
        try:
            dist.send(values, dst=worker, group=self._replies)
        except Exception:  # noqa: BLE001 - the worker's own push or pull fails on its side, if it is alive at all
            self.shard.stop(worker)

    # ------------------------------------------------------------------ the worker

    def _round_trip(self, op: float, payload: Tensor | None, busy_s: float, more: bool = True) -> Tensor:
        """Send ``op`` to every remote shard (with its slice of ``payload``), handle the own shard, gather replies."""
        out = torch.empty(self.numel, dtype=torch.float32)
        receives = []
        for server, (start, end) in enumerate(self.bounds):
            if server != self.rank:
                receives.append((server, dist.irecv(out[start:end], src=server, group=self._replies)))
        start, end = self.bounds[self.rank]
        began = time.perf_counter()
        decision: tuple[float, ...] = ()
        if op == _PUSH:  # the own shard first: it decides the rule's state for this worker, the push carries it
            assert payload is not None
            decision = self.shard.push(self.rank, payload[start:end], self.clock, busy_s, more=more)
        sends = self._send_to_servers(op, payload, busy_s, decision, more)
        if op == _PUSH:
            self._answer()
            out[start:end] = self._own_grant(sends, receives)
            # The own shard saw every push of this clock (or a peer's end of the round) before it granted: its word
            # on the round's closing is everybody's.
            self.round_closed = self.shard.closed[self.rank]
        else:
            out[start:end] = self.shard.round_start(self.rank)
            self._await_all(sends, receives)
        self.waited_s += time.perf_counter() - began
        return out

    def _own_grant(self, sends: list[tuple[int, Any, Tensor]], receives: list[tuple[int, Any]]) -> Tensor:
        """This worker's grant from its own shard, then the other shards' replies. While the rule holds the worker
        back, the other shards' sends and receives are waited for on a helper thread: a dead peer's connection fails
        them at once, and that ends the own shard's wait too (which may be waiting for that peer's push, for ever;
        a pending gloo operation cannot be polled, and the server thread's receive from anyone does not fail)."""
        failed: list[BaseException] = []
        watchers: list[threading.Thread] = []

        def watch() -> None:
            try:
                self._await_all(sends, receives)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting worker
                failed.append(error)
                self.shard.wake()

        def hold() -> None:  # the rule holds this worker back: watch the other shards meanwhile
            watchers.append(threading.Thread(target=watch, name=f"oscars-ps-watch-{self.rank}", daemon=True))
            watchers[0].start()

        def failure() -> str | None:
            if failed:
                return str(failed[0])
            return self.peer_failure() if self.peer_failure is not None else None

        try:
            granted = self.shard.wait(self.rank, self.timeout_s, failure, on_hold=hold)
        except Exception as error:
            if failed:  # the peer's own error says more than "stopped waiting"
                raise failed[0] from error
            raise
        if not watchers:  # granted at once
            self._await_all(sends, receives)
        else:
            watchers[0].join()
        if failed:
            raise failed[0]
        return granted

    def _await_all(self, sends: list[tuple[int, Any, Tensor]], receives: list[tuple[int, Any]]) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        for server, work, _ in sends:
            self._await(work, server, timeout)
        for server, work in receives:
            self._await(work, server, timeout)

    def _send_to_servers(
        self,
        op: float,
        payload: Tensor | None,
        busy_s: float,
        decision: Sequence[float] = (),
        more: bool = True,
        servers: Sequence[int] | None = None,
    ) -> list[tuple[int, Any, Tensor]]:
        """Start sending ``op`` to every remote server (or to ``servers``), with its shard's slice of ``payload``
        (zeros without one) and the rule's ``decision`` for this worker: ``(server, work, message)``, the message
        kept alive until its send completes."""
        if len(decision) > _DECISION:
            raise ValueError(f"a rule's decision has at most {_DECISION} numbers, got {len(decision)}")
        sends = []
        for server, (start, end) in enumerate(self.bounds):
            if server == self.rank or (servers is not None and server not in servers):
                continue
            message = torch.zeros(_HEADER + end - start, dtype=torch.float32)
            message[: 5 + len(decision)] = torch.tensor([op, self.rank, self.clock, busy_s, float(more), *decision])
            if payload is not None:
                message[_HEADER:] = payload[start:end]
            sends.append((server, dist.isend(message, dst=server, group=self._requests), message))
        return sends

    def _await(self, work: Any, server: int, timeout: timedelta) -> None:
        """Wait for one send or receive. Blocking: a gloo wait that timed out cannot be resumed. A peer that dies
        closes its connection, which ends the wait at once; one that raised stops its worker (``close``), which
        releases whoever waits for it."""
        try:
            work.wait(timeout)
        except Exception as error:
            raise RuntimeError(
                f"parameter server: rank {self.rank} got no answer from rank {server}'s shard (that rank died,"
                f" stopped serving, or hung past the {timeout.total_seconds():.0f} s timeout): {error}"
            ) from error

    def push_pull(self, delta: Tensor, busy_s: float = 0.0, more: bool = True) -> Tensor:
        """Push this worker's update ``delta`` (flat, like the parameters) and return the flat parameters to start
        the next iteration from, once the rule allows. ``busy_s``: the iteration's compute time (the rules' timing).
        ``more``: this worker takes another step in its round if allowed. Under a lockstep rule :attr:`round_closed`
        then says whether it may: ``False`` once any worker takes no further step in the round."""
        if self._closed:
            raise RuntimeError("the parameter server is closed")
        if delta.numel() != self.numel:
            raise ValueError(f"the update has {delta.numel()} elements, the parameters {self.numel}")
        self.clock += 1
        return self._round_trip(_PUSH, delta.detach().to("cpu", torch.float32).reshape(-1), busy_s, more)

    def pull(self) -> Tensor:
        """The parameters to continue from, without pushing or waiting: right after :meth:`end_round` (before this
        worker's first push of the new round) the server's state at the meeting, the same for every worker however
        late it pulls (:meth:`Shard.round_start`); after a push of the round, the current parameters."""
        if self._closed:
            raise RuntimeError("the parameter server is closed")
        return self._round_trip(_PULL, None, 0.0)

    def _tell(self, op: float) -> None:
        """Send ``op`` (no payload, no reply) to every remote server and wait until it left."""
        timeout = timedelta(seconds=self.timeout_s)
        for server, work, _ in self._send_to_servers(op, None, 0.0):
            self._await(work, server, timeout)

    def end_round(self) -> None:
        """This worker's round is over (it is about to meet the others): it holds nobody back for the rest of the
        round, and its clock restarts from the next round's start. Call it before the round's collective, so that a
        worker the rule holds back for this one is released and reaches the collective too; every rank calls it
        at every meeting (the shards count rounds by it)."""
        if self._closed:
            raise RuntimeError("the parameter server is closed")
        self.clock = 0
        self.shard.end_round(self.rank)
        self._answer()
        self._tell(_END_ROUND)

    def _stop_working(self) -> bool:
        """This worker pushes no more: its clock holds nobody back (``False``: it had stopped already)."""
        if self._closed:
            return False
        self._closed = True
        self.shard.stop(self.rank)
        self._answer()  # nobody waits for this worker any more
        return True

    def abandon(self) -> None:
        """This worker stops now, waiting for nobody (a peer is lost): its clock holds nobody back, and every server
        is sent STOP without waiting for it to be taken (a server whose rank died, or a busy one, may never take it;
        the messages stay referenced until the process ends)."""
        if not self._stop_working():
            return
        for server in range(self.world_size):
            try:
                self._farewell += self._send_to_servers(_STOP, None, 0.0, servers=[server])
            except Exception:  # noqa: BLE001 - a dead peer's connection may refuse the send at once: nothing to tell it
                pass

    def close(self, wait_s: float | None = None, strict: bool = True) -> None:
        """This worker is done: tell every server, then wait (``wait_s``, by default the timeout) until this rank's
        server has served everyone. Every rank calls it (its server ends when every other worker has stopped).
        ``strict``: raise if the server is still waiting or failed (else leave its daemon thread to the process)."""
        if not self._stop_working():
            return
        try:
            self._tell(_STOP)
        except RuntimeError:
            if strict:
                raise
        self._thread.join(self.timeout_s if wait_s is None else wait_s)
        if not self._thread.is_alive():  # its server is done: nothing of this rank uses the groups any more
            retire_group(self._requests)
            retire_group(self._replies)
        if not strict:
            return
        if self._thread.is_alive():
            raise RuntimeError(f"parameter server: rank {self.rank}'s server still waits for other ranks to stop")
        if self._error is not None:
            raise RuntimeError(f"parameter server: rank {self.rank}'s server failed: {self._error}") from self._error

    def gather_velocity(self, device: torch.device | str = "cpu") -> Tensor | None:
        """Every shard's momentum buffer, whole and flat, on every rank (on the CPU). Collective over the default
        group, its all-reduce on ``device``: every rank, between rounds, when no push is in flight. ``None`` without
        server momentum (the same answer on every rank)."""
        own = self.shard.velocity_copy()
        if own is None:
            return None
        whole = torch.zeros(self.numel, dtype=torch.float32, device=device)
        start, end = self.bounds[self.rank]
        whole[start:end] = own.to(device)
        dist.all_reduce(whole)
        return whole.cpu()

    def load_velocity(self, whole: Tensor) -> None:
        """Resume this shard's momentum buffer from a whole one (:meth:`gather_velocity`'s)."""
        if whole.numel() != self.numel:
            raise ValueError(f"a server momentum buffer of {whole.numel()} values cannot resume {self.numel}")
        start, end = self.bounds[self.rank]
        self.shard.load_velocity(whole.reshape(-1)[start:end].to(torch.float32))

    def staleness(self) -> Sequence[int]:
        """Staleness at every grant of this rank's shard (see :class:`Shard`)."""
        return list(self.shard.staleness)
