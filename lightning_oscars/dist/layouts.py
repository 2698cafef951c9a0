"""Every rank averages tensors of the same shapes, or every rank learns which differ, before the round's all-reduce.

A round's one collective packs the model into a flat buffer; ranks whose buffers differ in length cannot meet in it
(gloo raises a size error on one rank while the others wait; NCCL may hang or add unrelated elements). A module that
keeps a persistent buffer shaped by its last batch is the usual cause. :func:`layout_mismatch` compares a fingerprint
of the shapes in one small all-reduce, the same on every rank, and only when they differ gathers each rank's shapes,
so that every rank raises the same error naming the tensor and each rank's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["describe_mismatch", "layout_fingerprint", "layout_mismatch"]

Shapes = list[tuple[int, ...]]
# The fingerprint's hash is kept exact in a float64 (53-bit mantissa).
_HASH_MODULUS = 2**50


def layout_fingerprint(shapes: Sequence[tuple[int, ...]]) -> list[float]:
    """Three numbers equal on ranks whose tensors have equal shapes: their count, total elements and a hash."""
    # hash() of a tuple of ints is the same in every process (only str and bytes hashes are salted).
    return [float(len(shapes)), float(sum(_numel(s) for s in shapes)), float(hash(tuple(shapes)) % _HASH_MODULUS)]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def layout_mismatch(
    tensors: Sequence[Tensor], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[Shapes] | None:
    """``None`` when every rank of ``group`` holds tensors of the same shapes; else every rank's shapes, by rank.
    Collective: every rank of ``group`` calls it (one 6-element all-reduce; a gather only on a mismatch)."""
    shapes = [tuple(t.shape) for t in tensors]
    mine = layout_fingerprint(shapes)
    packed = torch.tensor(mine + [-v for v in mine], dtype=torch.float64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    values = packed.tolist()
    if values[:3] == [-v for v in values[3:]]:
        return None
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
