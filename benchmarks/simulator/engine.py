"""The discrete-event engine: rounds of local steps, barriers and all-reduces on the strategy's epoch plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.simulator.cluster import Cluster, Load, Timeline, fit_to_remaining, lognormal, row_medians
from benchmarks.simulator.policies import FixedPolicy, OscarsPolicy
from lightning_oscars.partition import EpochPlan, validations_after_resize
from lightning_oscars.policy import SchedulePolicy

__all__ = ["SimResult", "simulate", "simulate_bsp", "simulate_local_sgd", "simulate_oscars"]

Seed = int | np.random.SeedSequence | Sequence[int]


@dataclass
class SimResult:
    """What one simulated run did. Times in seconds; arrays are per rank. ``rounds`` counts averagings.

    ``validation_s``: simulated train time at every validation; ``history``: per-averaging records (if asked);
    ``epoch_slots``: every epoch's slots as sized at its start (an upper bound while the speeds are unknown).
    """

    paradigm: str
    wall_s: float
    units: int
    rounds: int
    compute_s: np.ndarray
    idle_s: np.ndarray
    comm_s: float
    other_s: float
    round_utilization: float
    schedule_changes: list[tuple[int, tuple[int, ...]]]
    epoch_end_s: list[float]
    validation_s: list[float] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    epoch_slots: list[int] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Optimizer steps per second summed over ranks (samples/s divided by the batch size)."""
        return self.units / self.wall_s

    @property
    def utilization(self) -> float:
        """Compute time over the cluster's time: ``sum_i compute_i / (N x wall)``."""
        return float(self.compute_s.sum() / (len(self.compute_s) * self.wall_s))

    @property
    def idle_fraction(self) -> np.ndarray:
        """Per rank: share of the wall time spent waiting at barriers or in no-op slots."""
        return self.idle_s / self.wall_s

    @property
    def final_local_steps(self) -> tuple[int, ...] | None:
        return self.schedule_changes[-1][1] if self.schedule_changes else None

    def summary(self, ideal: float | None = None, classes: Sequence[str] | None = None) -> dict[str, Any]:
        """JSON-ready figures; per-rank arrays are reduced to mean/min/max (and per-class means if given)."""
        idle = self.idle_fraction
        out: dict[str, Any] = {
            "paradigm": self.paradigm,
            "wall_s": self.wall_s,
            "steps": self.units,
            "rounds": self.rounds,
            "throughput": self.throughput,
            "utilization": self.utilization,
            "round_utilization": self.round_utilization,
            "comm_fraction": self.comm_s / self.wall_s,
            "idle_mean": float(idle.mean()),
            "idle_min": float(idle.min()),
            "idle_max": float(idle.max()),
            "final_local_steps": _compress_steps(self.final_local_steps, classes),
            "schedule_changes": len(self.schedule_changes),
        }
        if ideal:
            out["fraction_of_ideal"] = self.throughput / ideal
        if classes is not None:
            labels = np.asarray(classes)
            out["idle_by_class"] = {str(c): float(idle[labels == c].mean()) for c in dict.fromkeys(classes)}
        return out


def _compress_steps(steps: tuple[int, ...] | None, classes: Sequence[str] | None) -> Any:
    """Local steps per speed class (``{"1x": [16], ...}``) for large clusters, the plain tuple for small ones."""
    if steps is None:
        return None
    if classes is None or len(steps) <= 8:
        return list(steps)
    out: dict[str, list[int]] = {}
    for c, tau in zip(classes, steps):
        out.setdefault(str(c), [])
        if tau not in out[str(c)]:
            out[str(c)].append(tau)
    return {c: sorted(v) for c, v in out.items()}


def _val_check_batch(total_slots: int, interval: float | None) -> int | None:
    """Lightning's ``val_check_batch`` for a float ``val_check_interval`` (the strategy re-sizes it with the epoch)."""
    return max(1, int(total_slots * interval)) if interval else None


