"""The parameter-server paradigms as a synchronisation scheme: :class:`ParameterServerScheme`.

Rounds are deadline rounds (``deadline.py``): under a staleness rule a rank's steps per round are not known in
advance, so each rank trains while its next step fits before the round's deadline. After every real optimizer
step the rank pushes the step's delta to the in-job parameter server (``param_server.py``) and continues from the
parameters it returns, once the rule lets it (:meth:`ParameterServerScheme.after_step`). At the round's end
(:meth:`ParameterServerScheme.combine`, on every rank) the rank first tells the servers its round is over (it
then holds nobody back, so a rank waiting on it is released and reaches the collective too), then one all-reduce
carries the control data and averages what the server does not hold (buffers, averaged copies), then every rank
loads the server's parameters: validation, checkpoints and the end of fit see one model. Clocks restart at every
round's end, where everybody has met.

Under a lockstep rule (BSP) every worker takes exactly one step per clock, so within a round every rank takes the
same number of steps and, with SGD, the trajectory is ddp's. A rank's steps in a deadline round are decided by its
own clock, so the ranks agree through the server: every push says whether the rank takes another step in the round
(its next slot is decided then: :meth:`RoundSteps.continues_round`), and a grant says whether the round is
*closed* (some rank takes no further step, or ended the round). A closed round's remaining slots become no-op slots
on every rank (:meth:`RoundSteps.close_round`; the data they did not reach goes back to the epoch, as a deadline
round hands back what its ranks did not reach).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oscars.dist.averaging import flat_copy, load_flat
from lightning_oscars.dist.faults import FailureBoard
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.dist.param_server import ParameterServer
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.dist.schemes import ModelAveraging, RoundMeeting
from lightning_oscars.core.staleness import StalenessRule

__all__ = ["ParameterServerScheme"]


class RoundSteps(Protocol):
    """What a lockstep scheme asks of the rank's loader (``LoadBalancedLoader`` provides it)."""

    def continues_round(self) -> bool:
        """Whether this rank's next slot (fetched, or decided now) is a real step of the round now running."""
        ...

    def close_round(self) -> None:
        """Take no further real step in the round now running: its fetched and future slots become no-ops."""
        ...


def _first_error(board: FailureBoard) -> str | None:
    errors = board.errors()
    return "; ".join(f"rank {rank} failed: {text}" for rank, text in sorted(errors.items())) if errors else None


