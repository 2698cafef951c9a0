"""The round controller: one fit's rounds, without Lightning and without torch.distributed.

:class:`RoundController` owns what a rank knows about its rounds: the epoch's plan, the step clock, the
per-round step-time median, the counters since the last averaging, the pending requests (stop, SIGTERM,
requeue) and the history. The strategy drives it:

1. :meth:`~RoundController.plan_epoch` at each epoch start;
2. per slot :meth:`~RoundController.begin_slot` (the slot's data arrived) and :meth:`~RoundController.end_slot`
   (its hooks ran), which says when a round ends;
3. :meth:`~RoundController.contribution` (this rank's control data), the all-reduce (done by the scheme),
   then :meth:`~RoundController.absorb` with everyone's summed control data, which returns a
   :class:`RoundOutcome` that every rank computes identically.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_oscars.control import Contribution, ControlData, RankReport, RoundRecord
from lightning_oscars.deadline import DeadlinePacer, DeadlineRound, plan_deadline, quantile_step
from lightning_oscars.loader import SlotInfo
from lightning_oscars.partition import (
    EpochPlan,
    Round,
    deadline_epoch_slots,
    deadline_reservation,
    deadline_round_fits,
    reservation_scale,
)
from lightning_oscars.policy import SchedulePolicy
from lightning_oscars.timing import LapClock, StepTimeEstimator, WallClock
from lightning_oscars.warmup import WarmupGate

# Weight of the newest round in the moving average of every rank's step jitter (deadline rounds).
JITTER_SMOOTHING = 0.3
# A MAD of log step times, divided by this, estimates the log-spread (sigma) of lognormal steps.
_MAD_TO_SIGMA = 0.6745

# Rounds whose measured fixed cost the solver's price is the median of: epoch ends, checkpoint writes and the
# first round after validation cost more than a plain round, and must not re-solve the schedule each time.
COST_WINDOW = 9

__all__ = ["RoundController", "RoundOutcome", "ends_slot"]


# A sample median's standard error over the spread's sigma, times sqrt(n) (sqrt(pi / 2) for normal noise).
MEDIAN_ERROR = math.sqrt(math.pi / 2)


def step_jitter(seconds: list[float], reference: float) -> float:
    """The log-spread of a round's step times around the rank's long-run median ``reference`` (a MAD: a round holds
    too few steps for quartiles); 0 with fewer than two steps."""
    logs = [abs(math.log(s / reference)) for s in seconds if s > 0.0 and reference > 0.0]
    return statistics.median(logs) / _MAD_TO_SIGMA if len(logs) >= 2 else 0.0


def _needs_other_deadline(plan: EpochPlan, rnd: Round, reserve: tuple[int, ...]) -> bool:
    """Whether the upcoming round ``rnd`` differs from the deadline round ``reserve`` asks for (a plain round where
    one would fit: planned before the first deadline was known). A round shortened to end on a validation boundary
    holds a scaled reservation, and is what ``reserve`` asks for there."""
    if rnd.deadline:
        return rnd.quotas != deadline_reservation(rnd.start_slot, reserve, plan.boundary_slots(), plan.total_slots)
    return deadline_round_fits(reserve, plan.total_units - rnd.first_unit, plan.total_slots - rnd.start_slot)


@dataclass(frozen=True)
class RoundOutcome:
    """What an averaging decided, the same on every rank.

    Attributes:
        record: the round as every rank agreed on it.
        stop: some rank asked to stop (``should_stop``, an expired ``Timer``).
        sigterm: some rank received SIGTERM: every rank shuts down at this batch.
        requeue: some rank received the requeue signal: every rank runs the requeue handler now.
        rebalanced: a new schedule was adopted.
        resized: the epoch got shorter (the first schedule cut an epoch sized as an upper bound).
    """

    record: RoundRecord
    stop: bool
    sigterm: bool
    requeue: bool
    rebalanced: bool
    resized: bool


def ends_slot(batch_idx: int, batches_per_slot: int, epoch_batches: float) -> bool:
    """Whether batch ``batch_idx`` of the epoch is the last of its slot (a slot is ``batches_per_slot`` batches,
    the epoch's last one possibly fewer)."""
    return (batch_idx + 1) % batches_per_slot == 0 or batch_idx + 1 >= epoch_batches


class RoundController:
    """Round bookkeeping of one rank for one ``fit`` (see the module docstring).

    Args:
        policy: decides the local steps; :meth:`begin_fit` starts it.
        world_size / rank: this rank's place.
        weighted: weight this rank's model by its samples in the round (else every rank weighs 1).
        deadline: deadline rounds (``deadline.py``) once a schedule is solved; :attr:`pacer` decides the slots.
        warmup_gate: time-box the warm-up round (``warmup.py``): faster ranks train until the slowest has taken its
            warm-up steps. Without it every rank takes exactly ``warmup_steps``.
        clock: measures local steps (host wall clock by default; CUDA events on a GPU).
        now: wall clock for the record's ``time``.
    """

    def __init__(
        self,
        policy: SchedulePolicy,
        world_size: int,
        rank: int,
        *,
        weighted: bool = False,
        deadline: bool = False,
        warmup_gate: WarmupGate | None = None,
        clock: LapClock | None = None,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.policy = policy
        self.world_size = world_size
        self.rank = rank
        self.weighted = weighted
        self.pacer: DeadlinePacer | None = DeadlinePacer(now) if deadline else None
        self.warmup_gate = warmup_gate
        self._warmup_planned = False  # the fit's warm-up round was laid out (once per fit)
        self.clock: LapClock = clock if clock is not None else WallClock()
        self._now = now
        self.history: list[RoundRecord] = []
        self.num_averagings = 0
        self.round_cost = 0.0  # the agreed fixed cost of one round, as the solver prices it
        self.allreduce_time = 0.0  # the agreed duration of the last all-reduce alone
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)  # the last rounds' agreed fixed costs
        self.plan: EpochPlan | None = None
        self.planned_epoch = -1
        self._slot_bound: int | None = None  # the loader's length: an epoch re-sized mid-way never outgrows it
        self.slot = SlotInfo(True, 0)
        self.failed = False  # this rank raised or its all-reduce broke: skip every further collective
        self._started = now()
        self._excluded = 0.0  # seconds of validation since the start: not training time
        self._round_started: float | None = None  # when this rank's current round began (last averaging's end)
        self._last_overhead = 0.0
        self._medians = StepTimeEstimator(smoothing=1.0)  # the round's median; the policy smooths across rounds
        self._last_allreduce = 0.0
        self._upper_bound = False
        self._replan_pending = False
        self._stop = self._sigterm = self._requeue = False
        self._round_units = 0  # units this rank trained in the current round (across extra averagings)
        self.jitter = [0.0] * world_size  # every rank's smoothed step log-spread, agreed (deadline rounds)
        self.deadline_round: DeadlineRound | None = None
        self._deadline_key: tuple | None = None
        # The most local steps a rank may take beyond the fewest (``None``: any). A scheme whose rule bounds the
        # lead sets it (0 under BSP: one step per clock for everybody), so that no round's plan gives a rank steps
        # it could only take by running past the bound; in a plain round (the warm-up, an epoch's tail) the
        # quotas are all the rank trains, not handed back.
        self.step_spread: int | None = None
        self._reset_round()

    def _reset_round(self) -> None:
        self._chained = False  # the next real step's interval starts at its own start (see begin_slot)
        self._slots_since_average = 0
        self._round_samples = 0
        self._slot_laps: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ fit and epochs

    def begin_fit(self, max_steps: int | None = None) -> None:
        self.policy.begin(self.world_size, max_steps)
        self._started = self._now()
        self._excluded = 0.0
        self._round_started = None
        self._costs.clear()
        self._warmup_planned = False

    def exclude_time(self, seconds: float) -> None:
        """``seconds`` just spent outside training (validation, a checkpoint write): the records' ``time`` leaves them
        out, and neither a step nor the round's fixed cost includes them."""
        self._excluded += max(0.0, seconds)
        self._chained = False
        if self.pacer is not None:
            self.pacer.shift(seconds)
        if self._round_started is not None:  # validation is not part of the round's cost either
            self._round_started += max(0.0, seconds)

    @property
    def local_steps(self) -> tuple[int, ...]:
        """The schedule's local steps, within :attr:`step_spread` of the fewest."""
        steps = self.policy.local_steps
        if self.step_spread is None or not steps:
            return steps
        most = min(steps) + self.step_spread
        return tuple(min(t, most) for t in steps)

    def _update_deadline(self) -> DeadlineRound | None:
        """The deadline rounds' parameters (``None``: plain rounds), re-planned when the schedule, a step time (by
        5%) or a jitter (by 0.02) moved: every rank has the same figures, so every rank re-plans at the same round."""
        times = self.policy.estimate
        if self.pacer is None or not self.policy.solved or not times or min(times) <= 0.0:
            return None
        key = (
            self.local_steps,
            tuple(round(math.log(t) / 0.05) for t in times),
            tuple(round(s / 0.02) for s in self.jitter),
        )
        if key != self._deadline_key:
            self._deadline_key = key
            self.deadline_round = plan_deadline(
                times, self.jitter, self.local_steps, self.round_cost, self.policy.max_local_steps
            )
        return self.deadline_round

    @property
    def reserve(self) -> tuple[int, ...] | None:
        """Each rank's reservation in a deadline round, or ``None`` while rounds are plain (no schedule yet)."""
        deadline = self._update_deadline()
        return deadline.reserve if deadline is not None else None

    def _deadline_slots(self, total_units: int) -> int | None:
        deadline = self._update_deadline()
        if deadline is None:
            return None
        return deadline_epoch_slots(deadline.expected_units, max(deadline.reserve), total_units)

    def epoch_slot_bound(self, total_units: int) -> int:
        """The loader's length: the most slots an epoch can take. Deadline rounds last their largest reservation,
        beyond the local steps a plain round lasts, so their epochs take more slots."""
        bound = self.policy.epoch_slot_bound(total_units)
        if self.pacer is None:
            return bound
        known = self._deadline_slots(total_units) if not self.policy.resolve else None
        return known if known is not None else 3 * bound

    def plan_epoch(
        self, epoch: int, total_units: int, bound: int, boundaries: Callable[[int], Sequence[int]] | None = None
    ) -> EpochPlan:
        """The plan of ``epoch`` over ``total_units`` units in at most ``bound`` slots (the loader's length). A
        plan restored from a checkpoint for this epoch is kept (resume mid-epoch). ``boundaries``: the epoch's
        validation slots for an epoch of so many slots (:attr:`EpochPlan.boundaries`)."""
        plan = self.plan
        self._slot_bound = bound
        if plan is None or self.planned_epoch != epoch or plan.total_units != total_units:
            total_slots, self._upper_bound = self.policy.epoch_slots(total_units, bound)
            deadline_slots = self._deadline_slots(total_units)
            if deadline_slots is not None:
                total_slots = min(bound, deadline_slots)
            warmup = None
            if self.warmup_gate is not None and not self.policy.solved and not self._warmup_planned:
                self._warmup_planned = True
                warmup = (self.policy.warmup_reservation(),) * self.world_size
                self.warmup_gate.begin(self.policy.warmup)
            plan = self.plan = EpochPlan(
                self.world_size,
                total_units,
                total_slots,
                self.local_steps,
                self.reserve,
                warmup_reserve=warmup,
                boundaries=boundaries,
            )
            self.planned_epoch = epoch
            self._round_units = 0
            deadline = self.deadline_round
            if self.pacer is not None and deadline is not None:  # started at the last epoch's end, for a full round
                self.pacer.deadline_s = deadline.deadline_s * self._deadline_scale(0, deadline)
        else:
            plan.boundaries = boundaries  # restored: its later re-plans end rounds at validation too
        self._replan_pending = False
        self.clock.drain()
        self._reset_round()
        return plan

    def forget_plan(self) -> None:
        """The epoch's units changed (a new accumulation size): the next :meth:`plan_epoch` plans afresh."""
        self.plan = None

    # ------------------------------------------------------------------ slots

    def begin_slot(self, slot: SlotInfo) -> None:
        """The next slot's data is here. A real step's interval ends in :meth:`end_slot`. It began at the end of
        this round's previous real step, if any: Lightning's work between steps, the data loading and the no-op
        slots in between are what the rank pays per step. The round's first step (and one after worker start-up)
        begins now instead, and the loader's measured data loading is added."""
        self.slot = slot
        if slot.real and (not self._chained or slot.fetch_seconds is None):
            self._chained = False
            self.clock.mark()

    def end_slot(self, batch_idx: int, batches_per_slot: int, epoch_batches: float) -> int | None:
        """Batch ``batch_idx`` of the epoch finished its hooks. Returns the slot where the next round starts if
        the batch ended a round (time to average), else ``None``."""
        plan = self.plan
        if plan is None:
            return None
        slot = batch_idx // batches_per_slot
        if self.slot.real and batch_idx % batches_per_slot == 0:
            self._round_units += 1
        if self.slot.real:
            self.clock.lap()
            self._slot_laps.append((slot, 0.0 if self._chained else self.slot.fetch_seconds or 0.0))
            self._round_samples += self.slot.samples
            self._chained = True  # the lap started the next interval
        if not ends_slot(batch_idx, batches_per_slot, epoch_batches):
            return None
        if slot >= plan.total_slots:
            # Lightning ran past the epoch's plan (a callback lengthened the epoch: SWA's BatchNorm pass adds a
            # batch). Nobody trained, but a partial accumulation unit may have stepped the optimizer on this rank's
            # own gradients there: the epoch's end must average (the same answer on every rank: all ran this slot).
            self._slots_since_average += 1
            return None
        rnd = plan.round_at(slot)
        if rnd.warmup and self.warmup_gate is not None:
            self.warmup_gate.trained(self._round_units)
        if rnd.is_empty:
            return None
        self._slots_since_average += 1
        return rnd.end_slot if slot + 1 == rnd.end_slot else None

    def may_combine_late(self, next_slot: int) -> bool:
        """Whether the averaging before slot ``next_slot`` may reach the models late (overlapped with the next
        round): not at the epoch's end or where Lightning validates, which need the models equal."""
        plan = self.plan
        return plan is not None and next_slot < plan.total_slots and next_slot not in plan.boundary_slots()

    @property
    def needs_average(self) -> bool:
        """Whether a rank trained since the last averaging (the same answer on every rank)."""
        return self._slots_since_average > 0 and not self.failed

    # ------------------------------------------------------------------ requests

    def request_stop(self) -> None:
        self._stop = True

    def request_sigterm(self) -> bool:
        """Record a SIGTERM; return whether it is the first."""
        first, self._sigterm = not self._sigterm, True
        return first

    def request_requeue(self) -> None:
        self._requeue = True

    # ------------------------------------------------------------------ the averaging

    def contribution(self, global_step: int, stop: bool = False) -> Contribution:
        """This rank's control data for the averaging about to happen (closes the round's measurements)."""
        per_slot: dict[int, float] = {}
        for (slot, fetch), seconds in zip(self._slot_laps, self.clock.drain()):
            per_slot[slot] = per_slot.get(slot, 0.0) + seconds + fetch
        for seconds in per_slot.values():
            self._medians.add(seconds)
        median = (self._medians.end_round() or 0.0) if self._medians.pending else 0.0
        compute = sum(per_slot.values())
        jitter = 0.0
        steps = list(per_slot.values())
        if self.pacer is not None:  # only deadline rounds use it
            known = self.policy.estimate[self.rank] if self.policy.estimate else 0.0
            jitter = step_jitter(steps, known if known > 0.0 else median)
        # How well the round measured this rank's speed: the median's standard error (~1.25 sigma / sqrt(n)).
        error = MEDIAN_ERROR * step_jitter(steps, median) / math.sqrt(len(steps)) if median > 0.0 else 0.0
        report = RankReport(
            median,
            self._round_samples,
            compute,
            self._last_allreduce,
            global_step,
            self._last_overhead,
            self._round_units,
            jitter,
            error,
        )
        weight = float(self._round_samples) if self.weighted else 1.0
        return Contribution(self.rank, report, weight, self._stop or stop, self._sigterm, self._requeue)

    def absorb(
        self, summed: ControlData, *, allreduce_s: float, epoch: int, global_step: int, next_slot: int | None
    ) -> RoundOutcome:
        """Everyone's control data arrived (and the models were combined): update the schedule, maybe re-plan
        the rest of the epoch from ``next_slot`` (``None`` for an extra averaging inside a round)."""
        self._last_allreduce = allreduce_s
        self.num_averagings += 1
        steps = {r.global_step for r in summed.ranks}
        if len(steps) > 1:
            raise RuntimeError(
                f"Ranks disagree on global_step ({sorted(steps)}). Under manual optimization oscars needs every"
                " training_step to call optimizer.step() the same number of times."
            )
        costs = [r.allreduce for r in summed.ranks if r.allreduce > 0.0]
        if costs:  # the last rank to arrive waits least: its duration is the closest to the transfer cost
            self.allreduce_time = min(costs)
        overheads = [r.overhead for r in summed.ranks if r.overhead > 0.0]
        if overheads:  # likewise the busiest rank spends least of its round outside its own steps
            self._costs.append(max(min(overheads), self.allreduce_time))
        # The solver prices the median recent fixed cost per round (one slow round does not re-solve the schedule).
        # Until a whole round has been measured it is unknown (0): the first schedule is solved as if averaging were
        # free and re-solved once, when the cost becomes known.
        self.round_cost = statistics.median(self._costs) if self._costs else 0.0
        for rank, report in enumerate(summed.ranks):
            if report.jitter > 0.0:
                old = self.jitter[rank]
                self.jitter[rank] = report.jitter if old <= 0.0 else old + JITTER_SMOOTHING * (report.jitter - old)
        now = self._now()
        if self._round_started is not None:
            self._last_overhead = max(0.0, now - self._round_started - summed.ranks[self.rank].compute)
        self._round_started = now
        in_force = self.local_steps
        rebalanced = self.policy.observe(
            [r.step_time for r in summed.ranks], self.round_cost, [r.error for r in summed.ranks]
        )
        record = RoundRecord(
            round=self.num_averagings,
            time=now - self._started - self._excluded,
            epoch=epoch,
            global_step=global_step,
            local_steps=in_force,
            step_times=tuple(self.policy.estimate),
            samples=tuple(r.samples for r in summed.ranks),
            compute_times=tuple(r.compute for r in summed.ranks),
            allreduce_time=self.allreduce_time,
            rebalanced=rebalanced,
            round_cost=self.round_cost,
        )
        self.history.append(record)
        resized = self._replan(rebalanced, next_slot, tuple(r.units for r in summed.ranks))
        if next_slot is not None:
            self._round_units = 0
            deadline = self.deadline_round if self.pacer is not None else None
            if self.pacer is not None and deadline is not None:
                step = self.policy.estimate[self.rank]
                seconds = deadline.deadline_s * self._deadline_scale(next_slot, deadline)
                self.pacer.start_round(seconds, step, quantile_step(step, self.jitter[self.rank]))
        self._stop = False
        if summed.requeue:
            self._requeue = False
        self._reset_round()
        return RoundOutcome(record, summed.stop, summed.sigterm, summed.requeue, rebalanced, resized)

    def _deadline_scale(self, slot: int, deadline: DeadlineRound) -> float:
        """The share of the deadline the round starting at ``slot`` gets: less than all of it when the round was
        shortened to end on a validation boundary (its reservations scaled alike)."""
        plan = self.plan
        if plan is None or not 0 <= slot < plan.total_slots:
            return 1.0
        rnd = plan.round_at(slot)
        if not rnd.deadline or rnd.warmup or rnd.start_slot != slot:
            return 1.0
        return reservation_scale(max(deadline.reserve), rnd.length)

    def _replan(self, rebalanced: bool, next_slot: int | None, trained: tuple[int, ...]) -> bool:
        """Follow a new schedule from the next round boundary; return whether the epoch's length changed. A schedule
        adopted at an extra averaging (before validation or a checkpoint) waits for the next boundary. A deadline
        round that ended hands back the units its ranks did not reach first."""
        self._replan_pending = self._replan_pending or rebalanced
        plan = self.plan
        if plan is None:
            return False
        if next_slot is None:  # an extra averaging inside a round: remember how far each rank got (checkpoints)
            plan.progress = trained
            return False
        if 0 < next_slot <= plan.total_slots:
            ended = plan.round_at(next_slot - 1)
            if ended.deadline and plan.settle(ended.start_slot, trained):
                self._replan_pending = True
        if next_slot >= plan.total_slots:
            return False
        reserve = self.reserve
        upcoming = plan.round_at(next_slot)
        if reserve is not None and _needs_other_deadline(plan, upcoming, reserve):
            self._replan_pending = True  # deadline rounds start, or their reservations changed
        if not self._replan_pending:
            return False
        # The first epoch was sized as an upper bound while speeds were unknown: cut it to what is needed.
        slots = plan.total_slots
        expected = self.deadline_round.expected_units if self.deadline_round is not None else 0.0
        plan.replan(next_slot, self.local_steps, self._upper_bound, reserve, expected, self._slot_bound)
        self._replan_pending = False
        self._upper_bound = False
        return plan.total_slots != slots

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Schedule, timing estimates and the epoch's plan, as stored in checkpoints under ``"oscars"``."""
        estimate = self.policy.estimate
        return {
            "world_size": self.world_size,
            **self.policy.state_dict(),
            "round_cost": self.round_cost,
            "round_costs": list(self._costs),
            "estimate": estimate[self.rank] if len(estimate) > self.rank and estimate[self.rank] > 0 else None,
            "num_averagings": self.num_averagings,
            "plan_epoch": self.planned_epoch,
            "plan": None if self.plan is None else self.plan.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any] | None, total_units: int | None) -> EpochPlan | None:
        """Resume from :meth:`state_dict` (after :meth:`begin_fit`). A different world size starts fresh: per-rank
        timings mean nothing then. Returns the restored plan of the checkpointed epoch, if it fits the loader's
        ``total_units``."""
        if not state or state.get("world_size") != self.world_size:
            return None
        self.num_averagings = int(state.get("num_averagings", 0))
        # "allreduce_time": the key under which older checkpoints kept the round cost
        self.round_cost = float(state.get("round_cost", state.get("allreduce_time")) or 0.0)
        self._costs.extend(float(c) for c in state.get("round_costs") or [])
        self.policy.load_state_dict(state, self.round_cost)
        plan = state.get("plan")
        if plan is None or plan["total_units"] != total_units:
            return None
        self.plan = EpochPlan.from_state_dict(self.world_size, plan)
        self.planned_epoch = int(state["plan_epoch"])
        self._round_units = self.plan.progress[self.rank]
        return self.plan
