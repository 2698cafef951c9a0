"""What a round averages on this rank, the shapes the ranks last agreed on, and what each tensor is called (for an
error naming one). See ``dist/layouts.py`` for how a rank whose shapes changed is found without a collective more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import Tensor

from lightning_oscars.dist.averaging import agree_on_layout, averaged_tensors, optimizer_state_layout
from lightning_oscars.dist.layouts import Layout, describe_mismatch, gather_shapes, layout_of
from lightning_oscars.dist.local_state import LocalState
from lightning_oscars.dist.sharding import reshard_gathered
from lightning_oscars.lightning import _internals as internals

__all__ = ["RoundLayout", "model_tensors", "round_tensors", "tensor_namer"]


def model_tensors(strategy: Any, trainer: Trainer) -> list[Tensor]:
    """The model's part of a round's tensors (their first ones): trainable parameters, persistent buffers and averaged
    copies. Their shapes are the user's to change; the rest (optimizer state, moving frozen tensors) change alike on
    every rank, as the ranks agree."""
    return averaged_tensors(strategy.lightning_module, extra_modules=internals.averaged_copies(trainer))


def round_tensors(
    strategy: Any, trainer: Trainer, local_state: LocalState | None, average_optimizer_state: bool
) -> list[Tensor]:
    """What a round combines: trainable parameters, persistent buffers, averaged copies of the model kept by
    callbacks (EMA), frozen tensors user code moves, and, if asked, the optimizer state every rank holds."""
    extra = internals.averaged_copies(trainer)
    module = strategy.lightning_module
    assert module is not None
    reshard_gathered([module, *extra])  # a forward without backward may have left shards gathered
    moving = local_state.averaged() if local_state is not None else []  # frozen, yet moved by user code
    if not average_optimizer_state:
        return averaged_tensors(module, extra_modules=extra) + moving
    # Which parameters have optimizer state differs between ranks (a head some rank never used): only the state
    # every rank holds is averaged, so that all ranks pack buffers of one layout.
    mask = agree_on_layout(optimizer_state_layout(strategy.optimizers), strategy.root_device)
    return averaged_tensors(module, strategy.optimizers, state_mask=mask, extra_modules=extra) + moving


def tensor_namer(strategy: Any, trainer: Trainer, tensors: list[Tensor]) -> Callable[[int], str]:
    """``name(i)``: what ``tensors[i]`` is (a parameter or buffer of the module by its name, one of an averaged copy,
    or optimizer state)."""
    names: dict[int, str] = {}
    module = strategy.lightning_module
    for index, copy in enumerate(internals.averaged_copies(trainer)):
        for name, tensor in [*copy.named_parameters(), *copy.named_buffers()]:
            names.setdefault(id(tensor), f"averaged copy {index}'s {name!r}")
    if module is not None:
        names.update({id(t): f"parameter {n!r}" for n, t in module.named_parameters()})
        names.update({id(t): f"buffer {n!r}" for n, t in module.named_buffers()})
    return lambda i: (
        names.get(id(tensors[i]), f"tensor {i} (optimizer or callback state)") if i < len(tensors) else (f"tensor {i}")
    )


class RoundLayout:
    """The shapes of the model's tensors the ranks last agreed on (at training start every rank holds rank 0's).

    A round sends :meth:`to_send`: the tensors, or, where this rank's model no longer has the agreed shapes, zeros of
    them (the round's buffer keeps its length on every rank) and a flag in the round's control data. After the round,
    :meth:`settle` with the flags' sum: if any rank flagged, every rank gathers every rank's shapes and raises the same
    error naming what differs, or, where every rank changed alike, takes the new shapes (that round averaged nothing).
    No collective is added to a round in which no rank flagged. Sharded replicas are not checked (their tensors are
    shards)."""

    def __init__(self, sharded: bool) -> None:
        self.sharded = sharded
        self.agreed: Layout | None = None

    def record(self, model: list[Tensor]) -> None:
        self.agreed = None if self.sharded else layout_of(model)

    def to_send(self, tensors: list[Tensor], model: int, device: torch.device) -> tuple[list[Tensor], float]:
        """What this rank sends, and its flag; ``model``: how many of ``tensors`` are the model's."""
        agreed = self.agreed
        if agreed is None or layout_of(tensors[:model]) == agreed:
            return tensors, 0.0
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in agreed]
        return zeros + tensors[model:], 1.0

    def settle(self, flags: float, tensors: list[Tensor], model: int, strategy: Any, trainer: Trainer) -> None:
        if flags < 0.5:
            return
        mine = [tuple(t.shape) for t in tensors[:model]]
        everyone = gather_shapes(mine)  # every rank is here: the flags rode in the round's control data
        if all(shapes == mine for shapes in everyone):
            self.agreed = layout_of(tensors[:model])
            return
        raise ValueError(describe_mismatch(everyone, tensor_namer(strategy, trainer, tensors)))