class ParameterServerScheme(ModelAveraging):
    """Push and pull after every real step under ``make_rule()``'s staleness rule; meet at every round's end.

    Args:
        make_rule: a fresh staleness rule for one fit.
        device: where the round-end all-reduce runs.
        timeout_s: the longest a worker waits for a server before it names the rank.
        server_momentum: the servers' momentum on every push they apply (``0``: none; the workers' optimizers keep
            theirs). Its buffer is gathered at every round's end (one more all-reduce of the model's size) so that
            checkpoints carry it.
    """

    name = "parameter_server"
    waits_within_rounds = True

    def __init__(
        self,
        make_rule: Callable[[], StalenessRule],
        device: torch.device | str | None = None,
        timeout_s: float = 600.0,
        server_momentum: float = 0.0,
    ) -> None:
        super().__init__(device)
        self.make_rule = make_rule
        self.server_momentum = float(server_momentum)
        self._velocity: Tensor | None = None  # the servers' momentum buffer at the last round's end, whole
        # Every rank takes one step per clock (BSP): the session packs a round's real steps at its start and lets the
        # server close rounds (see the module docstring).
        rule = make_rule()
        self.lockstep = bool(rule.lockstep)
        self.max_lead = rule.max_lead  # the rule's bound on any worker's lead (``None``: unbounded)
        self.timeout_s = timeout_s
        self.server: ParameterServer | None = None
        self._params: list[Tensor] = []
        self._base: Tensor | None = None  # the flat parameters this rank last received
        self._since = time.perf_counter()
        # The loader whose rounds a lockstep rule closes (set by the session); ``None``: every push says "more".
        self.round_steps: RoundSteps | None = None
        # The last fit's server figures, kept after it stopped: the staleness of every grant of this rank's shard,
        # the replies it held back, this worker's seconds in round trips, and the rule's state switches (DASP).
        self.report: dict[str, Any] = {}

    def shape_rounds(self, rounds: RoundController) -> None:
        if self.max_lead is not None:  # BSP: equal steps; SSP, DSSP: at most the bound and one more
            rounds.step_spread = self.max_lead + (0 if self.lockstep else 1)
        if self.lockstep and rounds.pacer is not None:
            # A lockstep round ends for everybody at the first rank that takes no further step (module docstring):
            # real steps packed at the round's start keep "no further step" from meaning "a no-op slot in between".
            rounds.pacer.packed = True

    def adopt_loader(self, loader: LoadBalancedLoader) -> None:
        self.round_steps = loader  # the server closes this loader's rounds

    def bind(self, parameters: Iterable[Tensor]) -> None:
        """Start this fit's server (collective: every rank, at the same point) from the module's parameters."""
        self.release()
        self._params = list(parameters)
        self._base = flat_copy(self._params)
        board = FailureBoard.from_default_group(dist.get_world_size())
        failure = None if board is None else lambda: _first_error(board)
        self.server = ParameterServer(
            self._base, self.make_rule(), timeout_s=self.timeout_s, peer_failure=failure, momentum=self.server_momentum
        )
        self._velocity = None
        self._since = time.perf_counter()

    def _load(self, flat: Tensor) -> None:
        load_flat(self._params, flat)
        # The next delta is taken from what the parameters hold: a bf16/fp16 parameter rounds the float32 value
        # it was given, and a base of the float32 value would push that rounding as an update without a step.
        exact = all(p.dtype == torch.float32 for p in self._params)
        self._base = flat if exact else flat_copy(self._params)

    def after_step(self) -> None:
        """A real optimizer step just ended: push its delta, continue from what the server returns."""
        if self.server is None or self._base is None:
            return
        busy = time.perf_counter() - self._since
        delta = flat_copy(self._params) - self._base
        steps = self.round_steps
        if steps is None:
            self._load(self.server.push_pull(delta, busy_s=busy))
        else:
            # Only a lockstep rule reads "more"; asking decides the next slot now, before this push's wait, which
            # the others' deadline pacing would rather decide after it.
            more = steps.continues_round() if self.lockstep else True
            self._load(self.server.push_pull(delta, busy_s=busy, more=more))
            if self.server.round_closed:
                steps.close_round()
        self._since = time.perf_counter()

    def abandon(self) -> None:
        """This worker stops now (its clock holds nobody back any more; every live server is told) and its server
        waits for nobody's last request."""
        if self.server is not None:
            self.server.abandon()

    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        server = self.server
        if server is None:
            self.average(tensors, meeting)
            return
        server.end_round()  # nobody waits for this rank any more this round
        held = {id(p) for p in self._params}
        self.average([t for t in tensors if id(t) not in held], meeting)
        # Nobody pushes again before every rank has joined this all-reduce, so every shard's buffer is the round's.
        if self.server_momentum:  # the same on every rank: all gather, or none
            self._velocity = server.gather_velocity(self.device or meeting.device)
        # Everybody is past the all-reduce, so every push of the round has been applied; the pull returns that
        # state even to a rank that pulls after a faster one pushed again: every rank starts the round from it.
        self._load(server.pull())
        self._since = time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        return {} if self._velocity is None else {"server_velocity": self._velocity}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        velocity = (state or {}).get("server_velocity")
        if velocity is None or self.server is None or not self.server_momentum:
            return
        if velocity.numel() != self.server.numel:
            raise ValueError(
                f"the checkpoint's server momentum buffer holds {velocity.numel()} values, the model's trainable"
                f" parameters {self.server.numel}: was it written for another model?"
            )
        self.server.load_velocity(velocity)
        self._velocity = velocity.clone()

    def release(self) -> None:
        super().release()
        server, self.server = self.server, None
        if server is not None:
            self.report = {
                "staleness": list(server.staleness()),
                "held": server.shard.held,
                "waited_s": server.waited_s,
                "switches": list(getattr(server.shard.rule, "switches", [])),
            }
            # Every rank releases at the fit's end; a peer that failed never stops its worker: do not wait long.
            server.close(wait_s=60.0, strict=False)
