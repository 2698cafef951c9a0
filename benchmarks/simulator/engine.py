"""The discrete-event engine: the package's own round logic on a simulated clock.

Local SGD and oscars run on the strategy's :class:`~lightning_oscars.core.rounds.RoundController` (rank 0's; every rank
computes the same outcome from the same control data): it sizes and plans every epoch, lays out the warm-up, takes
each averaging's control data, keeps the ledger of round costs (the median of measured ones) and the records,
re-solves, re-plans and re-sizes the epoch, settles the warm-up round. The engine only simulates what the ranks do
and measure: every rank's step times (a draw per slot), which slots are real (:meth:`Round.real_offsets`; the warm-up
gate's decisions), the clock, and each rank's report as ``RoundController.contribution`` writes it
(``rank_measures.rank_reports``: a test checks the two agree). ddp (BSP) is one step per rank and a barrier, no rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.simulator.cluster import Cluster, Load, Timeline, fit_to_remaining, lognormal
from benchmarks.simulator.policies import FixedPolicy, OscarsPolicy

# What a rank measures and the run's result live in modules of their own; re-exported here, where callers and
# tests import them from.
from benchmarks.simulator.rank_measures import measured_steps, rank_reports, timed_warmup_steps  # noqa: F401
from benchmarks.simulator.result import SimResult, _compress_steps  # noqa: F401
from lightning_oscars.core.control import ControlData
from lightning_oscars.core.partition import Round, validations_after_resize
from lightning_oscars.core.policy import SchedulePolicy
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.warmup import WarmupGate

__all__ = ["SimResult", "simulate", "simulate_bsp", "simulate_local_sgd", "simulate_oscars"]

Seed = int | np.random.SeedSequence | Sequence[int]


def _val_check_batch(total_slots: int, interval: float | None) -> int | None:
    """Lightning's ``val_check_batch`` for a float ``val_check_interval`` (the strategy re-sizes it with the epoch)."""
    return max(1, int(total_slots * interval)) if interval else None