class _Engine:
    """Clock and accumulators of one simulated run; :meth:`round` runs a round and its averaging(s).

    The engine models the wire format's lag: the control data of averaging ``k`` carries the fixed cost of round
    ``k-1`` (its all-reduce plus the per-round overhead), measured from averaging to averaging, so it is known
    from round 2 on: the policy sees the policy's ``initial_allreduce_s`` (0 unless an oracle) at the first two
    averagings and the previous round's cost after that.
    """

    def __init__(
        self,
        cluster: Cluster,
        policy: SchedulePolicy,
        allreduce_s: float,
        round_overhead_s: float,
        first_step_s: float,
        seed: Seed,
        record_batch_size: int | None = None,
    ) -> None:
        n = cluster.n
        self.n, self.policy = n, policy
        self.rng = np.random.default_rng(seed)
        self.means = np.asarray(cluster.step_times, dtype=float)
        self.noise = cluster.noise
        self.noop = cluster.noop_array()
        self.timeline = Timeline(n, cluster.slowdowns)
        self.load = Load(cluster.load_array(), cluster.load_time_s, self.rng)
        self.allreduce_s, self.round_overhead_s, self.first_step_s = allreduce_s, round_overhead_s, first_step_s
        self.wire_cost = policy.initial_allreduce_s  # the cost the first two averagings report
        self.now = self.comm = self.other = self.util_sum = 0.0
        self.compute, self.idle = np.zeros(n), np.zeros(n)
        self.averagings = self.slots = self.epoch = 0
        self.changes: list[tuple[int, tuple[int, ...]]] = []
        self.epoch_ends: list[float] = []
        self.epoch_slots: list[int] = []
        self.validations: list[float] = []
        self.record_batch_size = record_batch_size
        self.history: list[dict[str, Any]] = []
        self._started = False
        self._planned: np.ndarray | None = None

    def local_steps(self) -> np.ndarray:
        return np.asarray(self.policy.local_steps, dtype=np.int64)

    def note_schedule(self) -> None:
        planned = self.local_steps()
        if self._planned is None or not np.array_equal(planned, self._planned):
            self._planned = planned.copy()
            self.changes.append((self.averagings, tuple(int(x) for x in planned)))

    def _draw(self, width: int) -> np.ndarray:
        """Every rank's step times of the next ``width`` slots (the start-up transient on the very first)."""
        factors = self.timeline.at(self.now) * self.load.factors(self.now)
        draws = self.means[:, None] * factors[:, None] * lognormal(self.rng, (self.n, width), self.noise)
        if not self._started:
            draws[:, 0] += self.first_step_s
            self._started = True
        return draws

    def round(
        self,
        quotas: np.ndarray,
        width: int,
        cuts: Sequence[int] = (),
        validate_at_end: bool = False,
        draws: np.ndarray | None = None,
    ) -> bool:
        """``width`` slots, rank ``i`` real in its first ``quotas[i]``; average at every cut and at the end.

        A cut is a validation inside the round (the strategy averages before validating); ``validate_at_end``
        marks a validation right after the round. Returns whether the policy changed the schedule at any of
        these averagings. Each averaging folds the medians of the steps since the previous one into the policy,
        as the strategy does at every averaging.
        """
        draws = self._draw(width) if draws is None else draws
        taken = np.arange(width)[None, :] < quotas[:, None]
        changed = False
        for a, b in zip((0, *cuts), (*cuts, width)):
            real = np.clip(quotas - a, 0, b - a)
            busy = np.where(taken[:, a:b], draws[:, a:b], 0.0).sum(axis=1)
            self._account(busy, float(np.max(busy + self.noop * ((b - a) - real))))
            if self.record_batch_size is not None:
                self._record(real, busy, self.slots + b)
            changed = self._average(draws[:, a:b], real) or changed
            if b < width or validate_at_end:
                self.validations.append(self.now)
        self.slots += width
        return changed

    def _account(self, busy: np.ndarray, period: float) -> None:
        """The clock and accumulators of one averaging period: compute, waits, all-reduce, bookkeeping."""
        self.compute += busy
        self.idle += period - busy
        self.comm += self.allreduce_s
        self.other += self.round_overhead_s
        if period + self.allreduce_s > 0:
            self.util_sum += busy.sum() / (self.n * (busy.max() + self.allreduce_s))
        self.now += period + self.allreduce_s + self.round_overhead_s
        self.averagings += 1

    def _average(self, draws: np.ndarray, real: np.ndarray) -> bool:
        """Hand the policy this averaging's per-rank medians (NaN: no step) and the cost the wire carries."""
        seen = self.wire_cost if self.averagings <= 2 else self.allreduce_s + self.round_overhead_s
        if self.policy.solved and not self.policy.resolve:
            return False  # a fixed schedule (BSP, local SGD, pinned): nothing this averaging could change
        return self.policy.observe(row_medians(draws, real).tolist(), seen)

    def _record(self, real: np.ndarray, busy: np.ndarray, global_step: int) -> None:
        """A history record as ``OscarsStrategy`` writes it (the all-reduce time is the previous averaging's)."""
        self.history.append(
            {
                "round": self.averagings,
                "time": self.now,
                "epoch": self.epoch,
                "global_step": global_step,
                "local_steps": [int(x) for x in self.policy.local_steps],
                "samples": [int(x) * int(self.record_batch_size or 1) for x in real],
                "compute_times": [float(x) for x in busy],
                "allreduce_time": self.allreduce_s if self.averagings > 1 else 0.0,
            }
        )

    def idle_slots(self, slots: int, validations: int = 0) -> None:
        """Slots without data on any rank (the tail of an epoch sized too long): no-ops everywhere, no averaging."""
        seconds = slots * float(self.noop.max())
        self.now += seconds
        self.idle += seconds
        self.slots += slots
        self.validations += [self.now] * validations

    def end_epoch(self, overhead_s: float) -> None:
        self.now += overhead_s
        self.other += overhead_s
        self.epoch_ends.append(self.now)
        self.epoch += 1

    def result(self, units: int) -> SimResult:
        return SimResult(
            paradigm=getattr(self.policy, "name", "oscars"),
            wall_s=self.now,
            units=units,
            rounds=self.averagings,
            compute_s=self.compute,
            idle_s=self.idle,
            comm_s=self.comm,
            other_s=self.other,
            round_utilization=self.util_sum / max(self.averagings, 1),
            schedule_changes=self.changes,
            epoch_end_s=self.epoch_ends,
            validation_s=self.validations,
            history=self.history,
            epoch_slots=self.epoch_slots,
        )


