"""Model averaging over one flat buffer, with the round's control data riding on the same all-reduce.

:func:`averaged_tensors` decides *what* is averaged; :class:`FlatAverager` packs it into a persistent buffer,
appends a control vector, runs one ``SUM`` all-reduce and writes the mean back. Nothing here knows about
Lightning.

Wire layout of the buffer (float32, or float64 as soon as one averaged tensor is float64), the same on every rank::

    [ floating-point elements * weight | 8 digits per integer/bool element | caller's control | rank count ]

* Floating-point tensors get the weighted mean ``sum_i w_i x_i / sum_i w_i``; the caller puts ``w_i`` in its
  control vector and names the slot with ``weight_index``.
* Integer and bool tensors cannot ride as plain floats: float32 holds integers exactly only up to 2**24, so a
  step counter or ``num_batches_tracked`` would come back altered. Each element is written as the 8 base-256
  digits of ``value + 2**63`` (most significant first), each digit a float in 0..255. Digit sums over N ranks
  are at most 255 * N, exact in float32 for N < 65536, so the ``SUM`` all-reduce loses nothing and the mean is
  rebuilt with int64 long division. Integers get the *unweighted* mean (a sample count must not scale a
  counter), rounded to nearest with ties toward +infinity; bools therefore get the majority, ties -> True.
* The rank count is one slot the averager appends after the caller's control entries (each rank adds 1), so
  callers index their control vector exactly as before and never see it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_oscars.core._nn_state import persistent_buffers

__all__ = [
    "DIGITS",
    "FlatAverager",
    "add_flat",
    "agree_on_layout",
    "averaged_tensors",
    "chunks",
    "decode_integer_mean",
    "encode_integers",
    "flat_copy",
    "layout_agreement",
    "load_flat",
    "max_exact_ranks",
    "optimizer_state_layout",
]

DIGITS = 8
"""Base-256 digits per integer element on the wire (64 bits)."""

_DIGIT_BITS = 8
_DIGIT_MASK = 0xFF
_SIGN_DIGIT = 0x80  # the top digit of value + 2**63 is the top byte of value with its sign bit flipped


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers: exact integer encoding
# ---------------------------------------------------------------------------------------------------------------


def encode_integers(values: Tensor) -> Tensor:
    """The base-256 digits of ``value + 2**63`` for every element of an integer or bool tensor.

    Returns an int64 tensor of shape ``(values.numel(), DIGITS)``, most significant digit first, every digit in
    0..255. The bias makes every digit non-negative, so digit sums over ranks order like the values.
    """
    flat = values.detach().reshape(-1).to(torch.int64)
    shifts = torch.arange(_DIGIT_BITS * (DIGITS - 1), -1, -_DIGIT_BITS, dtype=torch.int64, device=flat.device)
    # Arithmetic right shift then masking yields the two's-complement bytes; no step can overflow int64.
    digits = torch.bitwise_right_shift(flat.unsqueeze(1), shifts) & _DIGIT_MASK
    digits[:, 0] ^= _SIGN_DIGIT
    return digits


def decode_integer_mean(digit_sums: Tensor, count: int) -> Tensor:
    """The rounded mean of ``count`` integers per row, given the per-digit sums of their encodings.

    ``digit_sums`` has shape ``(n, DIGITS)`` (any numeric dtype, holding exact integers, as produced by summing
    :func:`encode_integers` over ranks). Returns int64 of shape ``(n,)``: ``floor(S / count + 1/2)``, i.e. the
    nearest integer with ties toward +infinity, computed exactly for the whole int64 range. Equal inputs come
    back bit-identical.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count!r}")
    if digit_sums.dim() != 2 or digit_sums.shape[1] != DIGITS:
        raise ValueError(f"digit sums must have shape (n, {DIGITS}), got {tuple(digit_sums.shape)}")
    sums = digit_sums.round().to(torch.int64) if digit_sums.is_floating_point() else digit_sums.to(torch.int64)
    sums = sums.clone()
    # floor((S + floor(N / 2)) / N) is round-half-up for even N; odd N has no ties and gives the nearest.
    sums[:, -1] += count // 2
    # Normalise the sums (each up to 255 * N + N / 2) to base-256 digits, carrying from the least significant;
    # what carries out of the top is below N because the mean of biased values is below 2**64.
    digits = torch.empty_like(sums)
    carry = torch.zeros_like(sums[:, 0])
    for k in reversed(range(DIGITS)):
        total = sums[:, k] + carry
        digits[:, k] = total & _DIGIT_MASK
        carry = total >> _DIGIT_BITS
    # Long division by N from the most significant digit; the remainder stays below N, so every partial
    # dividend is below 256 * N and every quotient digit below 256.
    quotient = torch.empty_like(digits)
    remainder = carry
    for k in range(DIGITS):
        dividend = remainder * (_DIGIT_MASK + 1) + digits[:, k]
        quotient[:, k] = torch.div(dividend, count, rounding_mode="floor")
        remainder = dividend - quotient[:, k] * count
    # Undo the bias on the top digit (it becomes a signed byte in -128..127), then Horner: every partial value
    # lies in [-2**63, 2**63), so int64 never overflows.
    value = quotient[:, 0] - _SIGN_DIGIT
    for k in range(1, DIGITS):
        value = value * (_DIGIT_MASK + 1) + quotient[:, k]
    return value


