"""Tensors whose shapes differ between ranks, named on every rank (``lightning/round_tensors.py`` uses these).

A round's one collective packs the model into a flat buffer; ranks whose buffers differ in length cannot meet in it
(gloo raises a size error on one rank while the others wait; NCCL may hang or add unrelated elements). A module that
keeps a persistent buffer shaped by its last batch is the usual cause. A rank whose model no longer has the shapes
the ranks last agreed on sends zeros of those shapes instead, with a flag in the round's control data; when any rank
flagged, every rank gathers every rank's shapes (:func:`gather_shapes`) and raises the same error
(:func:`describe_mismatch`), or, where all changed alike, takes the new shapes as agreed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Layout", "describe_mismatch", "gather_shapes", "layout_of"]

Shapes = list[tuple[int, ...]]
Layout = list[tuple[tuple[int, ...], torch.dtype]]


def layout_of(tensors: Sequence[Tensor]) -> Layout:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def gather_shapes(shapes: Shapes, group: dist.ProcessGroup | None = None) -> list[Shapes]:
    """Every rank's ``shapes``, by rank (collective: every rank of ``group``)."""
    gathered: list[Shapes | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, shapes, group=group)
    return [list(s or []) for s in gathered]


def describe_mismatch(by_rank: Sequence[Shapes], name_of: Callable[[int], str]) -> str:
    """What differs between the ranks' shapes (``name_of(i)``: what the ``i``-th tensor is), as an error message."""
    longest = max(len(shapes) for shapes in by_rank)
    lines = []
    for index in range(longest):
        seen = [shapes[index] if index < len(shapes) else None for shapes in by_rank]
        if len(set(seen)) > 1:
            per_rank = ", ".join(
                f"{tuple(shape) if shape is not None else 'absent'} on rank {r}" for r, shape in enumerate(seen)
            )
            lines.append(f"{name_of(index)}: {per_rank}")
    if not lines:  # the same shapes in another order
        lines.append("the tensors are the same but in different orders on different ranks")
    shown = "; ".join(lines[:8]) + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
    return (
        f"The ranks hold tensors of different shapes to average this round ({shown}). A persistent buffer (one in"
        " the state dict) is averaged every round and must have one shape on every rank: register a buffer the"
        " module rebuilds for its batch with persistent=False (it is then not averaged), or keep its shape fixed."
    )
