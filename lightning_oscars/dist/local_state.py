"""State a rank changes during local steps outside its trainable parameters, made equal where the ranks meet.

Local SGD keeps the ranks' models equal only if every tensor a local step may change takes part in the meeting.
Trainable parameters and buffers always do (``averaging.averaged_tensors``). Three more kinds of state come from
ordinary research code, and this module handles each:

* **Frozen parameters that move.** A momentum teacher (BYOL, MoCo, DINO) is a copy of the model with
  ``requires_grad=False``, moved towards the student inside ``training_step``. Frozen parameters are not averaged by
  default (a fine-tune's frozen backbone would be all-reduced every round for nothing), so :class:`MovingFrozen`
  watches them: a fingerprint of each (its sum and its norm, in float64) taken after every meeting is compared at the
  next, every rank says which ones moved (flags that ride in the round's control data), and a frozen parameter that
  moved on any rank is averaged from that meeting on, first in a small catch-up averaging of its own.
* **Callback state.** A callback's ``state_dict`` tensors (an EMA of the weights kept by a user's callback) are
  averaged at every meeting: an EMA is linear in the weights, so the mean of the ranks' EMAs is the EMA of the mean.
  :func:`callback_state_tensors` lists them; a callback that holds tensors elsewhere may say which by defining
  ``averaged_state_tensors() -> list[Tensor]`` (the :class:`AveragedState` protocol).
* **Derived state.** Values computed from the parameters and cached between forwards are stale once the parameters
  are averaged: pruning's masked weight (an attribute its forward pre-hook recomputes, read by the next pruning as
  its importance) and spectral norm's power-iteration vectors (unit vectors, which an average leaves shorter).
  :func:`refresh_derived` recomputes the one and re-normalises the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_oscars.core._nn_state import refresh_derived
from lightning_oscars.dist.averaging import FlatAverager
from lightning_oscars.dist.sharding import local_part, split_sharded

__all__ = [
    "AveragedState",
    "LocalState",
    "MovingFrozen",
    "average_tensors",
    "callback_state_tensors",
    "refresh_derived",
    "state_tensors",
]


@runtime_checkable
class AveragedState(Protocol):
    """A callback whose state must be equal on every rank after each meeting, held outside its ``state_dict``: the
    tensors it returns are averaged in place (floating point, weighted like the model)."""

    def averaged_state_tensors(self) -> list[Tensor]: ...


def _fingerprint(tensor: Tensor) -> Tensor:
    flat = local_part(tensor.detach()).reshape(-1)  # a sharded parameter: this rank's shard (no collective)
    if not flat.is_floating_point():
        flat = flat.to(torch.float64)
    return torch.stack([flat.sum(dtype=torch.float64), torch.linalg.vector_norm(flat, dtype=torch.float64)])


class MovingFrozen:
    """The module's frozen parameters (``requires_grad=False``), split into those seen moving (averaged with the
    model from then on) and those still watched. Every rank lists them in the module's order, so the flags of
    :meth:`moved_flags` line up across ranks."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._moving: set[int] = set()
        self._reference: dict[int, Tensor] = {}
        self.remember()

    def _frozen(self) -> Iterator[Tensor]:
        seen: set[int] = set()
        for param in self.module.parameters():
            if not param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                yield param

    @property
    def moving(self) -> list[Tensor]:
        """Frozen parameters some rank moved: averaged at every meeting."""
        return [p for p in self._frozen() if id(p) in self._moving]

    @property
    def watched(self) -> list[Tensor]:
        """Frozen parameters nobody has moved yet."""
        return [p for p in self._frozen() if id(p) not in self._moving]

    def moved_flags(self) -> list[float]:
        """Per watched parameter: 1.0 if it changed on this rank since :meth:`remember`, else 0.0 (a parameter frozen
        since then, by a callback that freezes a backbone, has no fingerprint yet and counts as unchanged)."""
        watched = self.watched
        if not watched:
            return []
        now = torch.stack([_fingerprint(p) for p in watched]).cpu()  # one device-to-host copy for all of them
        flags = []
        for param, fingerprint in zip(watched, now):
            before = self._reference.get(id(param))
            flags.append(float(before is not None and not torch.equal(before, fingerprint)))
        return flags

    def adopt(self, summed_flags: Sequence[float]) -> list[Tensor]:
        """Given :meth:`moved_flags` summed over ranks: the watched parameters some rank moved, which are averaged from
        now on (returned, to be averaged once now)."""
        watched = self.watched
        if len(summed_flags) != len(watched):
            raise ValueError(f"{len(summed_flags)} flags for {len(watched)} watched frozen parameters")
        moved = [p for p, flag in zip(watched, summed_flags) if flag > 0]
        self._moving.update(id(p) for p in moved)
        return moved

    def remember(self) -> None:
        """Fingerprint the watched parameters as they are now (after a meeting)."""
        watched = self.watched
        if not watched:
            self._reference = {}
            return
        prints = torch.stack([_fingerprint(p) for p in watched]).cpu()
        self._reference = {id(p): fingerprint for p, fingerprint in zip(watched, prints)}