def simulate(
    cluster: Cluster,
    policy: SchedulePolicy,
    total_units: int,
    *,
    allreduce_s: float,
    units_per_epoch: int | None = None,
    epoch_overhead_s: float = 0.0,
    round_overhead_s: float = 0.0,
    first_step_s: float = 0.0,
    val_check_interval: float | None = None,
    planned: bool = True,
    record_batch_size: int | None = None,
    seed: Seed = 0,
) -> SimResult:
    """Run epochs until ``total_units`` optimizer steps (summed over ranks) are done.

    Each round draws every rank's step times at once (a ranks x slots matrix), so the cost is one NumPy pass
    per round whatever the number of ranks. ``allreduce_s`` is the exposed communication per averaging,
    ``round_overhead_s`` the bookkeeping around it, ``epoch_overhead_s`` the epoch turnover (validation itself
    takes no simulated time: the benchmark excludes it; its times are in ``SimResult.validation_s``).
    ``policy`` starts afresh (``begin``) for the ``cluster.n`` ranks.

    ``planned`` (local SGD, oscars): rounds follow the strategy's ``EpochPlan``; an epoch that starts before the
    policy has a schedule is sized as the policy's upper bound (``epoch_slot_bound``, as the strategy sizes its
    loader) and cut (``replan(shrink=True)``) when the first schedule is adopted; later changes re-plan (and
    re-size the epoch, within that bound) at the next round boundary; a validation (every ``val_check_interval`` of
    the epoch's slots) inside a round forces an averaging. Otherwise (BSP) rounds of ``local_steps`` run until the
    epoch's units are used, the last one cut in proportion (a ``DistributedSampler``'s even split).
    ``record_batch_size``: keep a per-averaging history as the strategy writes it, with samples counted at this
    batch size.
    """
    policy.begin(cluster.n)
    engine = _Engine(cluster, policy, allreduce_s, round_overhead_s, first_step_s, seed, record_batch_size)
    epoch_units = units_per_epoch or total_units
    done = 0
    while done < total_units:
        units = min(epoch_units, total_units - done)
        (_planned_epoch if planned else _even_epoch)(engine, units, val_check_interval)
        done += units
        engine.end_epoch(epoch_overhead_s)
    return engine.result(done)


