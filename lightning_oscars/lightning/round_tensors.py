"""What a round averages on this rank, and what each of those tensors is called (for an error naming one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from torch import Tensor

from lightning_oscars.dist.averaging import agree_on_layout, averaged_tensors, optimizer_state_layout
from lightning_oscars.dist.local_state import LocalState
from lightning_oscars.dist.sharding import reshard_gathered
from lightning_oscars.lightning import _internals as internals

__all__ = ["round_tensors", "tensor_namer"]


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
