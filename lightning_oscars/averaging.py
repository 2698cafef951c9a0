"""Model averaging over one flat buffer, with the round's control data riding on the same all-reduce.

:func:`averaged_tensors` decides *what* is averaged; :class:`FlatAverager` packs it into a persistent
buffer (weighted), appends a control vector, runs one ``SUM`` all-reduce and writes the weighted mean
back. Nothing here knows about Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["FlatAverager", "averaged_tensors"]


def averaged_tensors(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> list[Tensor]:
    """Parameters, every buffer (BatchNorm statistics and counters) and, if given, the optimizers' per-parameter
    state tensors, in an order every rank reproduces."""
    tensors: list[Tensor] = [p for p in module.parameters()]
    tensors += [b for b in module.buffers()]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0:
                        tensors.append(value)
    return tensors


class FlatAverager:
    """Weighted averaging of a fixed list of tensors across ranks with a single all-reduce.

    Every rank contributes ``weight * x_i`` and its control vector; after the ``SUM`` all-reduce each tensor
    becomes ``sum_i w_i x_i / sum_i w_i`` where ``sum_i w_i`` is read from the summed control vector at index
    ``weight_index``. Integer tensors (e.g. ``num_batches_tracked``) are averaged too and rounded, so that
    they agree on every rank.
    """

    def __init__(self, tensors: Sequence[Tensor], control_size: int, device: torch.device) -> None:
        if not tensors:
            raise ValueError("nothing to average: the module has no parameters or buffers")
        self.tensors = list(tensors)
        self.control_size = control_size
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in self.tensors) else torch.float32
        self.numel = sum(t.numel() for t in self.tensors)
        self.buffer = torch.empty(self.numel + control_size, dtype=dtype, device=device)

    @property
    def control(self) -> Tensor:
        return self.buffer[self.numel :]

    def pack(self, weight: float, control: Sequence[float]) -> None:
        if len(control) != self.control_size:
            raise ValueError(f"control has {len(control)} entries, expected {self.control_size}")
        offset = 0
        for tensor in self.tensors:
            n = tensor.numel()
            self.buffer[offset : offset + n].copy_(tensor.detach().reshape(-1))
            offset += n
        self.buffer[: self.numel].mul_(weight)
        self.control.copy_(torch.tensor(control, dtype=self.buffer.dtype))

    def unpack(self, total_weight: float) -> None:
        if total_weight <= 0.0:
            raise ValueError(f"total weight must be > 0, got {total_weight!r}")
        self.buffer[: self.numel].div_(total_weight)
        offset = 0
        with torch.no_grad():
            for tensor in self.tensors:
                n = tensor.numel()
                chunk = self.buffer[offset : offset + n].view(tensor.shape)
                if not tensor.is_floating_point():
                    chunk = chunk.round()
                tensor.copy_(chunk)
                offset += n

    def all_reduce(
        self, weight: float, control: Sequence[float], weight_index: int, group: dist.ProcessGroup | None = None
    ) -> list[float]:
        """Average in place; return the summed control vector (the one collective of a round)."""
        self.pack(weight, control)
        dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, group=group)
        summed = self.control.tolist()
        self.unpack(summed[weight_index])
        return summed
