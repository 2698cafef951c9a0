"""Every place oscars reaches into Lightning's private state, in one module.

Ranks under oscars run the same batches but take different numbers of real steps, and must not meet per
batch. Lightning 2.6 has no public hook for that, so a fit under oscars changes a few things for its duration
(:class:`LightningAdapter` ``install`` / ``remove``; the strategy's ``teardown`` removes them):

* the per-batch SIGTERM broadcast of the training epoch loop and step-interval ``Timer`` checks (both
  collectives) become no-ops; SIGTERM and an expired ``Timer`` travel in the round's all-reduce instead;
* the SIGTERM and requeue (SIGUSR1) handlers defer to the round boundary, where every rank acts together;
* the optimization loops skip a no-op slot's step but advance its counters, and close a partial
  accumulation unit; the logger connector does not re-log the last real step on a no-op slot;
* ``ThroughputMonitor`` counts real slots only.

The rest are reads and writes of private attributes, named here so that a Lightning upgrade breaks one file:
the epoch's ``max_batches`` / ``val_check_batch`` / tqdm total, the resume position, ``received_sigterm``,
the epoch's logged results, EMA copies of the model, the accumulation scheduler's value, module state sync.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

SUPPORTED_LIGHTNING = (">=2.6.0", "<2.7")


def check_lightning_version() -> None:
    """oscars relies on Lightning 2.6's loop internals: refuse any other release with the fix."""
    try:
        found = Version(version("lightning"))
    except PackageNotFoundError:  # pragma: no cover - the dependency is declared
        raise ImportError("lightning-oscars needs the 'lightning' package (>=2.6,<2.7)") from None
    if not (Version("2.6.0") <= found < Version("2.7")):
        raise ImportError(
            f"lightning-oscars supports lightning>=2.6.0,<2.7 (it relies on that release's loop internals);"
            f" found lightning=={found}. Install a supported release: pip install 'lightning>=2.6,<2.7'."
        )


check_lightning_version()

import inspect  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver  # noqa: E402
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper  # noqa: E402
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    GradientAccumulationScheduler,
    ModelCheckpoint,
    ThroughputMonitor,
    Timer,
    WeightAveraging,
)
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher  # noqa: E402
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402
from lightning.pytorch.tuner.lr_finder import _LRCallback  # noqa: E402

from lightning_oscars.partition import validations_after_resize  # noqa: E402

__all__ = [
    "LightningAdapter",
    "check_lightning_version",
    "unwrap_sampler",
]

Handler = Callable[[int, Any], Any]