def max_exact_ranks(dtype: torch.dtype) -> int:
    """The most ranks whose digit sums (up to 255 each) a buffer of ``dtype`` still adds exactly."""
    # Consecutive integers are exact up to 2 / eps (2**24 for float32).
    return round(2 / torch.finfo(dtype).eps) // _DIGIT_MASK


# ---------------------------------------------------------------------------------------------------------------
# What is averaged
# ---------------------------------------------------------------------------------------------------------------


def _state_tensors(optimizer: torch.optim.Optimizer, param: Tensor) -> list[Tensor]:
    """A parameter's averaged optimizer state: floating-point tensors with at least one dimension (scalars such
    as Adam's ``step`` are counters, identical on every rank)."""
    state = optimizer.state.get(param, {})
    # Sorted keys: every rank walks the state in the same order whatever order it was created in.
    return [
        value
        for value in (state[key] for key in sorted(state))
        if isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0
    ]


def _optimizer_params(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[tuple[torch.optim.Optimizer, Tensor]]:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                yield optimizer, param


def optimizer_state_layout(optimizers: Iterable[torch.optim.Optimizer]) -> list[int]:
    """For every parameter of every param group of every optimizer, in order: how many of its state tensors
    :func:`averaged_tensors` would average (0 when the parameter has no state yet, e.g. it never got a gradient
    on this rank)."""
    return [len(_state_tensors(optimizer, param)) for optimizer, param in _optimizer_params(optimizers)]


def layout_agreement(highest: Sequence[int], lowest: Sequence[int]) -> list[bool]:
    """Per parameter, whether all ranks hold the same non-zero number of state tensors, given the elementwise
    maximum and minimum of the ranks' :func:`optimizer_state_layout`."""
    if len(highest) != len(lowest):
        raise ValueError(f"highest has {len(highest)} entries but lowest has {len(lowest)}")
    return [high == low and high > 0 for high, low in zip(highest, lowest)]


def agree_on_layout(layout: Sequence[int], device: torch.device, group: dist.ProcessGroup | None = None) -> list[bool]:
    """Which parameters' optimizer state every rank can average: one small ``MAX`` all-reduce over
    ``[layout, -layout]`` gives the maximum and minimum count per parameter at once.

    Every rank must call it with a layout of the same length (the same optimizers and parameters). Parameters
    whose state is missing or shaped differently on some rank are left out and their state stays local.
    """
    if not layout:
        return []  # every rank has the same (empty) parameter list, so every rank skips the collective
    n = len(layout)
    packed = torch.tensor([*layout, *(-count for count in layout)], dtype=torch.int64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    values = packed.tolist()
    return layout_agreement(values[:n], [-value for value in values[n:]])


def averaged_tensors(
    module: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    *,
    state_mask: Sequence[bool] | None = None,
    extra_modules: Iterable[nn.Module] = (),
) -> list[Tensor]:
    """The tensors one averaging round covers, in an order every rank reproduces.

    * the module's trainable parameters: frozen ones (``requires_grad=False``) never change during local steps,
      so averaging them would only cost bandwidth (a LoRA fine-tune would all-reduce its whole backbone);
    * every persistent buffer of the module (BatchNorm statistics and counters); a non-persistent one (not in the
      state dict: a mask or index the module rebuilds, perhaps for each batch size) is the module's to recompute;
    * for each of ``extra_modules`` (averaged copies such as an EMA or SWA model), all its parameters, trainable
      or not (an EMA's parameters are frozen yet change every step), then all its buffers;
    * the optimizers' per-parameter state tensors (floating point, at least one dimension), parameter by
      parameter as in :func:`optimizer_state_layout`. With ``state_mask`` (aligned with that layout, e.g. from
      :func:`agree_on_layout`) only the parameters marked True contribute.

    A tensor reachable twice (a module shared with an extra module) is listed once, at its first place.
    """
    tensors: list[Tensor] = [p for p in module.parameters() if p.requires_grad]
    tensors += persistent_buffers(module)
    for extra in extra_modules:
        tensors += extra.parameters()
        tensors += persistent_buffers(extra)
    index = -1
    for index, (optimizer, param) in enumerate(_optimizer_params(optimizers)):
        if state_mask is None or (index < len(state_mask) and state_mask[index]):
            tensors += _state_tensors(optimizer, param)
    if state_mask is not None and index + 1 != len(state_mask):
        raise ValueError(f"state_mask has {len(state_mask)} entries but the optimizers hold {index + 1} parameters")
    seen: set[int] = set()
    unique: list[Tensor] = []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append(tensor)
    return unique


# ---------------------------------------------------------------------------------------------------------------
# The flat buffer and its one collective
# ---------------------------------------------------------------------------------------------------------------


def chunks(flat: Tensor, tensors: Sequence[Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
    """Pairs each tensor with its consecutive slice of ``flat``, viewed in the tensor's shape (so strided and
    0-dim tensors copy in and out without a temporary)."""
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        yield tensor, flat[offset : offset + n].view(tensor.shape)
        offset += n


def flat_copy(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors' values as one float32 CPU buffer: the wire format of a parameter server's and a group's
    exchanges (gloo, point to point)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def load_flat(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Copy ``flat`` (as :func:`flat_copy` packs it) back into the tensors, in place."""
    with torch.no_grad():
        for tensor, chunk in chunks(flat, tensors):
            tensor.copy_(chunk)


def add_flat(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Add ``flat`` (as :func:`flat_copy` packs it) to the tensors, in place: a correction computed on a snapshot
    applied to values that moved on since."""
    with torch.no_grad():
        for tensor, chunk in chunks(flat, tensors):
            tensor.add_(chunk.to(tensor.device, tensor.dtype))


class FlatAverager:
    """Averaging of a fixed list of tensors across ranks with a single ``SUM`` all-reduce (layout in the module
    docstring).

    Floating-point tensors become ``sum_i w_i x_i / sum_i w_i``, where ``sum_i w_i`` is read from the summed
    control vector at ``weight_index``; integer and bool tensors become the exact unweighted mean, rounded half
    up. One round is :meth:`pack`, the all-reduce of :attr:`buffer`, then :meth:`unpack_summed`;
    :meth:`all_reduce` does all three.
    """

    def __init__(self, tensors: Sequence[Tensor], control_size: int, device: torch.device) -> None:
        # No tensors is fine while control data still rides: a parameter server holds a buffer-less model's every
        # tensor, yet its round still sums the control data.
        if not tensors and control_size == 0:
            raise ValueError("nothing to average: no tensors and no control data")
        if control_size < 0:
            raise ValueError(f"control_size must be >= 0, got {control_size!r}")
        for tensor in tensors:
            if tensor.is_complex() or tensor.dtype == getattr(torch, "uint64", None):
                raise TypeError(f"cannot average a {tensor.dtype} tensor")
        self.tensors = list(tensors)
        self.control_size = control_size
        self._floats = [t for t in self.tensors if t.is_floating_point()]
        self._integers = [t for t in self.tensors if not t.is_floating_point()]
        self.numel = sum(t.numel() for t in self.tensors)
        self._float_end = sum(t.numel() for t in self._floats)
        self._control_start = self._float_end + DIGITS * sum(t.numel() for t in self._integers)
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in self.tensors) else torch.float32
        # + 1: the rank count slot after the caller's control entries.
        self.buffer = torch.empty(self._control_start + control_size + 1, dtype=dtype, device=device)

    @property
    def control(self) -> Tensor:
        """The caller's control entries inside :attr:`buffer` (the rank count slot excluded)."""
        return self.buffer[self._control_start : self._control_start + self.control_size]

    @property
    def _digits(self) -> Tensor:
        return self.buffer[self._float_end : self._control_start].view(-1, DIGITS)

    @property
    def float_tensors(self) -> list[Tensor]:
        """The floating-point tensors, in the order of :attr:`float_part`."""
        return self._floats

    @property
    def integer_tensors(self) -> list[Tensor]:
        """The integer and bool tensors, in the order of :meth:`integer_means`."""
        return self._integers

    @property
    def float_part(self) -> Tensor:
        """The floating-point elements' region of :attr:`buffer`: ``weight * value`` once packed, the sums over ranks
        after the all-reduce."""
        return self.buffer[: self._float_end]

    def summed_control(self) -> tuple[list[float], int]:
        """After the all-reduce: the caller's control entries summed over ranks, and the number of ranks."""
        tail = self.buffer[self._control_start :].tolist()  # one device-to-host copy for all scalars
        return tail[:-1], round(tail[-1])

    def integer_means(self, count: int) -> Tensor:
        """After the all-reduce over ``count`` ranks: every integer element's exact rounded mean (int64, flat)."""
        if not 1 <= count <= max_exact_ranks(self.buffer.dtype):
            raise ValueError(f"cannot average integers exactly over {count} ranks in a {self.buffer.dtype} buffer")
        return decode_integer_mean(self._digits, count)

    def holds(self, tensors: Sequence[Tensor]) -> bool:
        """Whether this averager was built for exactly these tensor objects (identity, not values: optimizers
        such as LBFGS replace their state tensors, and comparing tensors by value is ambiguous anyway)."""
        return len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors))

    def pack(self, weight: float, control: Sequence[float]) -> None:
        """Fill :attr:`buffer` with this rank's contribution: the floats times ``weight``, the integer digits,
        ``control`` and a 1 in the rank count slot. Summing the buffers of all ranks is the all-reduce."""
        if len(control) != self.control_size:
            raise ValueError(f"control has {len(control)} entries, expected {self.control_size}")
        with torch.no_grad():
            floats = self.buffer[: self._float_end]
            for tensor, chunk in chunks(floats, self._floats):
                chunk.copy_(tensor.detach())
            if weight != 1.0:  # uniform averaging skips a pass over the model
                floats.mul_(weight)
            if self._integers:
                values = torch.cat(
                    [t.detach().reshape(-1).to(device=self.buffer.device, dtype=torch.int64) for t in self._integers]
                )
                self._digits.copy_(encode_integers(values))
            tail = torch.tensor([*control, 1.0], dtype=self.buffer.dtype)
            self.buffer[self._control_start :].copy_(tail)

    def unpack_summed(self, weight_index: int) -> list[float]:
        """Write the mean back into the tensors, :attr:`buffer` holding the sum of every rank's :meth:`pack`.

        Returns the caller's control entries, summed over ranks (same length as passed to :meth:`pack`); the
        total float weight is entry ``weight_index``.
        """
        summed, count = self.summed_control()
        with torch.no_grad():
            if self._floats:
                for tensor, chunk in chunks(self.float_mean(summed[weight_index]), self._floats):
                    tensor.copy_(chunk)
            if self._integers:
                for tensor, chunk in chunks(self.integer_means(count), self._integers):
                    tensor.copy_(chunk)
        return summed

    def float_mean(self, total_weight: float) -> Tensor:
        """After the all-reduce: :attr:`float_part` divided in place by the ranks' ``total_weight`` (the weighted
        mean, flat)."""
        if not total_weight > 0.0:
            raise ValueError(f"total weight must be > 0, got {total_weight!r}")
        return self.float_part.div_(total_weight)

    def all_reduce(
        self, weight: float, control: Sequence[float], weight_index: int, group: dist.ProcessGroup | None = None
    ) -> list[float]:
        """Average in place; return the caller's control vector summed over ranks (the one collective of a
        round)."""
        self.pack(weight, control)
        dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, group=group)
        return self.unpack_summed(weight_index)
