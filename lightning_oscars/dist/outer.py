"""An outer optimizer on the averaged pseudo-gradient (DiLoCo's update), as a synchronisation scheme.

Plain averaging sets every rank's model to the mean of the ranks' models at each round's end. With long rounds
that mean moves the model by the *average local progress*, ``x_start - mean``, with step size 1 and no memory.
:class:`OuterNesterovAveraging` treats that difference as a gradient (the pseudo-gradient ``g``) of an outer SGD
with Nesterov momentum::

    m  <- mu * m + g
    x  <- x_start - lr * (g + mu * m)

so progress that keeps pointing the same way across rounds accelerates (DiLoCo uses ``lr=0.7, mu=0.9``). Only
the module's trainable parameters take the outer step; buffers (BatchNorm statistics), averaged copies (EMA) and
optimizer state are averaged as before. The round still costs one all-reduce: the outer step is local
arithmetic on the averaged tensors, identical on every rank. It keeps two copies of the trainable parameters
(the round's start point and the momentum), saved in checkpoints.

The first averaging of a fit (or after a resume without saved state) is plain: it sets the common start point.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_oscars.dist.schemes import ModelAveraging, RoundMeeting

__all__ = ["OuterNesterovAveraging", "outer_nesterov_step"]


def outer_nesterov_step(
    start: Sequence[Tensor], averaged: Sequence[Tensor], momentum: Sequence[Tensor], lr: float, mu: float
) -> None:
    """One outer step, in place: ``momentum`` and ``start`` are updated, and ``averaged`` (the tensors the model
    uses) receives the new point. Pure tensor arithmetic, no communication."""
    with torch.no_grad():
        for x0, avg, m in zip(start, averaged, momentum):
            g = x0 - avg
            m.mul_(mu).add_(g)
            x0.sub_(g.add_(m, alpha=mu), alpha=lr)
            avg.copy_(x0)


class OuterNesterovAveraging(ModelAveraging):
    """Model averaging followed by an outer Nesterov-SGD step on the pseudo-gradient (see the module docstring).

    Args:
        lr: outer learning rate (1.0 with ``mu=0`` is plain averaging).
        mu: outer momentum.
    """

    name = "outer_nesterov"

    def __init__(self, lr: float = 0.7, mu: float = 0.9, device: torch.device | str | None = None) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0.0 < lr <= 10.0:
            raise ValueError(f"outer_lr must lie in (0, 10], got {lr!r}")
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0.0 <= mu < 1.0:
            raise ValueError(f"outer_momentum must lie in [0, 1), got {mu!r}")
        super().__init__(device)
        self.lr = float(lr)
        self.mu = float(mu)
        self._trainable: set[int] = set()
        self._start: list[Tensor] = []
        self._momentum: list[Tensor] = []
        self._pending: dict[str, Any] | None = None

    def bind(self, parameters: Iterable[Tensor]) -> None:
        """The tensors that take the outer step: the module's trainable parameters (called once per fit)."""
        self._trainable = {id(p) for p in parameters}

    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        self.average(tensors, meeting)
        targets = [t for t in tensors if id(t) in self._trainable]
        if self._pending is not None:
            self._restore(targets)
        if len(self._start) != len(targets) or any(s.shape != t.shape for s, t in zip(self._start, targets)):
            # the first averaging (or the parameters changed): it sets the common start point
            self._start = [t.detach().clone() for t in targets]
            self._momentum = [torch.zeros_like(t) for t in targets]
            return
        outer_nesterov_step(self._start, [t.data for t in targets], self._momentum, self.lr, self.mu)

    def _restore(self, targets: Sequence[Tensor]) -> None:
        state, self._pending = self._pending, None
        assert state is not None
        start, momentum = state["start"], state["momentum"]
        if len(start) == len(targets) and all(s.shape == t.shape for s, t in zip(start, targets)):
            self._start = [s.to(t.device, t.dtype).clone() for s, t in zip(start, targets)]
            self._momentum = [m.to(t.device, t.dtype).clone() for m, t in zip(momentum, targets)]

    def state_dict(self) -> dict[str, Any]:
        return {"start": [s.cpu() for s in self._start], "momentum": [m.cpu() for m in self._momentum]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Resume the start point and momentum at the next averaging (when the tensors are known)."""
        self._pending = state if state and state.get("start") else None

    def release(self) -> None:
        super().release()
        self._start, self._momentum = [], []