class _Engine:
    """Clock and accumulators of one simulated run, and what every simulated rank measures of its rounds.

    The measurements reach the round controller as a live rank's do, one averaging late for the costs: the control
    data of averaging ``k`` carries each rank's all-reduce of averaging ``k-1`` and the part of round ``k-1`` not
    spent in its own steps (measured from averaging ``k-2`` to ``k-1``), so the round's fixed cost is known from
    averaging 3 on.
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
        # What each rank measured at its last averaging, reported at the next one (see the class docstring).
        self._last_allreduce = 0.0
        self._last_overhead = np.zeros(n)
        self._last_averaging: float | None = None

    def local_steps(self) -> np.ndarray:
        return np.asarray(self.policy.local_steps, dtype=np.int64)

    def note_schedule(self, steps: Sequence[int] | None = None) -> None:
        planned = self.local_steps() if steps is None else np.asarray(steps, dtype=np.int64)
        if self._planned is None or not np.array_equal(planned, self._planned):
            self._planned = planned.copy()
            self.changes.append((self.averagings, tuple(int(x) for x in planned)))

    def draw(self, width: int) -> np.ndarray:
        """Every rank's step times of the next ``width`` slots (the start-up transient on the very first)."""
        factors = self.timeline.at(self.now) * self.load.factors(self.now)
        draws = self.means[:, None] * factors[:, None] * lognormal(self.rng, (self.n, width), self.noise)
        if not self._started:
            draws[:, 0] += self.first_step_s
            self._started = True
        return draws

    def period(self, draws: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, float]:
        """Every rank's seconds of real steps over ``draws``' slots, and the slots' wall time: the last rank to
        finish its steps and its no-op slots."""
        busy = np.where(real, draws, 0.0).sum(axis=1)
        return busy, float(np.max(busy + self.noop * (real.shape[1] - real.sum(axis=1))))

    def account(self, busy: np.ndarray, period: float, averaged: bool = True) -> None:
        """The clock and accumulators of ``period`` seconds of slots (and the averaging that ends them)."""
        self.compute += busy
        self.idle += period - busy
        cost = self.allreduce_s + self.round_overhead_s if averaged else 0.0
        if averaged:
            self.comm += self.allreduce_s
            self.other += self.round_overhead_s
            if period + self.allreduce_s > 0:
                self.util_sum += busy.sum() / (self.n * (busy.max() + self.allreduce_s))
            self.averagings += 1
        self.now += period + cost

    def control_data(self, draws: np.ndarray, real: np.ndarray, units: np.ndarray, global_step: int) -> ControlData:
        """The averaging that just ended (:meth:`account`): every rank's report, summed as the all-reduce sums it."""
        busy = np.where(real, draws, 0.0).sum(axis=1)
        samples = real.sum(axis=1) * int(self.record_batch_size or 1)
        reports = rank_reports(draws, real, samples, units, global_step, self._last_allreduce, self._last_overhead)
        # Measured now, reported at the next averaging.
        self._last_allreduce = self.allreduce_s
        if self._last_averaging is not None:
            self._last_overhead = np.maximum(0.0, self.now - self._last_averaging - busy)
        self._last_averaging = self.now
        return ControlData(reports, float(self.n), False, False, False)

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

    def result(self, units: int, paradigm: str) -> SimResult:
        return SimResult(
            paradigm=paradigm,
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
    per round whatever the number of ranks, plus the round controller's work per averaging. ``allreduce_s`` is the
    exposed communication per averaging, ``round_overhead_s`` the bookkeeping around it, ``epoch_overhead_s`` the
    epoch turnover (validation itself takes no simulated time: the benchmark excludes it; its times are in
    ``SimResult.validation_s``).

    ``planned`` (local SGD, oscars): the strategy's round controller runs the fit (see the module docstring) for
    ``cluster.n`` ranks under ``policy``; a validation (every ``val_check_interval`` of the epoch's slots) ends a
    round there, or forces an extra averaging inside one after a re-size, where Lightning validates. Otherwise
    (BSP) rounds of ``local_steps`` run until the epoch's units are used, the last one cut in proportion (a
    ``DistributedSampler``'s even split). ``record_batch_size``: the samples the records count per step (and keep
    the controller's records as ``SimResult.history``).
    """
    engine = _Engine(cluster, policy, allreduce_s, round_overhead_s, first_step_s, seed, record_batch_size)
    rounds = None
    if planned:
        timed = isinstance(policy, OscarsPolicy) and policy.timed_warmup
        gate = WarmupGate(cluster.n, lambda delta: 0) if timed else None  # the simulator decides the gate's slots
        rounds = RoundController(policy, cluster.n, 0, warmup_gate=gate, now=lambda: engine.now)
        rounds.begin_fit()
    else:
        policy.begin(cluster.n)
    epoch_units = units_per_epoch or total_units
    done = 0
    while done < total_units:
        units = min(epoch_units, total_units - done)
        if rounds is not None:
            _planned_epoch(engine, rounds, units, val_check_interval)
        else:
            _even_epoch(engine, units, val_check_interval)
        done += units
        engine.end_epoch(epoch_overhead_s)
    if rounds is not None and record_batch_size is not None:
        engine.history = [dict(record.as_dict()) for record in rounds.history]
    return engine.result(done, getattr(policy, "name", "oscars"))


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
        draws = engine.draw(width)
        busy, period = engine.period(draws, np.arange(width)[None, :] < steps[:, None])
        engine.account(busy, period)
        engine.slots += width
        if engine.record_batch_size is not None:  # ddp's rounds as a strategy's records would show them
            engine.history.append(
                {
                    "round": engine.averagings,
                    "time": engine.now,
                    "epoch": engine.epoch,
                    "global_step": engine.slots,
                    "local_steps": [int(x) for x in engine.local_steps()],
                    "samples": [int(x) * engine.record_batch_size for x in steps],
                    "compute_times": [float(x) for x in busy],
                    "allreduce_time": engine.allreduce_s,
                }
            )
        if check and (slot + width) // check > slot // check:
            engine.validations.append(engine.now)
        left -= int(steps.sum())
        slot += width


def _real_slots(rnd: Round, draws: np.ndarray, warmup_steps: int) -> np.ndarray:
    """Which of the round's slots each rank trains in: its quota spread over the round (``Round.real_offsets``);
    in a time-boxed warm-up round, the slots it starts before the slowest rank has taken its warm-up steps."""
    n, width = draws.shape
    if rnd.warmup:
        trained = timed_warmup_steps(draws, warmup_steps, rnd.quotas)
        return np.arange(width)[None, :] < np.asarray(trained)[:, None]
    real = np.zeros((n, width), dtype=bool)
    for rank in range(n):
        if rnd.quotas[rank]:
            real[rank, rnd.real_offsets(rank)] = True
    return real


def _planned_epoch(engine: _Engine, rounds: RoundController, units: int, val_check_interval: float | None) -> None:
    """One epoch as ``OscarsStrategy`` drives it: the round controller plans it and takes every averaging."""
    points: frozenset[int] | None = None  # after a mid-epoch re-size: the slots that validate (as the adapter does)
    check: int | None = None

    def validates(count: int) -> bool:
        if points is not None:
            return count in points
        every = check
        return every is not None and count % every == 0

    def boundaries(slots: int) -> tuple[int, ...]:  # the adapter's validation_slots: rounds end there
        if points is not None:
            return tuple(sorted(p for p in points if 0 < p < slots))
        every = _val_check_batch(slots, val_check_interval)
        return tuple(range(every, slots, every)) if every else ()

    plan = rounds.plan_epoch(engine.epoch, units, rounds.epoch_slot_bound(units), boundaries)
    engine.epoch_slots.append(plan.total_slots)
    check = _val_check_batch(plan.total_slots, val_check_interval)
    slot = 0
    while slot < plan.total_slots:
        rnd = plan.round_at(slot)
        if rnd.is_empty:
            engine.idle_slots(rnd.end_slot - slot, sum(validates(c) for c in range(slot + 1, rnd.end_slot + 1)))
            slot = rnd.end_slot
            continue
        engine.note_schedule(rounds.local_steps)
        draws = engine.draw(rnd.length)
        real = _real_slots(rnd, draws, rounds.policy.warmup)
        before = plan.total_slots
        cuts = [c - slot for c in range(slot + 1, rnd.end_slot) if validates(c)]
        for a, b in zip((0, *cuts), (*cuts, rnd.length)):
            busy, period = engine.period(draws[:, a:b], real[:, a:b])
            engine.account(busy, period)
            units_so_far = real[:, :b].sum(axis=1)
            summed = engine.control_data(draws[:, a:b], real[:, a:b], units_so_far, engine.slots + b)
            next_slot = rnd.end_slot if b == rnd.length else None
            rounds.absorb(summed, allreduce_s=engine.allreduce_s, epoch=engine.epoch, global_step=engine.slots + b,
                          next_slot=next_slot)  # fmt: skip
            if b < rnd.length or validates(rnd.end_slot):
                engine.validations.append(engine.now)
        engine.slots += rnd.length
        slot = rnd.end_slot
        if plan.total_slots != before and check:  # re-sized as the adapter re-sizes Lightning's epoch
            due = sum(validates(c) for c in range(slot + 1, before + 1))
            points = frozenset(validations_after_resize(slot, plan.total_slots, due))


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