def _walk(state: Any) -> Iterator[Tensor]:
    """Floating-point tensors in a nested ``state_dict`` (keys sorted, so every rank walks the same order). Integers
    are counters, the same on every rank; a checkpoint callback's best score, decided by every rank alike, is
    averaged unchanged."""
    if isinstance(state, Tensor):
        if state.is_floating_point():
            yield state
    elif isinstance(state, Mapping):
        for key in sorted(state, key=str):
            yield from _walk(state[key])
    elif isinstance(state, (list, tuple)):
        for item in state:
            yield from _walk(item)


def state_tensors(obj: Any) -> tuple[Any, list[Tensor]]:
    """``obj``'s ``state_dict()`` and the tensors of it that a meeting averages."""
    if isinstance(obj, AveragedState):
        return None, list(obj.averaged_state_tensors())
    state = obj.state_dict()
    return state, list(_walk(state))


def callback_state_tensors(callbacks: Iterable[Any]) -> list[tuple[Any, Any, list[Tensor]]]:
    """Per callback holding tensors: ``(callback, its state_dict or None, the tensors averaged)``."""
    held = []
    for callback in callbacks:
        state, tensors = state_tensors(callback)
        if tensors:
            held.append((callback, state, tensors))
    return held


def write_back(held: Sequence[tuple[Any, Any, list[Tensor]]]) -> None:
    """After the tensors of :func:`callback_state_tensors` were averaged in place: a callback whose ``state_dict``
    handed out copies (not its live tensors) gets the averaged state through its ``load_state_dict``."""
    for callback, state, tensors in held:
        if state is None:
            continue
        _, live = state_tensors(callback)
        if len(live) != len(tensors) or any(a is not b for a, b in zip(live, tensors)):
            callback.load_state_dict(state)


def average_tensors(
    tensors: Sequence[Tensor], weight: float, device: torch.device, group: Any = None, shard_group: Any = None
) -> None:
    """The weighted mean of ``tensors`` over ranks, in place, in one all-reduce (collective: every rank, the same
    layout). Sharded parameters (sharded replicas) are averaged shard by shard over ``shard_group``, in one more."""
    shards, rest = split_sharded(tensors)
    if shards:
        FlatAverager(shards, 1, device).all_reduce(weight, [weight], 0, group=shard_group)
    if rest or not shards:
        FlatAverager(rest, 1, device).all_reduce(weight, [weight], 0, group=group)


def agree_on_numel(tensors: Sequence[Tensor], device: torch.device, what: str, group: Any = None) -> None:
    """Raise on every rank alike unless every rank holds as many elements in ``tensors`` (one small all-reduce): an
    all-reduce of buffers of different sizes would fail on one rank and hang or crash the others."""
    numel = sum(t.numel() for t in tensors)
    packed = torch.tensor([numel, -numel, len(tensors), -len(tensors)], dtype=torch.int64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    most, fewest = int(packed[0]), -int(packed[1])
    if most != fewest or int(packed[2]) != -int(packed[3]):
        raise RuntimeError(
            f"{what} differ between ranks ({fewest} to {most} elements; this rank: {numel} in {len(tensors)}"
            " tensors), so they cannot be averaged. Create such state on every rank alike (in setup or"
            " on_train_start, not after a rank's first real step)."
        )


class LocalState:
    """One fit's local state beyond the averaged tensors, taken through every meeting: the moving frozen parameters
    (averaged with the model once seen moving), the callbacks' tensors and the derived state.

    At a meeting, :meth:`control_tail` is appended to the round's control data (it rides in the meeting's own
    collective); once the meeting is over, :meth:`settle` gets its sum over ranks and acts on it the same way on every
    rank, so any collective it makes happens on all ranks or on none.
    """

    def __init__(self, module: nn.Module, shard_group: Any = None) -> None:
        self.module = module
        self.shard_group = shard_group  # sharded replicas: the ranks holding this rank's shards (dist/sharding.py)
        self.frozen = MovingFrozen(module)
        self._held: list[tuple[Any, Any, list[Tensor]]] = []

    def averaged(self) -> list[Tensor]:
        """Tensors to combine with the model at every meeting: the frozen parameters seen moving."""
        return self.frozen.moving

    def control_tail(self, callbacks: Iterable[Any]) -> list[float]:
        """This rank's entries for the meeting: whether a callback holds tensor state, and which watched frozen
        parameters moved here since the last meeting."""
        self._held = callback_state_tensors(callbacks)
        return [float(bool(self._held)), *self.frozen.moved_flags()]

    def settle(self, summed_tail: Sequence[float], device: torch.device) -> None:
        """After the meeting (``summed_tail``: :meth:`control_tail` summed over ranks): average the frozen parameters
        some rank moved for the first time and the callbacks' tensors (each in one all-reduce, only when some rank
        has any), then refresh the derived state."""
        moved = self.frozen.adopt(summed_tail[1:])
        if moved:
            average_tensors(moved, 1.0, device, shard_group=self.shard_group)
        if summed_tail[0] > 0:
            tensors = list({id(t): t for _, _, held in self._held for t in held}.values())  # each tensor once
            agree_on_numel(tensors, device, "callbacks' state tensors")
            if tensors:
                average_tensors(tensors, 1.0, device)
            write_back(self._held)
        self._held = []
        refresh_derived(self.module)
        self.frozen.remember()