def _even_epoch(engine: _Engine, units: int, val_check_interval: float | None) -> None:
    """One epoch of a ``DistributedSampler``'s even split: rounds of ``local_steps``, the last one cut."""
    per_rank = -(-units // engine.n)  # a DistributedSampler's batches per rank: the slots of the epoch
    engine.epoch_slots.append(per_rank)
    check = _val_check_batch(per_rank, val_check_interval)
    left, slot = units, 0
    while left > 0:
        engine.note_schedule()
        steps = fit_to_remaining(engine.local_steps(), left)
        width = int(steps.max())
        engine.round(steps, width, validate_at_end=bool(check) and (slot + width) // check > slot // check)
        left -= int(steps.sum())
        slot += width


def _planned_epoch(engine: _Engine, units: int, val_check_interval: float | None) -> None:
    """One epoch on ``EpochPlan`` as ``OscarsStrategy`` drives it: sized by the policy, cut once first solved."""
    n, policy = engine.n, engine.policy
    bound = policy.epoch_slot_bound(units)
    total_slots, upper_bound = policy.epoch_slots(units, bound)
    engine.epoch_slots.append(total_slots)
    warmup = None
    if isinstance(policy, OscarsPolicy) and policy.timed_warmup and not policy.solved and engine.slots == 0:
        warmup = (policy.warmup_reservation(),) * n
    check = _val_check_batch(total_slots, val_check_interval)
    points: frozenset[int] | None = None  # after a mid-epoch re-size: the slots that validate (as the adapter does)

    def validates(count: int) -> bool:
        return count in points if points is not None else bool(check) and count % check == 0

    def boundaries(slots: int) -> tuple[int, ...]:  # the adapter's validation_slots: rounds end there
        if points is not None:
            return tuple(sorted(p for p in points if 0 < p < slots))
        every = _val_check_batch(slots, val_check_interval)
        return tuple(range(every, slots, every)) if every else ()

    plan = EpochPlan(n, units, total_slots, policy.local_steps, warmup_reserve=warmup, boundaries=boundaries)

    slot, pending = 0, False
    while slot < plan.total_slots:
        rnd = plan.round_at(slot)
        if rnd.is_empty:
            engine.idle_slots(rnd.end_slot - slot, sum(validates(c) for c in range(slot + 1, rnd.end_slot + 1)))
            slot = rnd.end_slot
            continue
        engine.note_schedule()
        cuts = [c - slot for c in range(slot + 1, rnd.end_slot) if validates(c)]
        at_end = validates(rnd.end_slot)
        draws = None
        if rnd.warmup:  # the time-boxed warm-up: settled to the steps each rank started before the slowest was done
            draws = engine._draw(rnd.length)
            plan.settle(slot, timed_warmup_steps(draws, policy.local_steps[0], rnd.quotas))
            rnd, pending = plan.round_at(slot), True
        pending = engine.round(np.asarray(rnd.quotas, dtype=np.int64), rnd.length, cuts, at_end, draws) or pending
        slot = rnd.end_slot
        if pending and slot < plan.total_slots:
            before = plan.total_slots
            plan.replan(slot, policy.local_steps, shrink=upper_bound, max_slots=bound)
            pending = False
            if plan.total_slots != before and check:  # re-sized as the strategy re-sizes Lightning's epoch
                if upper_bound:
                    check, points = _val_check_batch(plan.total_slots, val_check_interval), None
                else:
                    due = sum(validates(c) for c in range(slot + 1, before + 1))
                    points = frozenset(validations_after_resize(slot, plan.total_slots, due))
            upper_bound = False


def timed_warmup_steps(draws: np.ndarray, warmup_steps: int, reserve: Sequence[int]) -> tuple[int, ...]:
    """Steps every rank takes in the time-boxed warm-up round (``lightning_oscars.warmup``): its ``warmup_steps``,
    then every step it starts before the slowest rank has finished its own (a rank decides as it fetches, at the
    step's start), within its reservation. ``draws``: ranks x slots step times."""
    ends = np.cumsum(draws, axis=1)
    done = float(ends[:, warmup_steps - 1].max())
    started = (ends - draws < done).sum(axis=1)
    return tuple(int(q) for q in np.clip(started, warmup_steps, np.asarray(reserve)))


def simulate_bsp(
    cluster: Cluster, total_units: int, *, allreduce_s: float, overlap: float = 0.0, **kw: Any
) -> SimResult:
    """BSP / DDP: one step per rank, wait for the slowest, then the part of the all-reduce not hidden."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must lie in [0, 1], got {overlap}")
    kw.setdefault("planned", False)
    return simulate(cluster, FixedPolicy(1, name="bsp"), total_units, allreduce_s=(1.0 - overlap) * allreduce_s, **kw)


def simulate_local_sgd(
    cluster: Cluster, total_units: int, *, allreduce_s: float, period: int = 8, **kw: Any
) -> SimResult:
    """Fixed-period local SGD: ``period`` local steps on every rank, barrier, one model all-reduce."""
    return simulate(cluster, FixedPolicy(period), total_units, allreduce_s=allreduce_s, **kw)


def simulate_oscars(
    cluster: Cluster, total_units: int, *, allreduce_s: float, policy: OscarsPolicy | None = None, **kw: Any
) -> SimResult:
    """Oscars: warm-up round, solved ``tau_i`` per rank, re-solves on drift (see :class:`OscarsPolicy`)."""
    return simulate(cluster, policy or OscarsPolicy(), total_units, allreduce_s=allreduce_s, **kw)
