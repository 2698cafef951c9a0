"""Model averaging overlapped with the next round's compute: the average reaches the models one round late.

At a round's end a rank all-reduces its control data at once (the next round's schedule, a stop and the signals
depend on it), copies its tensors into a send buffer and *posts* the model all-reduce without waiting for it. It
trains the next round from its own model while the collective runs (on gloo's threads, or NCCL's stream). At the
next round's end it waits for the mean and applies it as a correction::

    x <- x + (mean - sent)

the mean of the models as they were posted, plus this rank's own progress since (overlap local SGD; streaming
DiLoCo applies its delayed fragments the same way). A round's averaging then costs the small control all-reduce and
a few passes over the model in memory instead of the model's transfer, and the models never quite agree during
training: each is the last round's mean plus one round of its own steps.

Where Lightning needs the models equal (validation, a checkpoint, an epoch's end, the end of fit) the session calls
:meth:`OverlappedAveraging.combine`: the pending mean is applied, then the models are averaged at once, as
without overlap. It costs one extra flat copy of the averaged floating-point tensors besides the flat buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_oscars.dist.averaging import FlatAverager, chunks
from lightning_oscars.dist.schemes import ModelAveraging, RoundMeeting

__all__ = ["LateAverage", "OverlappedAveraging"]


class LateAverage:
    """One averaging of a fixed list of tensors, posted now and applied later as ``x += mean - sent``.

    :meth:`pack` (fill the flat buffer, keep a flat copy of what is sent) and :meth:`correct` (the buffer holding
    every rank's sum: subtract what was sent from every tensor and add the mean) are local arithmetic; :meth:`post`
    and :meth:`apply` add the collective around them. The buffer and the copy are reused from round to round: a
    posting costs two passes over the model (three with a weight other than 1), applying it three.
    """

    def __init__(self, tensors: Sequence[Tensor], device: torch.device) -> None:
        self.averager = FlatAverager(tensors, 1, device)  # control: this rank's weight, summed on the wire
        self._sent = torch.empty_like(self.averager.float_part)  # this rank's floats as sent (unweighted)
        self._sent_integers: list[Tensor] = []
        self._work: Any = None

    def holds(self, tensors: Sequence[Tensor]) -> bool:
        """Whether this was built for exactly these tensor objects."""
        return self.averager.holds(tensors)

    @property
    def in_flight(self) -> bool:
        return self._work is not None

    def pack(self, weight: float) -> None:
        """Fill the buffer with this rank's tensors as they are now, and keep a copy of what it sends."""
        averager = self.averager
        averager.pack(1.0, [weight])
        with torch.no_grad():
            self._sent.copy_(averager.float_part)
            if weight != 1.0:
                averager.float_part.mul_(weight)
            self._sent_integers = [t.detach().clone() for t in averager.integer_tensors]

    def correct(self) -> None:
        """The buffer holds the sum over ranks: every tensor becomes ``tensor - sent + mean`` (this rank's progress
        since it sent, on the mean; with no progress exactly the mean). Bools take the mean (the majority)."""
        averager = self.averager
        summed, count = averager.summed_control()
        with torch.no_grad():
            if averager.float_tensors:
                mean = averager.float_mean(summed[0])
                for (tensor, sent), (_, chunk) in zip(
                    chunks(self._sent, averager.float_tensors), chunks(mean, averager.float_tensors)
                ):
                    tensor.sub_(sent).add_(chunk)
            if averager.integer_tensors:
                means = averager.integer_means(count)
                for (tensor, chunk), sent in zip(chunks(means, averager.integer_tensors), self._sent_integers):
                    if tensor.dtype == torch.bool:
                        tensor.copy_(chunk)
                    else:
                        tensor.sub_(sent).add_(chunk.to(tensor.dtype))

    def post(self, weight: float, group: Any = None) -> None:
        """Pack and start the all-reduce; return at once (collective: every rank posts with the same layout)."""
        self.pack(weight)
        self._work = dist.all_reduce(self.averager.buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def apply(self) -> None:
        """Wait for the posted all-reduce and apply its mean as the correction."""
        work, self._work = self._work, None
        if work is None:
            return
        work.wait()
        self.correct()

    def drop(self) -> None:
        """Forget a posted all-reduce without waiting (a failed fit: a peer may never complete it)."""
        self._work = None


class OverlappedAveraging(ModelAveraging):
    """Model averaging whose round-end all-reduce overlaps the next round (see the module docstring).

    :meth:`combine_late` (a round's end) has the control data summed at once and posts the models; the mean is
    applied at the next call. :meth:`combine` (validation, checkpoints, an epoch's end) leaves the models equal.
    """

    name = "overlapped_averaging"

    def __init__(self, device: torch.device | str | None = None, group: Any = None) -> None:
        super().__init__(device, group)
        self._late: LateAverage | None = None
        self.applied_late = 0  # averagings of this fit that reached the models one round late

    def bind(self, parameters: Iterable[Tensor]) -> None:
        self.applied_late = 0

    @property
    def settled(self) -> bool:
        return self._late is None or not self._late.in_flight

    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        self._apply_late()
        self.average(tensors, meeting)

    def combine_late(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        self._apply_late()
        meeting.sum_now()  # before the models are posted: the next round's schedule must not wait behind them
        late = self._late
        # Rebuilt when the set of tensors changes (a parameter gets its first optimizer state, LBFGS replaces its
        # state tensors): every rank sees the same change at the same round.
        if late is None or not late.holds(tensors):
            late = self._late = LateAverage(tensors, self.device or meeting.device)
        late.post(meeting.weight, self.group)

    def _apply_late(self) -> None:
        if self._late is not None and self._late.in_flight:
            self._late.apply()
            self.applied_late += 1

    def release(self) -> None:
        super().release()
        if self._late is not None:
            self._late.drop()  # only a failed fit leaves one in flight: its peers may be gone
        self._late = None