class LightningAdapter:
    """The patches of one fit (see the module docstring). ``slot_is_real`` says whether the batch in progress is a
    real local step of this rank; ``device`` is where a partial accumulation unit's zero loss lives."""

    def __init__(self, slot_is_real: Callable[[], bool], device: torch.device) -> None:
        self._slot_is_real = slot_is_real
        self._device = device
        self._patches: list[tuple[object, str, bool, Any]] = []
        self._handlers: list[tuple[int, Handler, Any]] = []  # (signal, ours, the one before)
        self._timers: list[Timer] = []
        self._requeue: tuple[int, Any] | None = None
        self._pending_accumulation = False  # a partial unit's gradients wait for the epoch's next no-op slot
        self._last_outputs: Any = {}  # the last real step's outputs: what callbacks see on a no-op slot
        self._manual_steps_per_batch = 0
        self._validation_points: frozenset[int] | None = None  # where to validate after a mid-epoch re-size
        self._epoch_sized = False  # Lightning knows the current epoch's length (size_epoch ran since it was planned)

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def install(self, trainer: Trainer, on_sigterm: Callable[[], None], on_requeue: Callable[[], None]) -> None:
        self.remove()
        self._neutralise_per_batch_collectives(trainer)
        self._install_noop_slots(trainer)
        if threading.current_thread() is threading.main_thread():
            self._install_signal_handlers(trainer, on_sigterm, on_requeue)

    def defer_zombie_guard(self, grace_s: float) -> None:
        """Under Lightning's own launcher, rank 0 watches the other ranks' processes (a private thread) and SIGKILLs
        every rank within 5 s of one dying. The survivors then have no time to save their state for a restart
        (``recovery.py``): the kill waits ``grace_s`` (a survivor's own failed collective ends it sooner). Undone by
        :meth:`remove`."""
        for thread in threading.enumerate():
            if isinstance(thread, _ChildProcessObserver):
                kill = thread._terminate_all

                def terminate_after_grace(kill: Callable[[], None] = kill) -> None:
                    time.sleep(grace_s)
                    kill()

                self._patch(thread, "_terminate_all", terminate_after_grace)

    def patch(self, owner: object, name: str, replacement: Any) -> None:
        """Replace ``owner.name`` with ``replacement`` until :meth:`remove` (the session's patches of user objects)."""
        self._patch(owner, name, replacement)

    def remove(self, keep_zombie_guard: bool = False) -> None:
        """Put back everything :meth:`install` and :meth:`defer_zombie_guard` changed (a handler someone replaced since
        stays theirs). ``keep_zombie_guard``: a fit that failed leaves the kill deferred, so that the process lives to
        print its error and the other survivors to save (it goes with the process, which is ending)."""
        self._last_outputs = {}
        kept: list[tuple[object, str, bool, Any]] = []
        while self._patches:
            owner, name, had_own, original = self._patches.pop()
            if keep_zombie_guard and isinstance(owner, _ChildProcessObserver):
                kept.append((owner, name, had_own, original))
                continue
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._patches = kept[::-1]
        while self._handlers:
            signum, ours, before = self._handlers.pop()
            if signal.getsignal(signum) is ours:
                signal.signal(signum, before)
        self._timers, self._requeue = [], None

    def _patch(self, owner: object, name: str, value: Any) -> None:
        had_own = name in vars(owner)
        self._patches.append((owner, name, had_own, vars(owner).get(name)))
        setattr(owner, name, value)

    def _set_handler(self, signum: int, handler: Handler) -> None:
        self._handlers.append((signum, handler, signal.getsignal(signum)))
        signal.signal(signum, handler)

    # ------------------------------------------------------------------ per-batch collectives and signals

    def _neutralise_per_batch_collectives(self, trainer: Trainer) -> None:
        self._patch(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", lambda: None)
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        self._timers = [cb for cb in callbacks if isinstance(cb, Timer) and cb._interval == "step"]
        for timer in self._timers:
            self._patch(timer, "on_train_batch_end", _skip)
        for callback in callbacks:
            if isinstance(callback, ThroughputMonitor):
                # It measures this rank's throughput and needs its sample count to grow at every batch.
                hook = callback.on_train_batch_end
                self._patch(callback, "on_train_batch_end", self._on_real_slots(hook))
            elif isinstance(callback, _LRCallback):
                # The learning-rate finder broadcasts its stop decision after every real step and returns before it
                # when the step produced no loss: on a no-op slot the broadcast is made here, so every rank meets it.
                hook = callback.on_train_batch_end
                self._patch(callback, "on_train_batch_end", self._broadcast_on_noop_slots(hook))

    def _broadcast_on_noop_slots(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def on_train_batch_end(trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
            real = self._slot_is_real()
            if not real:  # no loss on a no-op slot (not the repeated outputs other callbacks see): it records a NaN
                if "outputs" in kwargs:
                    kwargs["outputs"] = {}
                elif len(args) >= 2:  # (pl_module, outputs, batch, batch_idx)
                    args = (args[0], {}, *args[2:])
            result = hook(trainer, *args, **kwargs)
            stepped = (trainer.fit_loop.batch_idx + 1) % trainer.accumulate_grad_batches == 0
            if not real and stepped:
                trainer.should_stop = trainer.strategy.broadcast(trainer.should_stop)
            return result

        return on_train_batch_end

    def _on_real_slots(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def on_real_slot(*args: Any, **kwargs: Any) -> Any:
            return hook(*args, **kwargs) if self._slot_is_real() else None

        return on_real_slot

    def timer_expired(self) -> bool:
        return any(
            t._duration is not None and t.time_elapsed(RunningStage.TRAINING) >= t._duration for t in self._timers
        )

    def _install_signal_handlers(
        self, trainer: Trainer, on_sigterm: Callable[[], None], on_requeue: Callable[[], None]
    ) -> None:
        original = trainer._signal_connector._original_handlers.get(signal.SIGTERM)
        received: list[int] = []

        def sigterm(signum: int, frame: Any) -> None:
            if received:
                # A second SIGTERM means now, not at the round boundary, which a rank blocked in a collective
                # would never reach: the default action (the process ends, as it would without oscars).
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            received.append(signum)
            on_sigterm()
            if callable(original) and original not in (signal.SIG_IGN, signal.SIG_DFL):
                original(signum, frame)

        self._set_handler(signal.SIGTERM, sigterm)
        # Lightning's requeue handler saves a checkpoint (collectives) inside the handler, i.e. wherever each rank
        # happens to be; with ranks at different local steps that would pair unrelated collectives.
        environment = trainer._accelerator_connector.cluster_environment
        signum = signal.SIGUSR1
        if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
            signum = environment.requeue_signal
        handler = signal.getsignal(signum)
        if callable(handler) and handler not in (signal.SIG_IGN, signal.SIG_DFL):
            self._requeue = (signum, handler)
            self._set_handler(signum, lambda received, frame: on_requeue())

    def run_requeue_handler(self) -> None:
        """Run the deferred requeue handler (every rank, at the same batch)."""
        if self._requeue is not None:
            signum, handler = self._requeue
            handler(signum, None)

    # ------------------------------------------------------------------ no-op slots

    def _install_noop_slots(self, trainer: Trainer) -> None:
        loop = trainer.fit_loop.epoch_loop
        automatic, manual = loop.automatic_optimization, loop.manual_optimization
        run_automatic, run_manual = automatic.run, manual.run

        def automatic_run(optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
            stepping = not loop._should_accumulate()
            if self._slot_is_real():
                self._pending_accumulation = not stepping
                self._last_outputs = run_automatic(optimizer, batch_idx, kwargs)
                return self._last_outputs
            if stepping and self._pending_accumulation:
                # The slot's unit was partial (the epoch's last batches): its real batches ran first and their
                # gradients wait for this step, as ddp applies a partial unit at the epoch's last batch.
                self._pending_accumulation = False
                automatic._optimizer_step(batch_idx, lambda: torch.zeros((), device=self._device))
            elif stepping:
                automatic.optim_progress.optimizer.step.increment_ready()
                automatic.optim_progress.optimizer.step.increment_completed()
            # Callbacks read a batch's outputs (SpikeDetection its "loss"): a no-op slot shows the rank's last real
            # step's, as if that step were repeated, rather than a dict without the keys every real step has.
            return self._last_outputs

        def manual_run(kwargs: Any) -> Any:
            progress = manual.optim_step_progress
            if self._slot_is_real():
                before = progress.total.completed
                self._last_outputs = run_manual(kwargs)
                self._manual_steps_per_batch = progress.total.completed - before
                return self._last_outputs
            for _ in range(self._manual_steps_per_batch):  # keep global_step equal on every rank
                progress.increment_ready()
                progress.increment_completed()
            return self._last_outputs

        connector = trainer._logger_connector
        log_step = connector.update_train_step_metrics

        def update_train_step_metrics() -> None:
            if self._slot_is_real():  # a no-op slot logged nothing new: do not re-log the last real step's values
                log_step()

        self._patch(automatic, "run", automatic_run)
        self._patch(manual, "run", manual_run)
        self._patch(connector, "update_train_step_metrics", update_train_step_metrics)

    def start_epoch(self) -> None:
        self._pending_accumulation = False

    # ------------------------------------------------------------------ reads and writes of private state

    def size_epoch(self, trainer: Trainer, batches: int, mid_epoch: bool = False) -> None:
        """Tell Lightning the epoch has ``batches`` batches (a fractional ``limit_train_batches`` is already in the
        plan: the session plans the units ddp would train under it; an int one caps the batches, as Lightning counts
        them on every rank); ``mid_epoch``: re-sized
        at a batch's end, before that batch's validation check, and the rest of the epoch still runs the validations
        it owed (see :meth:`pace_validation`)."""
        loop = trainer.fit_loop
        done = loop.epoch_loop.batch_idx if mid_epoch else 0
        due = self._validations_due(trainer, done) if mid_epoch else None
        limit = trainer.limit_train_batches
        loop.max_batches = min(batches, limit) if isinstance(limit, int) else batches if limit else 0
        self._validation_points = None
        self._epoch_sized = True
        if isinstance(trainer.val_check_interval, float):
            trainer.val_check_batch = max(1, int(trainer.num_training_batches * trainer.val_check_interval))
            if due is not None and isinstance(trainer.num_training_batches, int):
                points = validations_after_resize(done, trainer.num_training_batches, due)
                self._validation_points = frozenset(points)
        try:
            bar = trainer.progress_bar_callback.train_progress_bar  # type: ignore[union-attr]
        except (AttributeError, TypeError):  # no bar, not tqdm, or not created yet
            bar = None
        if bar is not None and getattr(bar, "total", None) is not None:
            bar.total = trainer.num_training_batches  # tqdm: the epoch got shorter once speeds were known

    def _validations_due(self, trainer: Trainer, done: int) -> int | None:
        """How many validations the epoch holds after its first ``done`` batches; ``None`` for no batch count."""
        if self._validation_points is not None:
            return sum(point > done for point in self._validation_points)
        batches, check = trainer.num_training_batches, trainer.val_check_batch
        if trainer.check_val_every_n_epoch is None or not isinstance(batches, int) or not isinstance(check, int):
            return None
        return batches // check - done // check

    def validation_slots(self, trainer: Trainer, batches_per_slot: int) -> Callable[[int], tuple[int, ...]] | None:
        """Where Lightning validates in the current epoch, as a function of the epoch's slots: the slot counts after
        which it does, the epoch's end left out (``(batch_idx + 1) % val_check_batch == 0``, or the points planned
        after a mid-epoch re-size). The round plan ends rounds there (``EpochPlan.boundaries``). ``None`` when the
        epoch does not validate by a count of its own batches (a time interval, a count over the whole fit, an int
        ``limit_train_batches``, no validation this epoch)."""
        every, interval = trainer.check_val_every_n_epoch, trainer.val_check_interval
        if (
            every is None
            or (trainer.current_epoch + 1) % every != 0
            or not trainer.enable_validation
            or isinstance(trainer.limit_train_batches, int)  # the epoch is cut at a batch count, not at its plan's end
            or getattr(trainer, "_val_check_time_interval", None) is not None
            or isinstance(interval, bool)
            or not isinstance(interval, (int, float))
        ):
            return None

        def slots_of(batches: Iterable[int], slots: int) -> tuple[int, ...]:
            return tuple(sorted({-(-b // batches_per_slot) for b in batches} & set(range(1, slots))))

        def points(slots: int) -> tuple[int, ...]:
            batches = slots * batches_per_slot
            if isinstance(interval, float) and self._epoch_sized and batches != trainer.num_training_batches:
                # a re-plan re-sizes the running epoch: where size_epoch(mid_epoch=True) will have it validate
                done = trainer.fit_loop.epoch_loop.batch_idx
                due = self._validations_due(trainer, done)
                if due is not None:
                    return slots_of(validations_after_resize(done, batches, due), slots)
            if self._validation_points is not None:
                return slots_of(self._validation_points, slots)
            check = max(1, int(batches * interval)) if isinstance(interval, float) else int(interval)
            return slots_of(range(check, batches + 1, check), slots)

        # Called as the epoch is planned, before Lightning is told its length: the points the last epoch was re-sized
        # to are not this epoch's (size_epoch clears them too, but only after the plan has asked).
        self._epoch_sized = False
        self._validation_points = None
        return points

    def pace_validation(self, trainer: Trainer, batch_idx: int) -> None:
        """At a batch's end, before Lightning's validation check: after a mid-epoch re-size, validate at exactly the
        planned batches. Lightning validates where ``(batch_idx + 1) % val_check_batch == 0``."""
        points = self._validation_points
        if points is not None:
            trainer.val_check_batch = batch_idx + 1 if batch_idx + 1 in points else trainer.num_training_batches + 1

    @staticmethod
    def resume_position(trainer: Trainer) -> int | None:
        """The batch a resumed fit continues its epoch from, or ``None`` when the fit starts afresh."""
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return progress.ready if trainer.fit_loop.restarting or progress.ready > 0 else None

    @staticmethod
    def mark_sigterm(trainer: Trainer) -> None:
        """Some rank received SIGTERM: Lightning raises ``SIGTERMException`` on every rank at this batch."""
        trainer._signal_connector.received_sigterm = True

    @staticmethod
    def checkpoint_due(trainer: Trainer) -> bool:
        """Whether a ``ModelCheckpoint`` saves by ``every_n_train_steps`` at this batch's end (Lightning's own test,
        the same on every rank: the global step is)."""
        for callback in trainer.checkpoint_callbacks:
            every = getattr(callback, "_every_n_train_steps", 0)
            if isinstance(callback, ModelCheckpoint) and every >= 1 and trainer.global_step % every == 0:
                if not callback._should_skip_saving_checkpoint(trainer):
                    return True
        return False

    @staticmethod
    def time_interval_checkpoints(trainer: Trainer) -> list[ModelCheckpoint]:
        """``ModelCheckpoint(train_time_interval=...)`` callbacks: they broadcast their decision at every batch."""
        return [
            cb
            for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and cb._train_time_interval is not None
        ]

    @staticmethod
    def lift_batch_limit(trainer: Trainer) -> None:
        """Let the epoch iterate the load-balanced loader to its end: Lightning caps the combined loader at
        ``limit_train_batches`` of its length, an upper bound under oscars; the plan holds the limit instead."""
        combined = trainer.fit_loop._combined_loader
        if combined is None or combined.limits is None:
            return
        combined.limits = None
        if combined._iterator is not None:  # the first epoch's iterator is made before any hook runs
            combined._iterator.limits = None
            fetcher = trainer.fit_loop._data_fetcher
            if fetcher is not None and fetcher.length is not None:  # it says "last batch" at the capped length
                fetcher.length = len(combined)

    @staticmethod
    def training_loader_count(trainer: Trainer) -> int:
        """How many DataLoaders the fit trains on (Lightning's ``CombinedLoader`` of ``train_dataloader``)."""
        combined = trainer.fit_loop._combined_loader
        return 0 if combined is None else len(combined.flattened)

    @staticmethod
    def epoch_results(trainer: Trainer) -> Any:
        return trainer._results

    @staticmethod
    def training_results(trainer: Trainer) -> Any:
        """The training loop's logged values (``trainer._results`` is the validation loop's during validation)."""
        return trainer.fit_loop.epoch_loop._results

    @staticmethod
    def callback_metric_store(trainer: Trainer) -> dict[str, Any]:
        """Lightning's store behind ``trainer.callback_metrics``: it keeps the last step values between epochs."""
        return trainer._logger_connector._callback_metrics

    @staticmethod
    def trainer_of(module: LightningModule | None) -> Trainer | None:
        # After a spawn-launched fit the main process holds a module no longer attached to a Trainer, and
        # LightningModule.trainer raises then.
        return None if module is None else module._trainer

    @staticmethod
    def accumulation_at(trainer: Trainer, epoch: int) -> int:
        """``accumulate_grad_batches`` in force during ``epoch``: a GradientAccumulationScheduler sets it only in its
        own ``on_train_epoch_start``, after oscars sized the epoch, so ask the scheduler."""
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, GradientAccumulationScheduler):
                return int(callback.get_accumulate_grad_batches(epoch))
        return int(trainer.accumulate_grad_batches)

    @staticmethod
    def averaged_copies(trainer: Trainer) -> list[torch.nn.Module]:
        """Averaged copies of the model that callbacks update from each rank's weights (``WeightAveraging``, EMA).
        Averaged with the model each round they stay equal on every rank: the update is linear and runs at the
        same global steps everywhere."""
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        return [cb._average_model for cb in callbacks if isinstance(cb, WeightAveraging) and cb._average_model]

    @staticmethod
    def unsupported(trainer: Trainer, module: LightningModule) -> str | None:
        """Why this fit cannot run under oscars, or ``None``."""
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            return (
                "A time-based val_check_interval is decided on each rank's own clock; under oscars use an int or"
                " float val_check_interval, or strategy='ddp'."
            )
        if trainer.overfit_batches > 0:  # type: ignore[attr-defined]
            return "overfit_batches is not supported by strategy='oscars'; use strategy='ddp'"
        if isinstance(trainer.fit_loop._data_fetcher, _DataLoaderIterDataFetcher) or (
            "dataloader_iter" in inspect.signature(module.training_step).parameters
        ):
            return "training_step(dataloader_iter) is not supported by strategy='oscars'"
        return None

    @staticmethod
    def sync_batchnorm_problem(strategy: Any) -> str | None:
        """Why the fit cannot run if the Trainer asked for ``sync_batchnorm`` (its connector hands the strategy a
        layer sync), else ``None``."""
        if getattr(strategy, "_layer_sync", None) is None:
            return None
        return (
            "sync_batchnorm=True all-reduces inside every forward pass, which oscars' local steps cannot allow;"
            " BatchNorm statistics are averaged at every round instead. Remove sync_batchnorm, or use strategy='ddp'."
        )

    @staticmethod
    def collective_timeout_s(strategy: Any, default: float) -> float:
        """The collective timeout a ``DDPStrategy`` was built with (its private ``_timeout``), in seconds."""
        timeout = getattr(strategy, "_timeout", None)
        return timeout.total_seconds() if timeout is not None else default

    @staticmethod
    def full_checkpoint(trainer: Trainer) -> dict[str, Any]:
        """Everything ``trainer.save_checkpoint`` would write (model, optimizers, loops, callbacks), as a dict, on this
        rank alone: no barrier, no write, nothing rank 0 must do (a survivor of a failed round saves it)."""
        return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)

    @staticmethod
    def rng_states() -> dict[str, Any]:
        """This process's random generators (torch, CUDA, NumPy, Python), as Lightning collects them, with NumPy's
        key array as a tensor: a restore loads checkpoints with ``weights_only``, which refuses NumPy arrays."""
        states = _collect_rng_states()
        if "numpy" in states:
            name, key, *rest = states["numpy"]
            states["numpy"] = (name, torch.from_numpy(key.astype("int64")), *rest)
        return states

    @staticmethod
    def restore_rng_states(states: dict[str, Any]) -> None:
        if "numpy" in states:
            name, key, *rest = states["numpy"]
            states = {**states, "numpy": (name, key.numpy().astype("uint32"), *rest)}
        _set_rng_states(states)

    @staticmethod
    def resume_from_unless_given(trainer: Trainer, path: str, given_before: float) -> None:
        """Make this fit's restore load ``path`` when it was given no checkpoint, or one written before the time
        ``given_before``. Lightning picks the checkpoint before the strategy's setup, with no hook to change it; the
        connector's ``resume_start`` is replaced on the instance for one call."""
        connector = trainer._checkpoint_connector
        original = connector.resume_start

        def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            del connector.resume_start  # one call: the class's own method is back
            given = checkpoint_path is not None and os.path.isfile(checkpoint_path)
            if checkpoint_path is None or (given and os.path.getmtime(checkpoint_path) < given_before):
                checkpoint_path = path
            original(checkpoint_path, weights_only=weights_only)

        connector.resume_start = resume_start  # type: ignore[method-assign]

    @staticmethod
    def sync_module_states(module: torch.nn.Module) -> None:
        """Start every rank from rank 0's parameters and buffers (what the DDP wrapper would do)."""
        _sync_module_states(module)


def unwrap_sampler(sampler: object) -> object:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (or ``sampler`` itself)."""
    if isinstance(sampler, DistributedSamplerWrapper):
        return sampler.dataset._sampler  # type: ignore[attr-defined]
    return sampler


def _skip(*args: Any, **kwargs: Any) -> None:
    return None
