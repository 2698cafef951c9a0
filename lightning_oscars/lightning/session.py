"""The fit session: everything one fit creates, wired to Lightning, and undone at its end.

:class:`FitSession` connects the pure parts (the round controller, the scheme, the loader) to the trainer. The
strategy begins one in ``setup`` when a fit starts and ends it in ``teardown``: :meth:`FitSession.begin` inserts the
round callbacks (``callbacks.py``), which call it at epoch starts, batch ends, validations and the end of training;
``begin_rounds`` installs the adapter's patches and binds the scheme (which may make process groups);
:meth:`FitSession.end` undoes all of it. The strategy calls it when a batch is moved to the device and before a
checkpoint is written. Lightning's counters reach the core as a plain value (``EpochShape``, read once per epoch); every
private Lightning access goes through ``_internals.py``; nothing here imports the strategy.

One round, from Lightning's hook to the all-reduce and back::

    RoundCallback.on_train_batch_end -> finish_slot -> RoundController.end_slot (round over?)
      -> average: RoundController.contribution -> Contribution.encode -> SyncScheme.combine (one all-reduce, the
         RoundMeeting's control data riding in it; or the session sums it apart)
      -> ControlData.decode -> RoundController.absorb (policy.observe, re-plan) -> RoundOutcome -> trainer
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_oscars.core.control import ControlData
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.slots import ends_slot
from lightning_oscars.dist.local_state import LocalState
from lightning_oscars.dist.schemes import RoundMeeting, SyncScheme
from lightning_oscars.dist.sharding import reshard_gathered
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.adapter import LightningAdapter
from lightning_oscars.lightning.agreement import MetricAgreement
from lightning_oscars.lightning.callbacks import append_round_callbacks, insert_round_callbacks, without_callbacks
from lightning_oscars.lightning.fit_failures import FitFailures
from lightning_oscars.lightning.loader_patch import UserBatching
from lightning_oscars.lightning.recovery import RECOVERY_GRACE_S, FitRecovery
from lightning_oscars.lightning.round_tensors import RoundLayout, model_tensors, round_tensors
from lightning_oscars.lightning.training_loaders import build_loader, lead_loader, start_loaders

__all__ = ["FitSession"]


class FitSession:
    """One fit's rounds under ``strategy`` (see the module docstring).

    Args:
        strategy: the Lightning strategy whose ranks, device, module and collectives the fit uses.
        scheme: this fit's synchronisation scheme (bound at training start, released at the end).
        rounds: this fit's round controller.
        name: the strategy's registered name, for error messages.
        seed: the strategy's shuffle seed (``None``: the sampler's or ``seed_everything``'s).
        average_optimizer_state: also average the optimizer state every rank holds.
        restored: the ``"oscars"`` entry of the checkpoint the fit resumes from.
        on_training_end: called after the end of training's averaging (the strategy hands a tuner's loop run back).
        recovery: what the fit saves when a round fails, and the recovery point it resumes from (``recovery.py``).
        batch_sizes: every rank's own batch size (``batch_sizes=`` resolved); ``None``: the DataLoader's.
    """

    def __init__(
        self,
        strategy: ParallelStrategy,
        scheme: SyncScheme,
        rounds: RoundController,
        *,
        name: str,
        seed: int | None = None,
        average_optimizer_state: bool = False,
        restored: dict[str, Any] | None = None,
        on_training_end: Callable[[], None] | None = None,
        recovery: FitRecovery | None = None,
        batch_sizes: Sequence[int] | None = None,
    ) -> None:
        self.strategy = strategy
        self.batch_sizes = batch_sizes
        self.scheme = scheme
        self.rounds = rounds
        self.name = name
        self.seed = seed
        self.average_optimizer_state = average_optimizer_state
        self.restored = restored
        self.on_training_end = on_training_end
        self.recovery = recovery
        self.adapter = LightningAdapter(self.slot_is_real, strategy.root_device)
        self.user_batching = UserBatching(strategy)
        self.layout = RoundLayout(sharded=getattr(strategy, "shard_group", None) is not None)
        self.loader: LoadBalancedLoader | None = None
        self.agreement = MetricAgreement(strategy)
        self.ended = False
        scheme.shape_rounds(rounds)
        self._trainer: Trainer | None = None
        self._callbacks: list[Callback] = []
        self._validation_started: float | None = None
        self.failures = FitFailures(strategy, rounds, scheme, recovery)
        self.local_state: LocalState | None = None  # made when training starts, for the module being fitted

    # ------------------------------------------------------------------ the session's lifecycle

    def begin(self, trainer: Trainer, monitor: bool, after_tuner: bool = False) -> None:
        """Insert the round callbacks (a monitor too, if asked and none is there). ``after_tuner``: append them
        after the callbacks of a tuner's loop run instead (see ``OscarsStrategy.on_train_start``)."""
        self._trainer = trainer
        self.user_batching.install(trainer)  # before the training loader is made
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if after_tuner:
            self._callbacks = append_round_callbacks(self, callbacks)
        else:
            self._callbacks = insert_round_callbacks(self, callbacks, monitor=monitor)

    def callbacks_in(self, trainer: Trainer) -> bool:
        """Whether this session's callbacks are in ``trainer.callbacks`` (a tuner may have replaced the list)."""
        present = {id(cb) for cb in trainer.callbacks}  # type: ignore[attr-defined]
        return bool(self._callbacks) and all(id(cb) in present for cb in self._callbacks)

    def end(self) -> None:
        """The fit is over (or failed): remove the callbacks and the adapter's patches, release the scheme (and the
        process groups it made), drop the loader. The round records stay readable."""
        if self.ended:
            return
        self.ended = True
        if self._trainer is not None:
            self._trainer.callbacks = without_callbacks(self._trainer.callbacks, self._callbacks)  # type: ignore[attr-defined]
        self._trainer, self._callbacks = None, []
        self.adapter.remove(keep_zombie_guard=self.rounds.failed and self.recovery is not None)
        self.user_batching.remove()
        if self.rounds.failed:  # a peer may be gone: a parameter server must not wait for its last word
            self.scheme.abandon()
        self.scheme.release()
        if self.loader is not None:
            self.loader.close()
        self.loader = None

    def slot_is_real(self) -> bool:
        return self.rounds.slot.real

    def fitting(self, trainer: Trainer | None) -> bool:
        return not self.ended and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def wrap_dataloader(self, trainer: Trainer, dataloader: object) -> LoadBalancedLoader:
        """The load-balanced loader over the user's training loader."""
        rounds = self.rounds  # with replica groups: this rank's replica among the replicas
        place = {"rank": rounds.rank, "world_size": rounds.world_size, "batch_sizes": self.batch_sizes}
        place.update(replica_size=rounds.replica_size, member=rounds.member)
        loader = build_loader(self.strategy, trainer, dataloader, self.seed, **place)
        self.adopt_loader(loader)
        return loader

    def adopt_loader(self, loader: LoadBalancedLoader) -> None:
        """Drive ``loader`` with these rounds (its epoch bound, deadline pacer and warm-up gate)."""
        loader.pacer, loader.warmup_gate = self.rounds.pacer, self.rounds.warmup_gate
        self._bound_epoch(loader)
        self.scheme.adopt_loader(loader)
        self.loader = loader
        self.rounds.forget_plan()

    def _lead(self, trainer: Trainer) -> tuple[LoadBalancedLoader, list[LoadBalancedLoader]]:
        assert self.loader is not None
        lead, followers = lead_loader(trainer, self.loader)
        if lead is not self.loader:
            self.adopt_loader(lead)
        return lead, followers

    def _bound_epoch(self, loader: LoadBalancedLoader, at_least: int = 0) -> None:
        """The loader's length: the most slots an epoch of these rounds can take (the only place it is set)."""
        loader.max_slots = max(self.rounds.epoch_slot_bound(loader.total_units), at_least)

    def begin_rounds(self, trainer: Trainer) -> None:
        """Training starts: install the adapter, restore a checkpoint's rounds, continue a resumed epoch."""
        if self.scheme.waits_within_rounds and internals.time_interval_checkpoints(trainer):
            raise ValueError(
                "ModelCheckpoint(train_time_interval=...) broadcasts its decision at every batch, which"
                f" strategy={self.name!r} cannot match: its ranks wait for each other inside a round."
                " Save by steps (every_n_train_steps) or at validation, or use strategy='oscars'."
            )
        self.adapter.install(trainer, self._on_sigterm, self.rounds.ledger.request_requeue)
        if self.recovery is not None:  # a rank's death must leave the survivors time to save
            self.adapter.defer_zombie_guard(RECOVERY_GRACE_S)
        restored, self.restored = self.restored, None
        module = self.strategy.lightning_module
        assert module is not None
        self.local_state = LocalState(module, getattr(self.strategy, "shard_group", None))
        self.layout.record(model_tensors(self.strategy, trainer))  # every rank holds rank 0's model now
        gather = getattr(self.strategy, "module_all_gather", None)
        if gather is not None:  # lists of different lengths (what each rank trained) can be gathered
            self.adapter.patch(module, "all_gather", gather(module.all_gather))
        loader = self._lead(trainer)[0] if self.loader is not None else None
        units = loader.units_within(trainer.limit_train_batches) if loader else None
        position = internals.resume_position(trainer)
        recovery = self.recovery if restored is not None and "recovery" in restored else None
        plan = None if recovery is not None else self.rounds.load_state_dict(restored, units)
        if plan is not None and loader is not None:
            # A plan checkpointed under a looser bound (an older release) must still fit in the loader.
            self._bound_epoch(loader, at_least=max(loader.max_slots, plan.total_slots))
        if recovery is not None and restored is not None:  # a new world: fresh schedule, the survivors merged
            recovery.resume(self.rounds, loader, restored, trainer.current_epoch, position, units)
            # Before the scheme is bound: a parameter server starts from the merged model.
            shard_group = getattr(self.strategy, "shard_group", None)
            recovery.merge(self._synchronized_tensors(trainer), self.strategy.root_device, shard_group)
            going_on = self.rounds.continuation
            if going_on is not None and loader is not None:
                self._bound_epoch(loader, at_least=going_on.slot_bound(self.rounds.epoch_slot_bound))
        self.scheme.bind(p for p in module.parameters() if p.requires_grad)
        self.scheme.load_state_dict((restored or {}).get("scheme"))
        if position is not None:
            self.prepare_epoch(trainer, resume_at=position)

    def _on_sigterm(self) -> None:
        launcher = self.strategy.launcher
        if self.rounds.ledger.request_sigterm() and launcher is not None:
            launcher.kill(signal.SIGTERM)

    def prepare_epoch(self, trainer: Trainer, resume_at: int = 0) -> None:
        """Plan the epoch, hand it to the loader and tell Lightning its length."""
        loader = self.loader
        if loader is None:
            return
        shape = self.adapter.read_epoch(trainer)  # Lightning's counters, read once: the core plans from the value
        loader, followers = self._lead(trainer)  # several loaders combined: one leads the plan (the same everywhere)
        epoch = shape.epoch

        def plan_epoch() -> EpochPlan:
            if shape.batches_per_slot != loader.batches_per_slot:
                # A GradientAccumulationScheduler changed the slot size: units, bounds and the plan follow.
                loader.set_batches_per_slot(shape.batches_per_slot)
                self._bound_epoch(loader)
                self.rounds.forget_plan()
            # A fractional limit_train_batches is applied here, to the units (what ddp would train), not the slots.
            units = loader.units_within(shape.limit)
            if isinstance(shape.limit, float):
                internals.lift_batch_limit(trainer)
            return self.rounds.plan_epoch(epoch, units, loader.max_slots, shape.boundaries)

        order = self.recovery.order_for(epoch) if self.recovery is not None else None
        plan = start_loaders(self.strategy, loader, followers, epoch, order, resume_at, plan_epoch)
        self.adapter.start_epoch()
        self.adapter.size_epoch(trainer, plan.total_slots * loader.batches_per_slot)

    def start_step(self) -> None:
        self.failures.in_step = True

    def finish_slot(self, trainer: Trainer, batch_idx: int) -> None:
        """A batch finished its hooks: maybe end the round."""
        self.failures.in_step = False
        validation = self.adapter.epoch.validation
        if validation is not None:  # a re-plan at this batch's end places the validations still owed after it
            validation.at_batch(batch_idx)
        if trainer.should_stop:  # a rank-local stop request waits for the round boundary
            self.rounds.ledger.request_stop()
            trainer.should_stop = False
        if self.loader is None:
            return
        slot_done = ends_slot(batch_idx, self.loader.batches_per_slot, trainer.num_training_batches)
        if self.rounds.slot.real and slot_done and not self.rounds.failed and self.failures.lost is None:
            try:
                self.scheme.after_step()  # inside the step's measured time: a parameter server's wait is part of it
            except Exception as error:  # a peer died, raised or hung: stop, or go on alone to the next meeting
                self.failures.exchange_failed(error, f"the {self.scheme.name} exchange after a step", self.loader)
        next_slot = self.rounds.end_slot(batch_idx, self.loader.batches_per_slot, trainer.num_training_batches)
        if next_slot is not None:
            self.average(trainer, next_slot=next_slot)
        if internals.checkpoint_due(trainer):  # the same answer on every rank: it depends on global_step
            if next_slot is None and self.scheme.waits_within_rounds:
                # A ModelCheckpoint saving at this step reduces its decisions (collectives) before it takes the
                # state dict, where the averaging would otherwise happen: a peer waiting for this rank inside the
                # round would never reach them. Averaging first releases it.
                self.average_if_pending()
            # Its top-k and file name may read a step value.
            self.agreement.agree_step_values(trainer, self.rounds.failed)
        self.adapter.pace_validation(trainer, batch_idx)

    def end_epoch(self, trainer: Trainer) -> None:
        """The training epoch ended: align its metrics, then average if anything is pending."""
        self.agreement.align_epoch_metrics(trainer, self.rounds.failed)
        self.average_if_pending()

    def start_validation(self, trainer: Trainer) -> None:
        """Validation is about to run: evaluate one model, and give its callbacks one figure per step value."""
        self.average_if_pending()
        if not trainer.sanity_checking:
            # ModelCheckpoint / EarlyStopping at the validation's end may monitor a training step value
            self.agreement.agree_step_values(trainer, self.rounds.failed)
        self._validation_started = time.perf_counter()

    def end_validation(self, trainer: Trainer) -> None:
        reshard_gathered([trainer.lightning_module])  # a sharded model is 1/k per rank again while training
        started, self._validation_started = self._validation_started, None
        if started is not None:  # records count training time only
            self.rounds.exclude_time(time.perf_counter() - started)

    def end_training(self, trainer: Trainer) -> None:
        """Training ended: what the fit returns (and the last checkpoint holds) is one model."""
        self.average_if_pending()
        if self.recovery is not None:
            self.recovery.fit_ended()
        if self.on_training_end is not None:
            self.on_training_end()

    def average_if_pending(self) -> None:
        """Average now if any rank trained since the last averaging or its result is still to be applied (the same
        answer on every rank)."""
        trainer = internals.trainer_of(self.strategy.lightning_module)
        rounds = self.rounds
        pending = rounds.needs_average or not (self.scheme.settled or rounds.failed) or self.failures.lost is not None
        if self.fitting(trainer) and pending:
            assert trainer is not None
            self.average(trainer, next_slot=None)

    def average(self, trainer: Trainer, next_slot: int | None) -> None:
        """The round's one collective: combine the models and the control data, then act on the outcome."""
        if self.failures.lost is not None:  # an exchange of this round broke: this rank exchanges nothing more
            self.failures.raise_lost(trainer, self.loader)
        rounds, device = self.rounds, self.strategy.root_device
        n = rounds.world_size  # the control data has a row per replica (per rank without replica groups)
        mine = rounds.contribution(trainer.global_step, stop=self.adapter.timer_expired())
        if device.type == "cuda":  # the rank's queued work is not part of the all-reduce
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        try:
            tensors, model = self._synchronized_tensors(trainer), len(model_tensors(self.strategy, trainer))
            sent, flag = self.layout.to_send(tensors, model, device)  # zeros and a flag if its shapes changed
            control = mine.encode(n)
            # The local state's entries ride behind the round's control data, in the same collective.
            # Checkpoint and early-stopping scores are agreed by every rank at each decision: nothing to average.
            callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, (Checkpoint, EarlyStopping))]  # type: ignore[attr-defined]
            tail = self.local_state.control_tail(callbacks) if self.local_state is not None else []
            meeting = RoundMeeting([*control, *tail, flag], ControlData.weight_index(n), self._sum_control, device)
            # Where nothing needs the models equal right after, a scheme may let the combination arrive late.
            late = next_slot is not None and rounds.may_combine_late(next_slot)
            (self.scheme.combine_late if late else self.scheme.combine)(sent, meeting)
            *summed_all, flags = meeting.summed()
            summed = summed_all[: len(control)]
            if self.local_state is not None:
                self.local_state.settle(summed_all[len(control) :], device)
        except Exception as error:  # a peer died, raised or hung past the timeout: name it, save, then stop
            raise RuntimeError(self.failures.named(error) + self.failures.save(trainer, self.loader)) from error
        # A rank whose shapes changed: every rank raises the same error naming them (no rank is lost).
        self.layout.settle(flags, tensors, model, self.strategy, trainer)
        if self.recovery is not None:
            self.recovery.averaged()
        outcome = rounds.absorb(
            ControlData.decode(summed, n),
            allreduce_s=time.perf_counter() - started,
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
            next_slot=next_slot,
        )
        if outcome.resized:
            assert self.loader is not None and rounds.plan is not None
            self.adapter.size_epoch(trainer, rounds.plan.total_slots * self.loader.batches_per_slot, mid_epoch=True)
        if outcome.stop:
            trainer.should_stop = True
        if outcome.sigterm:
            internals.mark_sigterm(trainer)
        if outcome.requeue:
            # A requeue signal (SLURM's SIGUSR1) reached some rank: its handler runs now, on every rank at the same
            # batch, so the checkpoint it writes meets matched collectives.
            self.adapter.run_requeue_handler()

    def _sum_control(self, control: Sequence[float]) -> list[float]:
        """The control data summed over ranks in one small all-reduce (when the scheme carried it in none)."""
        summed = torch.tensor(list(control), dtype=torch.float64, device=self.strategy.root_device)
        torch.distributed.all_reduce(summed, op=torch.distributed.ReduceOp.SUM)
        return summed.tolist()

    def _synchronized_tensors(self, trainer: Trainer) -> list[Tensor]:
        return round_tensors(self.strategy, trainer, self.local_state, self.average_optimizer_state)

    def report_failure(self, error: BaseException) -> None:
        """This rank's run is ending with ``error``: tell the others who failed, and stop meeting them."""
        self.failures.report(error, self.loader)
