"""What the ranks tell each other at a round's end, and what every rank keeps of the round.

The control data rides in the tail of the averaging buffer (:class:`~lightning_oscars.dist.averaging.FlatAverager`),
so a round costs one all-reduce whatever it carries. Every rank writes its own row (:class:`RankReport`) and
zeros elsewhere; flags are summed, so "any rank asked" is a sum above zero. :meth:`Contribution.encode` and
:meth:`ControlData.decode` are the only code that knows the layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ControlData", "Contribution", "RankReport", "RoundRecord", "fraction_of_ideal"]


def fraction_of_ideal(busy: Sequence[float], step_times: Sequence[float], wall: float) -> float:
    """The project's one efficiency figure: samples trained per second over what a perfectly balanced cluster of the
    same ranks would train, ``sum_i steps_i / (wall * sum_i 1 / t_i)``.

    ``busy[i]`` is rank ``i``'s seconds of real steps (``steps_i * t_i``) within ``wall`` seconds, ``step_times[i]``
    its seconds per step when it waits for nobody. Equivalently, the speed-weighted mean of the ranks' busy shares
    ``busy_i / wall`` (weights ``1 / t_i``): an idle second of a fast rank costs more than one of a slow rank. The
    round records, the end-of-fit summary, the demo and the benchmarks all report this number."""
    rates = [1.0 / t for t in step_times if t > 0.0]
    if wall <= 0.0 or len(rates) != len(busy) or not rates:
        return 0.0
    return sum(b / t for b, t in zip(busy, step_times)) / (wall * sum(rates))


@dataclass(frozen=True)
class RankReport:
    """One rank's row: what it measured in the round just ended.

    Attributes:
        step_time: median seconds per local step in this round (0: it took no step).
        samples: samples it trained on.
        compute: seconds its local steps took (data loading included).
        allreduce: seconds its previous all-reduce took (the last rank to arrive waits least).
        global_step: Lightning's ``global_step`` (must agree: a rank that stepped differently is an error).
        overhead: seconds of its previous round not spent in its own local steps (waits, no-op slots, Lightning's
            work between steps, the averaging); the busiest rank reports the least: the round's fixed cost.
        units: units (optimizer steps' data) it trained in the current round so far: a deadline round hands back
            what its reservation held beyond this.
        jitter: the log-spread of its steps in the round around its long-run step time (0: not measured);
            deadline rounds choose their length from it.
        error: the standard error of ``step_time`` as a fraction of it: the log-spread of the round's steps around
            their median over the square root of their count (0: fewer than two steps). The solver does not tell
            ranks apart whose times lie within this noise of each other.
    """

    step_time: float = 0.0
    samples: int = 0
    compute: float = 0.0
    allreduce: float = 0.0
    global_step: int = 0
    overhead: float = 0.0
    units: int = 0
    jitter: float = 0.0
    error: float = 0.0


_ROW = len(dataclasses.fields(RankReport))
_FLAGS = ("stop", "sigterm", "requeue")


@dataclass(frozen=True)
class Contribution:
    """This rank's part of the control data: its row, its averaging weight and its requests."""

    rank: int
    report: RankReport
    weight: float = 1.0
    stop: bool = False
    sigterm: bool = False
    requeue: bool = False

    def encode(self, world_size: int) -> list[float]:
        if not 0 <= self.rank < world_size:
            raise ValueError(f"rank {self.rank} outside a world of {world_size}")
        vector = [0.0] * ControlData.size(world_size)
        start = self.rank * _ROW
        vector[start : start + _ROW] = [float(v) for v in dataclasses.astuple(self.report)]
        vector[ControlData.weight_index(world_size)] = float(self.weight)
        for offset, name in enumerate(_FLAGS, start=1):
            vector[ControlData.weight_index(world_size) + offset] = float(getattr(self, name))
        return vector


@dataclass(frozen=True)
class ControlData:
    """The control data summed over ranks: every rank's row, the total weight and whether any rank asked for a
    stop, a SIGTERM shutdown or a requeue."""

    ranks: tuple[RankReport, ...]
    weight: float
    stop: bool
    sigterm: bool
    requeue: bool

    @staticmethod
    def size(world_size: int) -> int:
        return world_size * _ROW + 1 + len(_FLAGS)

    @staticmethod
    def weight_index(world_size: int) -> int:
        return world_size * _ROW

    @classmethod
    def decode(cls, summed: Sequence[float], world_size: int) -> ControlData:
        if len(summed) != cls.size(world_size):
            raise ValueError(f"control data of {len(summed)} entries for {world_size} ranks")
        rows = []
        for rank in range(world_size):
            step_time, samples, compute, allreduce, global_step, overhead, units, jitter, error = summed[
                rank * _ROW : (rank + 1) * _ROW
            ]
            rows.append(
                RankReport(
                    step_time,
                    round(samples),
                    compute,
                    allreduce,
                    round(global_step),
                    overhead,
                    round(units),
                    jitter,
                    error,
                )
            )
        g = cls.weight_index(world_size)
        stop, sigterm, requeue = (summed[g + i] > 0.0 for i in range(1, 1 + len(_FLAGS)))
        return cls(tuple(rows), summed[g], stop, sigterm, requeue)


@dataclass(frozen=True)
class RoundRecord(Mapping[str, Any]):
    """One averaging, as every rank agreed on it. ``period``, ``idle_times``, ``utilization`` and
    ``fraction_of_ideal`` are derived.

    Attributes:
        round: 1-based count of averagings in this fit.
        time: seconds since training started.
        epoch / global_step: where it happened.
        local_steps: the local steps in force during the round.
        step_times: every rank's smoothed seconds per step after the round.
        samples / compute_times: per rank, what the round trained and how long its local steps took.
        allreduce_time: the all-reduce cost known after the round.
        rebalanced: whether a new schedule was adopted at this averaging.
        round_cost: the fixed cost per round the solver prices (the all-reduce plus everything outside the busiest
            rank's local steps), a running median of the measured ones; 0 while none is measured.
        batch_sizes: every rank's own batch size (``batch_sizes=``); empty: the DataLoader's on every rank.
    """

    round: int
    time: float
    epoch: int
    global_step: int
    local_steps: tuple[int, ...]
    step_times: tuple[float, ...]
    samples: tuple[int, ...]
    compute_times: tuple[float, ...]
    allreduce_time: float
    rebalanced: bool
    round_cost: float = 0.0
    batch_sizes: tuple[int, ...] = ()

    @property
    def period(self) -> float:
        """``T*`` as measured: the busiest rank's compute time."""
        return max(self.compute_times, default=0.0)

    @property
    def idle_times(self) -> tuple[float, ...]:
        """Seconds each rank waited for the busiest one."""
        return tuple(self.period - c for c in self.compute_times)

    @property
    def wall(self) -> float:
        """The round's wall time: the busiest rank's compute plus the round's fixed cost (at least the all-reduce)."""
        return self.period + max(self.allreduce_time, self.round_cost)

    @property
    def rank_utilization(self) -> tuple[float, ...]:
        """Each rank's share of the round spent computing."""
        return tuple(c / self.wall if self.wall > 0 else 0.0 for c in self.compute_times)

    @property
    def utilization(self) -> float:
        """The cluster's share of the round spent computing (waits and the all-reduce count as lost)."""
        per_rank = self.rank_utilization
        return sum(per_rank) / len(per_rank) if per_rank else 0.0

    @property
    def fraction_of_ideal(self) -> float:
        """Steps trained in the round over what the ranks would train at their measured speeds without waiting
        or averaging (see :func:`fraction_of_ideal`)."""
        return fraction_of_ideal(self.compute_times, self.step_times, self.wall)

    # Records were dicts before 0.2: ``record["local_steps"]`` (a list, as then), ``.get``, ``dict(record)`` and
    # iteration over the keys keep working.
    def __getitem__(self, key: str) -> Any:
        if key not in _RECORD_KEYS:
            raise KeyError(key)
        value = getattr(self, key)
        return list(value) if isinstance(value, tuple) else value

    def __iter__(self) -> Iterator[str]:
        return iter(_RECORD_KEYS)

    def __len__(self) -> int:
        return len(_RECORD_KEYS)

    def as_dict(self) -> dict[str, Any]:
        """Every field and derived value, as plain lists (JSON-ready)."""
        return dict(self)


_RECORD_KEYS = tuple(f.name for f in dataclasses.fields(RoundRecord)) + (
    "period",
    "idle_times",
    "utilization",
    "rank_utilization",
    "fraction_of_ideal",
)
