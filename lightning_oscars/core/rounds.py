"""The round controller: one fit's rounds, without Lightning and without torch.distributed.

:class:`RoundController` owns what a rank knows about its rounds' slots: the epoch's plan (and its re-plans),
deadline rounds and the warm-up, the step clock and the per-round step-time median, the counters since the last
averaging. What every rank agreed on at each averaging (costs, jitters, requests, the history) is its
:class:`~lightning_oscars.core.ledger.RoundLedger`. The fit session drives it:

1. :meth:`~RoundController.plan_epoch` at each epoch start;
2. per slot :meth:`~RoundController.begin_slot` (the slot's data arrived) and :meth:`~RoundController.end_slot`
   (its hooks ran), which says when a round ends;
3. :meth:`~RoundController.contribution` (this rank's control data), the all-reduce (the scheme's), then
   :meth:`~RoundController.absorb` with everyone's summed data: a :class:`RoundOutcome`, the same on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_oscars.core.continuation import EpochContinuation
from lightning_oscars.core.control import Contribution, ControlData, RankReport, RoundRecord
from lightning_oscars.core.deadline import DeadlinePacer, DeadlineRound, quantile_step
from lightning_oscars.core.deadline_planner import DeadlinePlanner
from lightning_oscars.core.ledger import MEDIAN_ERROR, RoundLedger, RoundOutcome, step_jitter
from lightning_oscars.core.partition import EpochPlan
from lightning_oscars.core.policy import SchedulePolicy
from lightning_oscars.core.quotas import block_widths, within_spread
from lightning_oscars.core.slots import SlotInfo, ends_slot
from lightning_oscars.core.timing import LapClock, StepTimeEstimator, WallClock
from lightning_oscars.core.warmup import WarmupGate

__all__ = ["RoundController", "RoundOutcome"]


class RoundController:
    """Round bookkeeping of one rank for one ``fit`` (see the module docstring).

    Args:
        policy: decides the local steps; :meth:`begin_fit` starts it.
        world_size / rank: this rank's place (with replica groups, ``replicas.py``: the replicas, and its replica).
        member / replica_size: its place in its replica, and the replica's ranks. Only a replica's first rank reports
            measurements (under DDP its steps wait for the slowest rank); the others report their samples.
        weighted: weight this rank's model by its samples in the round (else every rank weighs 1).
        deadline: deadline rounds (``deadline.py``) once a schedule is solved; :attr:`pacer` decides the slots.
        warmup_gate: time-box the warm-up round (``warmup.py``): faster ranks train until the slowest has taken its
            warm-up steps. Without it every rank takes exactly ``warmup_steps``.
        batch_sizes: every rank's own batch size (``None``: the loader's): widths of units per step (``quotas.py``).
        clock: measures local steps (host wall clock by default; CUDA events on a GPU).
        now: wall clock for the record's ``time``.
    """

    def __init__(
        self,
        policy: SchedulePolicy,
        world_size: int,
        rank: int,
        *,
        member: int = 0,
        replica_size: int = 1,
        weighted: bool = False,
        deadline: bool = False,
        warmup_gate: WarmupGate | None = None,
        clock: LapClock | None = None,
        now: Callable[[], float] = time.perf_counter,
        batch_sizes: Sequence[int] | None = None,
    ) -> None:
        if not (0 <= rank < world_size and 0 <= member < replica_size):
            raise ValueError(f"rank {rank} (member {member}) outside {world_size} replicas of {replica_size} ranks")
        self.batch_sizes = tuple(batch_sizes) if batch_sizes is not None else None
        self.widths = block_widths(batch_sizes)[1] if batch_sizes is not None else None
        policy.widths = self.widths
        self.policy = policy
        self.world_size, self.rank, self.member, self.replica_size = world_size, rank, member, replica_size
        self.weighted, self.pacer = weighted, (DeadlinePacer(now) if deadline else None)
        self.warmup_gate = warmup_gate
        self._warmup_planned = False  # the fit's warm-up round was laid out (once per fit)
        self.clock: LapClock = clock if clock is not None else WallClock()
        self.ledger = RoundLedger(world_size, rank, now)
        self.plan: EpochPlan | None = None
        self.planned_epoch = -1
        self.continuation: EpochContinuation | None = None  # where an epoch goes on after a failed round
        self._slot_bound: int | None = None  # the loader's length: an epoch re-sized mid-way never outgrows it
        self.slot = SlotInfo(True, 0)
        self.failed = False  # this rank raised or its all-reduce broke: skip every further collective
        self._medians = StepTimeEstimator(smoothing=1.0)  # the round's median; the policy smooths across rounds
        self._upper_bound = self._replan_pending = False
        self._round_units = 0  # units this rank trained in the current round (across extra averagings)
        self._deadlines = DeadlinePlanner()
        # The most local steps a rank may take beyond the fewest (``None``: any). A scheme whose rule bounds the lead
        # sets it (0 under BSP: one step per clock for all), so that no round's plan gives a rank steps it could only
        # take by running past the bound; in a plain round (warm-up, an epoch's tail) nothing is handed back.
        self.step_spread: int | None = None
        self._reset_round()

    def _reset_round(self) -> None:
        self._chained = False  # the next real step's interval starts at its own start (see begin_slot)
        self._slots_since_average = self._round_samples = 0
        self._slot_laps: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ fit and epochs

    @property
    def history(self) -> list[RoundRecord]:
        """Every averaging of the fit, as all ranks agreed on it."""
        return self.ledger.history

    @property
    def num_averagings(self) -> int:
        return self.ledger.num_averagings

    def begin_fit(self, max_steps: int | None = None) -> None:
        self.policy.begin(self.world_size, max_steps)
        self.ledger.begin_fit()
        self._warmup_planned = False

    def exclude_time(self, seconds: float) -> None:
        """``seconds`` just spent outside training (validation, a checkpoint write): the records' ``time`` leaves them
        out, and neither a step nor the round's fixed cost includes them."""
        self.ledger.exclude_time(seconds)
        self._chained = False
        if self.pacer is not None:
            self.pacer.shift(seconds)

    @property
    def local_steps(self) -> tuple[int, ...]:
        """The schedule's local steps, within :attr:`step_spread` of the fewest (:func:`within_spread`)."""
        return within_spread(self.policy.local_steps, self.step_spread)

    @property
    def deadline_round(self) -> DeadlineRound | None:
        """The deadline rounds' parameters (``None``: plain rounds, or no schedule yet)."""
        return self._deadlines.deadline_round if self.pacer is not None else None

    def _update_deadline(self) -> DeadlineRound | None:
        if self.pacer is None or not self.policy.solved:
            return None
        ledger = self.ledger
        return self._deadlines.update(
            self.policy.estimate, ledger.jitter, self.local_steps, ledger.round_cost, self.policy.max_local_steps
        )

    @property
    def reserve(self) -> tuple[int, ...] | None:
        """Each rank's reservation in a deadline round, or ``None`` while rounds are plain (no schedule yet)."""
        deadline = self._update_deadline()
        return deadline.reserve if deadline is not None else None

    def _deadline_slots(self, total_units: int) -> int | None:
        deadline = self._update_deadline()
        return None if deadline is None else DeadlinePlanner.epoch_slots(deadline, total_units)

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
            done, self.continuation = self.continuation, None  # after a failed round: for its epoch only
            done = done if done is not None and done.fits(epoch, total_units) else None
            sized = (*done.left(bound), None) if done else (total_units, bound, boundaries)  # a continuation: mid-epoch
            left, self._upper_bound = self.policy.epoch_slots(*sized, self.ledger.round_cost)
            total_slots = left + (done.slots if done else 0)
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
                continuation=done,
                widths=self.widths,
            )
            self.planned_epoch = epoch
            self._round_units = 0
            deadline = self.deadline_round
            if self.pacer is not None and deadline is not None:  # started at the last epoch's end, for a full round
                self.pacer.deadline_s = deadline.deadline_s * DeadlinePlanner.scale(self.plan, 0, deadline)
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
        ledger = self.ledger
        report = RankReport(
            median,
            self._round_samples,
            compute,
            ledger.last_allreduce,
            global_step,
            ledger.last_overhead,
            self._round_units,
            jitter,
            error,
        )
        if self.member > 0:  # the replica's first rank reports for it; its samples are every member's
            report = RankReport(samples=self._round_samples)
        weight = float(self._round_samples) if self.weighted else 1.0
        return Contribution(self.rank, report, weight, ledger.stop or stop, ledger.sigterm, ledger.requeue)

    def absorb(
        self, summed: ControlData, *, allreduce_s: float, epoch: int, global_step: int, next_slot: int | None
    ) -> RoundOutcome:
        """Everyone's control data arrived (and the models were combined): update the schedule, maybe re-plan
        the rest of the epoch from ``next_slot`` (``None`` for an extra averaging inside a round)."""
        ledger = self.ledger
        now = ledger.enter(summed, allreduce_s, summed.ranks[self.rank].compute)
        in_force = self.local_steps
        # Until a round's fixed cost has been measured, the policy's prior (pinned with the step times) stands for it.
        cost = ledger.round_cost if ledger.round_cost > 0.0 else self.policy.initial_allreduce_s
        rebalanced = self.policy.observe([r.step_time for r in summed.ranks], cost, [r.error for r in summed.ranks])
        record = RoundRecord(
            round=ledger.num_averagings,
            time=ledger.training_time(now),
            epoch=epoch,
            global_step=global_step,
            local_steps=in_force,
            step_times=tuple(self.policy.estimate),
            samples=tuple(r.samples for r in summed.ranks),
            compute_times=tuple(r.compute for r in summed.ranks),
            allreduce_time=ledger.allreduce_time,
            rebalanced=rebalanced,
            round_cost=ledger.round_cost,
            batch_sizes=self.batch_sizes or (),
        )
        ledger.history.append(record)
        resized = self._replan(rebalanced, next_slot, tuple(r.units for r in summed.ranks))
        if next_slot is not None:
            self._round_units = 0
            deadline = self.deadline_round if self.pacer is not None else None
            if self.pacer is not None and deadline is not None:
                step = self.policy.estimate[self.rank]
                seconds = deadline.deadline_s * DeadlinePlanner.scale(self.plan, next_slot, deadline)
                self.pacer.start_round(seconds, step, quantile_step(step, ledger.jitter[self.rank]))
        ledger.requests_answered(summed)
        self._reset_round()
        return RoundOutcome(record, summed.stop, summed.sigterm, summed.requeue, rebalanced, resized)

    def _replan(self, rebalanced: bool, next_slot: int | None, trained: tuple[int, ...]) -> bool:
        """Follow a new schedule from the next round boundary; return whether the epoch's length changed. A schedule
        adopted at an extra averaging (before validation or a checkpoint) waits for the next boundary. A deadline
        round that ended hands back the units its ranks did not reach first."""
        self._replan_pending = self._replan_pending or rebalanced
        plan = self.plan
        if plan is None:
            return False
        # How far each rank got in the round at an extra averaging inside it (checkpoints, recovery); none at its end.
        plan.progress = trained if next_slot is None else (0,) * self.world_size
        if next_slot is None:
            return False
        if 0 < next_slot <= plan.total_slots:
            ended = plan.round_at(next_slot - 1)
            if ended.deadline and plan.settle(ended.start_slot, trained):
                self._replan_pending = True
        if next_slot >= plan.total_slots:
            return False
        reserve = self.reserve
        upcoming = plan.round_at(next_slot)
        if reserve is not None and DeadlinePlanner.needs_other(plan, upcoming, reserve):
            self._replan_pending = True  # deadline rounds start, or their reservations changed
        if not self._replan_pending:
            return False
        # The first epoch was sized as an upper bound while speeds were unknown: cut it to what is needed.
        slots = plan.total_slots
        expected = self.deadline_round.expected_units if self.deadline_round is not None else 0.0
        prices = self.policy.step_times, self.ledger.round_cost  # a few more slots where they run faster
        plan.replan(next_slot, self.local_steps, self._upper_bound, reserve, expected, self._slot_bound, *prices)
        self._replan_pending = self._upper_bound = False
        return plan.total_slots != slots

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Schedule, timing estimates and the epoch's plan, as stored in checkpoints under ``"oscars"``."""
        estimate = self.policy.estimate
        return {
            "world_size": self.world_size,
            "replica_size": self.replica_size,
            **self.policy.state_dict(),
            **self.ledger.state_dict(),
            "estimate": estimate[self.rank] if len(estimate) > self.rank and estimate[self.rank] > 0 else None,
            "plan_epoch": self.planned_epoch,
            "plan": None if self.plan is None else self.plan.state_dict(),
            "round_units": self._round_units,  # trained in the round so far (a survivor's state after a failure)
        }

    def load_state_dict(self, state: dict[str, Any] | None, total_units: int | None) -> EpochPlan | None:
        """Resume from :meth:`state_dict` (after :meth:`begin_fit`); another world or replica layout starts fresh.
        Returns the restored plan of the checkpointed epoch, if it fits the loader's ``total_units``."""
        if not state or state.get("world_size") != self.world_size or state.get("replica_size", 1) != self.replica_size:
            return None
        self.ledger.load_state_dict(state)
        self.policy.load_state_dict(state, self.ledger.round_cost)
        plan = state.get("plan")
        if plan is None or plan["total_units"] != total_units or tuple(plan.get("widths") or ()) != (self.widths or ()):
            return None  # another epoch size, or other batch sizes: the epoch is planned afresh
        self.plan = EpochPlan.from_state_dict(self.world_size, plan)
        self.planned_epoch = int(state["plan_epoch"])
        self._round_units = self.plan.progress[self.rank]
        return self.plan
