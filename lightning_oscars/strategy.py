"""``OscarsStrategy``: load-balanced local SGD as a Lightning ``DDPStrategy``.

How a run proceeds (every rank, in lockstep on Lightning's batch counter):

* Each epoch is cut into *rounds* (see ``partition.py``). In a round every rank iterates the same slots; rank
  ``i`` trains in its first ``tau_i`` slots and treats the rest as no-ops: no data is fetched, no forward,
  backward or optimizer step runs, but Lightning's counters, step-interval LR schedulers and hooks advance as
  on every other rank. So ``global_step``, ``max_steps``, ``val_check_interval`` and checkpoint triggers fire
  at the same batch on all ranks, which is what keeps every collective matched.
* At the end of a round the ranks average parameters and buffers with one all-reduce over a flat buffer.
  The same buffer carries each rank's step time, sample count, stop and SIGTERM requests and expired
  ``max_time``; every rank then runs the same solver on the same numbers and adopts the same schedule.
* Averaging also happens before validation, before a checkpoint is written, at the end of every epoch and
  of ``fit``, so that evaluation and checkpoints see the averaged model.
* Lightning's per-batch collectives (SIGTERM broadcast, ``Timer`` broadcast, ``sync_dist`` inside
  ``training_step``) are replaced by their round-boundary equivalents.
"""

from __future__ import annotations

import atexit
import logging
import math
import signal
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import (
    Checkpoint,
    GradientAccumulationScheduler,
    ThroughputMonitor,
    Timer,
    WeightAveraging,
)
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_oscars.averaging import FlatAverager, agree_on_layout, averaged_tensors, optimizer_state_layout
from lightning_oscars.epoch_metrics import align_epoch_metrics
from lightning_oscars.faults import FailureBoard, describe_collective_failure
from lightning_oscars.loader import EpochOrder, LoadBalancedLoader, SlotInfo, empty_batch, training_set_size
from lightning_oscars.monitor import ScheduleMonitor
from lightning_oscars.partition import EpochPlan, Round, max_epoch_slots, planned_slots
from lightning_oscars.solver import (
    Schedule,
    rebalance,
    schedule_from_local_steps,
    snap_step_times,
    solve_schedule,
    solve_schedule_alg1,
    validate_step_times,
)
from lightning_oscars.timing import LapClock, StepTimeEstimator, make_clock

__all__ = ["OscarsStrategy", "RoundRecord"]

log = logging.getLogger(__name__)

Solver = Literal["exact", "alg1", "uniform"]
Averaging = Literal["uniform", "samples"]

# Per-rank fields of the control vector, then the global ones after all ranks' fields.
_STEP_TIME, _SAMPLES, _COMPUTE, _ALLREDUCE, _GLOBAL_STEP = range(5)
_PER_RANK = 5
_WEIGHT, _STOP, _SIGTERM, _REQUEUE = range(4)
_GLOBAL = 4
# Ranks whose measured step times differ by less than this are treated as equally fast (noise, not speed).
_SNAP_TOLERANCE = 0.05
# Collective timeout: well under NCCL's 30 minutes, yet long enough for a large checkpoint write.
DEFAULT_TIMEOUT = timedelta(minutes=10)


class RoundRecord(dict):
    """One averaging: ``round``, ``time`` (seconds since training started), ``epoch``, ``global_step``,
    ``local_steps``, ``step_times``, ``samples``, ``compute_times``, ``idle_times``, ``utilization``,
    ``allreduce_time``, ``period`` and ``rebalanced``."""


class OscarsStrategy(DDPStrategy):
    """Load-balanced local SGD for clusters whose ranks run at different speeds (the Oscars method).

    Args:
        solver: ``"exact"`` (communication-aware, exact; default), ``"alg1"`` (the paper's Algorithm 1) or
            ``"uniform"`` (fixed-period local SGD: every rank takes ``max_local_steps`` steps per round).
        averaging: ``"uniform"`` (the paper's Eq. 4: plain mean) or ``"samples"`` (weighted by the samples
            each rank trained on in the round).
        average_optimizer_state: also average the optimizers' per-parameter state (momentum, Adam moments);
            by default it stays local.
        max_spread: ``M``: the local steps of the fastest and slowest rank differ by less than this.
        max_local_steps: no rank takes more than this many local steps per round.
        efficiency_tolerance: the exact solver picks the shortest round whose predicted throughput is within
            this fraction of the best.
        warmup_steps: local steps every rank takes in the first round, which is spent measuring step times;
            shortened to ``max_steps`` when the run is shorter (``fast_dev_run`` included).
        rebalance_threshold: re-solve when a rank's smoothed step time moved by more than this fraction from
            the times the schedule was solved for.
        min_gain: adopt a re-solved schedule only if it is predicted to be this fraction faster (hysteresis).
        smoothing: weight of the newest round in the step-time moving average.
        step_times: pin every rank's seconds per step (no profiling, one solve, reproducible).
        local_steps: pin every rank's local steps per round (no profiling, no solving).
        seed: seed of the per-epoch shuffle of the training data; by default the seed of the sampler Lightning
            injects, which follows ``seed_everything`` (``PL_GLOBAL_SEED``), else 0.
        monitor: add a :class:`~lightning_oscars.ScheduleMonitor` (per-round metrics to the loggers, ``tau`` in
            the progress bar, a summary at the end of fit) unless the trainer already has one.
        timeout: collective timeout (default 10 minutes): a hung rank is reported after at most this long; a
            rank that dies or raises is reported at once. Raise it if saving a checkpoint can take longer.
        start_method: how Lightning starts the ranks (as for ``ddp``): ``"popen"`` re-runs the script.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; by default NCCL on CUDA, gloo otherwise.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer (torchrun, SLURM, ... are detected).
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.

    Options of the ``DistributedDataParallel`` wrapper (``find_unused_parameters``, ``static_graph``,
    ``bucket_cap_mb``, ...) are accepted so that a ddp call site keeps working, and ignored with a warning:
    oscars does not wrap the model. DDP gradient hooks (``ddp_comm_hook`` and friends) are an error.
    """

    strategy_name = "oscars"

    def __init__(
        self,
        solver: Solver = "exact",
        averaging: Averaging = "uniform",
        average_optimizer_state: bool = False,
        max_spread: int = 8,
        max_local_steps: int = 16,
        efficiency_tolerance: float = 0.05,
        warmup_steps: int = 4,
        rebalance_threshold: float = 0.2,
        min_gain: float = 0.03,
        smoothing: float = 0.5,
        step_times: Sequence[float] | None = None,
        local_steps: Sequence[int] | None = None,
        seed: int | None = None,
        monitor: bool = True,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **ddp_wrapper_kwargs: Any,
    ) -> None:
        # Not forwarded to DDPStrategy: they configure a wrapper oscars does not use, and forwarding would make
        # LightningCLI list every DistributedDataParallel argument among this strategy's options.
        _check_ddp_wrapper_options(ddp_wrapper_kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            timeout=timeout,
            start_method=start_method,
            process_group_backend=process_group_backend,
        )
        if solver not in ("exact", "alg1", "uniform"):
            raise ValueError(f"solver must be 'exact', 'alg1' or 'uniform', got {solver!r}")
        if averaging not in ("uniform", "samples"):
            raise ValueError(f"averaging must be 'uniform' or 'samples', got {averaging!r}")
        for name, value in (("max_spread", max_spread), ("max_local_steps", max_local_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= 1, got {warmup_steps!r}")
        for name, number, upper in (
            ("efficiency_tolerance", efficiency_tolerance, 1.0),
            ("rebalance_threshold", rebalance_threshold, math.inf),
            ("min_gain", min_gain, math.inf),
        ):
            if not isinstance(number, (int, float)) or not (0.0 <= number < upper):
                raise ValueError(f"{name} must be a number in [0, {upper}), got {number!r}")
        if not isinstance(smoothing, (int, float)) or not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {smoothing!r}")
        if step_times is not None and local_steps is not None:
            raise ValueError("pin either step_times or local_steps, not both")
        self.pinned_step_times = validate_step_times(step_times) if step_times is not None else None
        self.pinned_local_steps = (
            schedule_from_local_steps(local_steps).local_steps if local_steps is not None else None
        )
        self.solver = solver
        self.averaging = averaging
        self.average_optimizer_state = bool(average_optimizer_state)
        self.max_spread = max_spread
        self.max_local_steps = max_local_steps
        self.efficiency_tolerance = float(efficiency_tolerance)
        self.warmup_steps = warmup_steps
        self.rebalance_threshold = float(rebalance_threshold)
        self.min_gain = float(min_gain)
        self.smoothing = float(smoothing)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        self.seed = seed
        self.monitor = bool(monitor)

        self.schedule: Schedule | None = None
        self.history: list[RoundRecord] = []
        self.num_averagings = 0
        self._reset_run_state()

    # ------------------------------------------------------------------ state

    def _reset_run_state(self) -> None:
        self._estimator = StepTimeEstimator(self.smoothing)
        self._warmup_steps = self.warmup_steps
        self._clock: LapClock | None = None
        self._averager: FlatAverager | None = None
        self._loader: LoadBalancedLoader | None = None
        self._plan: EpochPlan | None = None
        self._plan_epoch = -1
        self._plan_is_upper_bound = False
        self._replan_pending = False
        self._fit_started = time.perf_counter()
        self._slot = SlotInfo(True, 0)
        self._in_local_step = False
        self._slots_since_average = 0
        self._round_samples = 0
        self._slot_laps: list[tuple[int, float]] = []
        self._noop_batch: Any = None
        self._pending_accumulation = False
        self._last_allreduce = 0.0
        self._allreduce_cost = 0.0
        self._known_times: list[float] = []
        self._pending_stop = False
        self._local_sigterm = False
        self._local_requeue = False
        self._requeue_handler: tuple[int, Any] | None = None
        self._patches: list[tuple[object, str, bool, Any]] = getattr(self, "_patches", [])
        self._timers: list[Timer] = []
        self._manual_steps_per_batch = 0
        self._failed = False  # this rank raised or its all-reduce broke: skip every further collective
        self._restored: dict[str, Any] | None = getattr(self, "_restored", None)

    @property
    def _module(self) -> LightningModule:
        module = self.lightning_module
        assert module is not None, "the strategy is not connected to a LightningModule yet"
        return module

    @property
    def is_active(self) -> bool:
        """Local SGD is on: fitting with more than one rank."""
        return self.world_size > 1

    @property
    def slot_is_real(self) -> bool:
        """Whether the batch in progress is a real local step of this rank (``False`` on a no-op slot, where hooks
        see an empty batch and ``outputs == {}``; see the README's "No-op slots")."""
        return self._slot.real

    def _current_local_steps(self) -> tuple[int, ...]:
        if self.schedule is not None:
            return self.schedule.local_steps
        return (self._warmup_steps,) * self.world_size

    def _initial_schedule(self) -> Schedule | None:
        n = self.world_size
        if self.pinned_local_steps is not None:
            if len(self.pinned_local_steps) != n:
                raise ValueError(f"local_steps has {len(self.pinned_local_steps)} entries for {n} ranks")
            return schedule_from_local_steps(self.pinned_local_steps)
        if self.solver == "uniform":
            return schedule_from_local_steps((self.max_local_steps,) * n)
        if self.pinned_step_times is not None:
            if len(self.pinned_step_times) != n:
                raise ValueError(f"step_times has {len(self.pinned_step_times)} entries for {n} ranks")
            return self._solve(self.pinned_step_times, 0.0)
        return None

    @property
    def _adaptive(self) -> bool:
        return self.pinned_local_steps is None and self.pinned_step_times is None and self.solver != "uniform"

    def _solve(self, step_times: Sequence[float], allreduce_time: float) -> Schedule:
        if self.solver == "alg1":  # the paper's algorithm, as published: raw times
            solved = solve_schedule_alg1(step_times, self.max_spread, max_local_steps=self.max_local_steps)
            return Schedule(solved.local_steps, solved.step_times, allreduce_time)
        return solve_schedule(
            snap_step_times(step_times, _SNAP_TOLERANCE),
            allreduce_time,
            max_spread=self.max_spread,
            max_local_steps=self.max_local_steps,
            tolerance=self.efficiency_tolerance,
        )

    # ------------------------------------------------------------------ Lightning hooks

    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: no gradient all-reduce per step. Start from rank 0's weights.
        assert self.model is not None
        _sync_module_states(self.model)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        _destroy_gloo_group_at_exit()

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING or not self.is_active:
            return
        if self._layer_sync is not None:
            raise ValueError(
                "sync_batchnorm=True all-reduces inside every forward pass, which oscars' local steps cannot"
                " allow; BatchNorm statistics are averaged at every round instead. Remove sync_batchnorm, or"
                " use strategy='ddp'."
            )
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            raise ValueError(
                "A time-based val_check_interval is decided on each rank's own clock; under oscars use an int"
                " or float val_check_interval, or strategy='ddp'."
            )
        if trainer.overfit_batches > 0:  # type: ignore[attr-defined]
            raise ValueError("overfit_batches is not supported by strategy='oscars'; use strategy='ddp'")
        # A run shorter than the warm-up (fast_dev_run, a smoke test with max_steps=2) measures what it can.
        self._warmup_steps = self.warmup_steps
        if trainer.max_steps not in (-1, None) and 0 < trainer.max_steps < self.warmup_steps:
            self._warmup_steps = trainer.max_steps
        self.schedule = self._initial_schedule()
        self._clock = make_clock(self.root_device)
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, _RoundCallback) for cb in callbacks):
            # Epoch sizing runs first (the progress bar reads the epoch length); the round logic runs after the
            # user's callbacks (their time counts as step time) but before checkpointing (which must see the
            # averaged model).
            callbacks.insert(0, _EpochCallback(self))
            position = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
            callbacks.insert(position, _RoundCallback(self))
            if self.monitor and not any(isinstance(cb, ScheduleMonitor) for cb in callbacks):
                callbacks.insert(position + 1, ScheduleMonitor())

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (
            trainer is None
            or not self.is_active
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.state.stage != RunningStage.TRAINING
        ):
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise ValueError(
                f"strategy='oscars' needs a torch DataLoader for training, got {type(dataloader).__name__}"
            )
        if isinstance(trainer.fit_loop._data_fetcher, _DataLoaderIterDataFetcher) or _takes_dataloader_iter(
            self._module
        ):
            raise ValueError("training_step(dataloader_iter) is not supported by strategy='oscars'")
        size = training_set_size(dataloader)
        loader = LoadBalancedLoader(
            dataloader,
            rank=self.global_rank,
            world_size=self.world_size,
            batches_per_slot=_accumulation_at(trainer, trainer.current_epoch),
            order=EpochOrder.of(dataloader.sampler, size, self.seed),
        )
        loader.max_slots = self._max_epoch_slots(loader.total_units)
        self._loader = loader
        self._plan_epoch = -1
        return loader

    def _max_epoch_slots(self, total_units: int) -> int:
        """The loader's length in slots: what Lightning reports as the epoch length (and so in
        ``estimated_stepping_batches``) before the speeds are known, and the first epoch's initial size."""
        if not self._adaptive:  # pinned or fixed-period: every epoch's length is known
            fixed = self._initial_schedule()
            assert fixed is not None
            return planned_slots(fixed.local_steps, total_units)
        most = min(self.max_spread, self.max_local_steps)
        return max_epoch_slots(total_units, self.world_size, most, last_round=max(most, self._warmup_steps))

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        loader = self._loader
        if loader is None or not loader.slot_infos or not self._module.trainer.training:
            return super().batch_to_device(batch, device, dataloader_idx)
        self._slot = loader.slot_infos.popleft()
        if not self._slot.real:
            # A no-op slot: the empty batch of the last real one, already on the device (no transfer, no
            # transfer hooks). Only a resume into a no-op slot moves its (empty) batch once.
            if self._noop_batch is None:
                self._noop_batch = empty_batch(super().batch_to_device(batch, device, dataloader_idx))
            return self._noop_batch
        assert self._clock is not None
        # A real step's clock starts here and stops at the end of its on_train_batch_end hooks (before checkpoint
        # callbacks); its data loading is added from the loader's own measurement. What Lightning does between
        # steps (logging, validation, checkpoint writes) is never timed.
        self._clock.mark()
        moved = super().batch_to_device(batch, device, dataloader_idx)
        self._noop_batch = empty_batch(moved)
        return moved

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_local_step = self.is_active
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._in_local_step = False

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self._in_local_step or self._failed:
            # self.log(..., sync_dist=True) inside a local step: ranks run different numbers of steps, so the
            # value stays rank-local here; epoch-level aggregates are reduced at the epoch end as usual.
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        self._forbid_collective("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def barrier(self, name: str | None = None) -> None:
        self._forbid_collective("barrier")
        if self._failed:  # the peers are gone or will not come: a barrier would wait for the timeout
            return
        super().barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._forbid_collective("broadcast")
        if self._failed:
            return obj
        return super().broadcast(obj, src)

    def on_failure(self, error: BaseException) -> None:
        """This rank's run is ending with ``error``: tell the others who failed, and stop meeting them."""
        if self._failed or not self.is_active or isinstance(error, SIGTERMException):
            return  # SIGTERM is a coordinated stop (all ranks, same batch): collectives stay matched
        self._failed = True
        board = FailureBoard.from_default_group(self.world_size)
        if board is not None:
            board.report_error(self.global_rank, error)

    def _forbid_collective(self, name: str) -> None:
        if self._in_local_step:
            raise RuntimeError(
                f"{name} was called inside training_step, which under strategy='oscars' runs a different number"
                " of times on every rank, so the collective could never be matched. Move it to an epoch or"
                " validation hook, or use strategy='ddp'."
            )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Called by trainer.save_checkpoint on every rank: checkpoints hold the averaged model.
        self.average_if_pending()
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        trainer = self._trainer_or_none()
        if self.is_active and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            checkpoint["oscars"] = self.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored = checkpoint.get("oscars")
        return checkpoint

    def teardown(self) -> None:
        self._remove_patches()
        self._loader = None
        self._noop_batch = None
        self._averager = None
        super().teardown()

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """Schedule, timing estimates and the epoch's plan, as stored in checkpoints under ``"oscars"``."""
        plan = self._plan
        return {
            "world_size": self.world_size,
            "local_steps": list(self.schedule.local_steps) if self.schedule else None,
            "step_times": list(self.schedule.step_times) if self.schedule else None,
            "allreduce_time": self._allreduce_cost,
            "known_times": list(self._known_times),
            "estimate": self._estimator.value,
            "num_averagings": self.num_averagings,
            "plan_epoch": self._plan_epoch,
            "plan": None
            if plan is None
            else {
                "total_units": plan.total_units,
                "total_slots": plan.total_slots,
                "rounds": [[r.start_slot, r.length, list(r.quotas), r.first_unit] for r in plan.rounds],
            },
        }

    def _apply_restored_state(self) -> None:
        state, self._restored = self._restored, None
        if not state or state.get("world_size") != self.world_size:
            return  # fresh profiling: a different cluster shape invalidates per-rank timings
        self.num_averagings = int(state.get("num_averagings", 0))
        self._allreduce_cost = float(state.get("allreduce_time") or 0.0)
        if self._adaptive and state.get("local_steps"):
            self.schedule = Schedule(tuple(state["local_steps"]), tuple(state["step_times"]), self._allreduce_cost)
            self._known_times = list(state.get("known_times") or [])
            # The checkpoint is written by rank 0; every rank's own agreed estimate rides in known_times.
            if len(self._known_times) == self.world_size and self._known_times[self.global_rank] > 0.0:
                self._estimator.value = float(self._known_times[self.global_rank])
        plan = state.get("plan")
        if plan is not None and self._loader is not None and plan["total_units"] == self._loader.total_units:
            restored = EpochPlan(self.world_size, plan["total_units"], plan["total_slots"], (1,) * self.world_size)
            restored._rounds = [Round(s, n, tuple(q), u) for s, n, q, u in plan["rounds"]]
            restored._starts = [r.start_slot for r in restored._rounds]
            self._plan = restored
            self._plan_epoch = int(state["plan_epoch"])
            # A plan checkpointed under a looser bound (an older release) must still fit in the loader.
            self._loader.max_slots = max(self._loader.max_slots, restored.total_slots)

    # ------------------------------------------------------------------ round logic (called by _RoundCallback)

    def on_fit_train_start(self, trainer: Trainer) -> None:
        self._fit_started = time.perf_counter()
        self._neutralise_per_batch_collectives(trainer)
        self._install_noop_slots(trainer)
        self._apply_restored_state()
        loop = trainer.fit_loop.epoch_loop
        if trainer.fit_loop.restarting or loop.batch_progress.current.ready > 0:
            # Resuming mid-epoch: continue the checkpointed epoch's plan from the restored batch.
            self.start_epoch(trainer, resume_at=loop.batch_progress.current.ready)

    def start_epoch(self, trainer: Trainer, resume_at: int = 0) -> None:
        loader = self._loader
        if loader is None:
            return
        epoch = trainer.current_epoch
        accumulation = _accumulation_at(trainer, epoch)
        if accumulation != loader.batches_per_slot:
            # A GradientAccumulationScheduler changed the slot size: units, bounds and the plan follow.
            loader.set_batches_per_slot(accumulation)
            loader.max_slots = self._max_epoch_slots(loader.total_units)
            self._plan = None
        if self._plan is None or self._plan_epoch != epoch or self._plan.total_units != loader.total_units:
            steps = self._current_local_steps()
            if self.schedule is None:
                total_slots = loader.max_slots  # speeds unknown: an upper bound; spare slots are no-ops
            else:
                # Never beyond the loader's length (its iterator ends there); a plan short of slots raises quotas.
                total_slots = min(planned_slots(steps, loader.total_units), loader.max_slots)
            self._plan = EpochPlan(self.world_size, loader.total_units, total_slots, steps)
            self._plan_epoch = epoch
            self._plan_is_upper_bound = self.schedule is None
        order = None
        if loader.order.shared:
            # A custom sampler's draw depends on its random state, which differs between ranks: rank 0 draws the
            # epoch and every rank partitions that same draw (one collective per epoch, at its start, on all ranks).
            order = self.broadcast(loader.order.draw(epoch) if self.global_rank == 0 else None, src=0)
        loader.start_epoch(self._plan, epoch, order, start_position=resume_at)
        self._replan_pending = False
        self._size_epoch(trainer)
        self._slots_since_average = 0
        self._round_samples = 0
        self._pending_accumulation = False
        if self._clock is not None:
            self._clock.drain()
        self._slot_laps = []

    def _size_epoch(self, trainer: Trainer) -> None:
        """Tell Lightning how many batches this epoch has: the plan's slots (times accumulation), limited."""
        assert self._plan is not None
        assert self._loader is not None
        batches = self._plan.total_slots * self._loader.batches_per_slot
        trainer.fit_loop.max_batches = int(
            _parse_num_batches(RunningStage.TRAINING, batches, trainer.limit_train_batches)
        )
        if isinstance(trainer.val_check_interval, float):
            trainer.val_check_batch = max(1, int(trainer.num_training_batches * trainer.val_check_interval))
        try:
            bar = trainer.progress_bar_callback.train_progress_bar  # type: ignore[union-attr]
        except (AttributeError, TypeError):  # no bar, not tqdm, or not created yet
            bar = None
        if bar is not None and getattr(bar, "total", None) is not None:
            bar.total = trainer.num_training_batches  # tqdm: the epoch got shorter once speeds were known

    def end_batch(self, trainer: Trainer, batch_idx: int) -> None:
        plan = self._plan
        if plan is None:
            return
        if trainer.should_stop:  # a rank-local stop request waits for the round boundary
            self._pending_stop = True
            trainer.should_stop = False
        assert self._loader is not None
        k = self._loader.batches_per_slot
        slot = batch_idx // k
        if self._slot.real:
            assert self._clock is not None
            self._clock.lap()
            self._slot_laps.append((slot, self._slot.fetch_seconds or 0.0))
            self._round_samples += self._slot.samples
        slot_done = (batch_idx + 1) % k == 0 or batch_idx + 1 >= trainer.num_training_batches
        if not slot_done or slot >= plan.total_slots:
            return
        rnd = plan.round_at(slot)
        if not rnd.is_empty:
            self._slots_since_average += 1
            if slot + 1 == rnd.end_slot:
                self.average(trainer, next_round=rnd.end_slot)

    def align_epoch_metrics(self, trainer: Trainer) -> None:
        """Match the epoch-end ``sync_dist`` reductions across ranks (see ``epoch_metrics.py``): one small
        collective at every training epoch end, on every rank."""
        results = trainer._results
        if not self.is_active or self._failed or results is None:
            return

        def gather(keys: dict[str, dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
            everyone: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(everyone, keys)
            return everyone

        align_epoch_metrics(results, gather, self.reduce, self.root_device)

    def average_if_pending(self) -> None:
        """Average now if any rank trained since the last averaging (the same answer on every rank)."""
        if not self.is_active or self._slots_since_average == 0 or self._failed:
            return
        trainer = self._trainer_or_none()
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        self.average(trainer, next_round=None)

    def _trainer_or_none(self) -> Trainer | None:
        # After a spawn-launched fit the main process holds a module no longer attached to a Trainer, and
        # LightningModule.trainer raises then.
        module = self.lightning_module
        return None if module is None else module._trainer

    def average(self, trainer: Trainer, next_round: int | None) -> None:
        """The round's one collective: average the model, exchange control data, maybe re-balance."""
        assert self._clock is not None
        laps = self._clock.drain()  # on CUDA this waits for the rank's queued work: not part of the all-reduce
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)
        started = time.perf_counter()
        per_slot: dict[int, float] = {}
        for (slot, fetch), seconds in zip(self._slot_laps, laps):
            per_slot[slot] = per_slot.get(slot, 0.0) + seconds + fetch
        self._slot_laps = []
        for seconds in per_slot.values():
            self._estimator.add(seconds)
        compute = sum(per_slot.values())
        estimate = self._estimator.end_round()

        n, rank = self.world_size, self.global_rank
        control = [0.0] * (n * _PER_RANK + _GLOBAL)
        mine = rank * _PER_RANK
        control[mine + _STEP_TIME] = estimate or 0.0
        control[mine + _SAMPLES] = float(self._round_samples)
        control[mine + _COMPUTE] = compute
        control[mine + _ALLREDUCE] = self._last_allreduce
        control[mine + _GLOBAL_STEP] = float(trainer.global_step)
        weight = float(self._round_samples) if self.averaging == "samples" else 1.0
        g = n * _PER_RANK
        control[g + _WEIGHT] = weight
        control[g + _STOP] = float(self._pending_stop or self._timer_expired())
        control[g + _SIGTERM] = float(self._local_sigterm)
        control[g + _REQUEUE] = float(self._local_requeue)

        try:
            averager = self._get_averager()
            summed = averager.all_reduce(weight, control, weight_index=g + _WEIGHT)
        except Exception as error:  # a peer died, raised or hung past the timeout: name it, then stop
            self._failed = True
            board = FailureBoard.from_default_group(n)
            round_index = self.num_averagings + 1
            cause = f"{type(error).__name__}: {error}"
            message = (
                board.explain(rank, round_index, error)
                if board is not None
                else describe_collective_failure(rank, n, round_index, {}, [rank], cause)
            )
            raise RuntimeError(message) from error
        self._last_allreduce = time.perf_counter() - started
        self.num_averagings += 1

        fields = [summed[i * _PER_RANK : (i + 1) * _PER_RANK] for i in range(n)]
        steps = {int(round(f[_GLOBAL_STEP])) for f in fields}
        if len(steps) > 1:
            raise RuntimeError(
                f"Ranks disagree on global_step ({sorted(steps)}). Under manual optimization oscars needs every"
                " training_step to call optimizer.step() the same number of times."
            )
        if not self._known_times:
            self._known_times = [0.0] * n
        for i, f in enumerate(fields):
            if f[_STEP_TIME] > 0.0:
                self._known_times[i] = f[_STEP_TIME]
        costs = [f[_ALLREDUCE] for f in fields if f[_ALLREDUCE] > 0.0]
        if costs:
            # The last rank to arrive waits least: its duration is the closest to the pure transfer cost.
            self._allreduce_cost = min(costs)

        in_force = self._current_local_steps()
        rebalanced = self._update_schedule()
        record = RoundRecord(
            round=self.num_averagings,
            time=time.perf_counter() - self._fit_started,
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
            local_steps=list(in_force),
            step_times=list(self._known_times),
            samples=[int(f[_SAMPLES]) for f in fields],
            compute_times=[f[_COMPUTE] for f in fields],
            allreduce_time=self._allreduce_cost,
            rebalanced=rebalanced,
        )
        busiest = max(record["compute_times"])
        record["period"] = busiest
        record["idle_times"] = [busiest - c for c in record["compute_times"]]
        wall = busiest + self._allreduce_cost
        record["utilization"] = sum(record["compute_times"]) / (n * wall) if wall > 0 else 0.0
        self.history.append(record)

        # A schedule adopted at an extra averaging (before validation or a checkpoint) waits for the next
        # round boundary to re-plan the data.
        self._replan_pending = self._replan_pending or rebalanced
        plan = self._plan
        if self._replan_pending and next_round is not None and plan is not None and next_round < plan.total_slots:
            # The first epoch was sized as an upper bound while speeds were unknown: cut it to what is needed.
            plan.replan(next_round, self._current_local_steps(), shrink=self._plan_is_upper_bound)
            self._replan_pending = False
            if self._plan_is_upper_bound:
                self._plan_is_upper_bound = False
                self._size_epoch(trainer)
        if summed[g + _STOP] > 0.0:
            trainer.should_stop = True
        self._pending_stop = False
        if summed[g + _SIGTERM] > 0.0:
            trainer._signal_connector.received_sigterm = True
        self._slots_since_average = 0
        self._round_samples = 0
        if summed[g + _REQUEUE] > 0.0 and self._requeue_handler is not None:
            # A requeue signal (SLURM's SIGUSR1) reached some rank: run its handler now, on every rank at the same
            # batch, so the checkpoint it writes meets matched collectives.
            self._local_requeue = False
            signum, handler = self._requeue_handler
            handler(signum, None)

    def _get_averager(self) -> FlatAverager:
        """The averager over what this round averages: trainable parameters, buffers, averaged copies of the model
        kept by callbacks (EMA) and, if asked, the optimizer state every rank holds. Rebuilt when that set changes
        (a parameter gets its first state; LBFGS replaces its state tensors)."""
        extra = _averaged_copies(self._module.trainer)
        if self.average_optimizer_state:
            # Which parameters have optimizer state differs between ranks (a head some rank never used): only the
            # state every rank holds is averaged, so that all ranks pack buffers of one layout.
            mask = agree_on_layout(optimizer_state_layout(self.optimizers), self.root_device)
            tensors = averaged_tensors(self._module, self.optimizers, state_mask=mask, extra_modules=extra)
        else:
            tensors = averaged_tensors(self._module, extra_modules=extra)
        if self._averager is None or not self._averager.holds(tensors):
            self._averager = FlatAverager(tensors, self.world_size * _PER_RANK + _GLOBAL, self.root_device)
        return self._averager

    def _update_schedule(self) -> bool:
        """Re-solve from the agreed step times; return whether the local steps changed."""
        if not self._adaptive or not all(t > 0.0 for t in self._known_times):
            return False
        times = tuple(self._known_times)
        if self.schedule is None:
            self.schedule = self._solve(times, self._allreduce_cost)
            return True
        self.schedule, changed = rebalance(
            self.schedule, times, self._allreduce_cost, self._solve, self.rebalance_threshold, self.min_gain
        )
        return changed

    # ------------------------------------------------------------------ per-batch collectives

    def _neutralise_per_batch_collectives(self, trainer: Trainer) -> None:
        # Lightning broadcasts a SIGTERM flag on every batch; ranks here run the same batches but must not meet
        # per batch. SIGTERM is exchanged in the round's all-reduce instead.
        self._patch(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", lambda: None)
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        self._timers = [cb for cb in callbacks if isinstance(cb, Timer) and cb._interval == "step"]
        for timer in self._timers:
            self._patch(timer, "on_train_batch_end", _skip)
        for callback in callbacks:
            if isinstance(callback, ThroughputMonitor):
                # It measures this rank's throughput (and requires its sample count to grow at every batch): a no-op
                # slot trained nothing.
                self._patch(callback, "on_train_batch_end", self._on_real_slots_only(callback.on_train_batch_end))
        if _is_main_thread():
            previous = trainer._signal_connector._original_handlers.get(signal.SIGTERM)

            def on_sigterm(signum: int, frame: Any) -> None:
                if not self._local_sigterm and self.launcher is not None:
                    self.launcher.kill(signum)
                self._local_sigterm = True
                if callable(previous) and previous not in (signal.SIG_IGN, signal.SIG_DFL):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, on_sigterm)
            self._defer_requeue_signal(trainer)

    def _defer_requeue_signal(self, trainer: Trainer) -> None:
        """Run the requeue handler (Lightning's SLURM auto-requeue, or the user's) at a round boundary.

        Lightning's handler saves a checkpoint (collectives) right inside the signal handler, i.e. wherever each
        rank happens to be; with ranks at different local steps that would pair unrelated collectives.
        """
        environment = trainer._accelerator_connector.cluster_environment
        signum = signal.SIGUSR1
        if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
            signum = environment.requeue_signal
        handler = signal.getsignal(signum)
        if not callable(handler) or handler in (signal.SIG_IGN, signal.SIG_DFL):
            return
        self._requeue_handler = (signum, handler)

        def on_requeue(received: int, frame: Any) -> None:
            self._local_requeue = True

        signal.signal(signum, on_requeue)

    def _timer_expired(self) -> bool:
        for timer in self._timers:
            if timer._duration is not None and timer.time_elapsed(RunningStage.TRAINING) >= timer._duration:
                return True
        return False

    def _install_noop_slots(self, trainer: Trainer) -> None:
        """Make a no-op slot skip the optimization loop but advance its counters like a real step."""
        loop = trainer.fit_loop.epoch_loop
        automatic, manual = loop.automatic_optimization, loop.manual_optimization
        run_automatic, run_manual = automatic.run, manual.run

        def automatic_run(optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
            stepping = not loop._should_accumulate()
            if self._slot.real:
                self._pending_accumulation = not stepping
                return run_automatic(optimizer, batch_idx, kwargs)
            if stepping and self._pending_accumulation:
                # The slot's unit was partial (the epoch's last batches): its real batches ran first and their
                # gradients wait for this step, as ddp applies a partial unit at the epoch's last batch.
                self._pending_accumulation = False
                device = self.root_device
                automatic._optimizer_step(batch_idx, lambda: torch.zeros((), device=device))
            elif stepping:
                automatic.optim_progress.optimizer.step.increment_ready()
                automatic.optim_progress.optimizer.step.increment_completed()
            return {}

        def manual_run(kwargs: Any) -> Any:
            progress = manual.optim_step_progress
            if self._slot.real:
                before = progress.total.completed
                output = run_manual(kwargs)
                self._manual_steps_per_batch = progress.total.completed - before
                return output
            for _ in range(self._manual_steps_per_batch):  # keep global_step equal on every rank
                progress.increment_ready()
                progress.increment_completed()
            return {}

        self._patch(automatic, "run", automatic_run)
        self._patch(manual, "run", manual_run)
        connector = trainer._logger_connector
        log_step = connector.update_train_step_metrics

        def update_train_step_metrics() -> None:
            if self._slot.real:  # a no-op slot logged nothing new: do not re-log the last real step's values
                log_step()

        self._patch(connector, "update_train_step_metrics", update_train_step_metrics)

    def _on_real_slots_only(self, hook: Any) -> Any:
        def on_real_slot(*args: Any, **kwargs: Any) -> Any:
            return hook(*args, **kwargs) if self._slot.real else None

        return on_real_slot

    def _patch(self, owner: object, name: str, value: Any) -> None:
        """Replace ``owner.name`` for this fit; :meth:`teardown` puts the original back."""
        had_own = name in vars(owner)
        self._patches.append((owner, name, had_own, vars(owner).get(name)))
        setattr(owner, name, value)

    def _remove_patches(self) -> None:
        while self._patches:
            owner, name, had_own, original = self._patches.pop()
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


class _EpochCallback(Callback):
    """Runs before every other callback: sizes each epoch to its plan before anything (progress bars) reads its
    length, and does the epoch end's collectives (metric alignment, averaging) before anything else can issue one.
    Lightning's progress bar computes the epoch's ``sync_dist`` values on rank 0 alone in its own
    ``on_train_epoch_end``, and the other ranks match those reductions later; a collective of ours in between would
    pair with them and hang."""

    def __init__(self, strategy: OscarsStrategy) -> None:
        self.strategy = strategy

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.on_fit_train_start(trainer)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.start_epoch(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.align_epoch_metrics(trainer)
        self.strategy.average_if_pending()


class _RoundCallback(Callback):
    """Ends rounds (averaging) and averages before validation and at the end of fit."""

    def __init__(self, strategy: OscarsStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self.strategy.end_batch(trainer, kwargs.get("batch_idx", args[-1] if args else 0))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.average_if_pending()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.average_if_pending()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Runs before checkpoint callbacks' on_exception, so that a failing rank saves without collectives.
        self.strategy.on_failure(exception)


_EXIT_HANDLER_REGISTERED = False


def _destroy_gloo_group_at_exit() -> None:
    """Destroy a gloo default process group when the interpreter exits, while it is still fully alive.

    Left to interpreter finalisation, gloo's worker threads can still hold finished work whose tensors need the
    GIL, and the process aborts ("terminate called without an active exception", exit code 134) after training
    succeeded; seen here under ddp and oscars alike in about one run in three. Destroying is local for gloo (no
    collective), so it cannot hang on a peer that already left. NCCL groups are left to the user and Lightning.
    """
    global _EXIT_HANDLER_REGISTERED
    if _EXIT_HANDLER_REGISTERED:
        return
    _EXIT_HANDLER_REGISTERED = True

    def destroy() -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()

    atexit.register(destroy)


def _check_ddp_wrapper_options(options: dict[str, Any]) -> None:
    """DDP gradient hooks would silently do nothing without the DDP wrapper: an error. The wrapper's other
    options (``find_unused_parameters``, ``static_graph``, ...) are harmless to drop: a warning."""
    hooks = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
    for name in hooks:
        if options.get(name) is not None:
            raise ValueError(f"{name} is a DDP gradient-hook option; oscars does not wrap the model in DDP")
    ignored = sorted(name for name in options if name not in hooks)
    if ignored:
        rank_zero_warn("oscars does not wrap the model in DistributedDataParallel; ignoring " + ", ".join(ignored))


def _averaged_copies(trainer: Trainer) -> list[torch.nn.Module]:
    """Averaged copies of the model that callbacks update from each rank's local weights (Lightning's EMA /
    ``WeightAveraging``). Averaging them with the model each round keeps them equal on every rank: the mean of the
    ranks' copies is then the same moving average of the mean model (the update is linear and runs at the same
    global steps everywhere)."""
    copies: list[torch.nn.Module] = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, WeightAveraging) and callback._average_model is not None:
            copies.append(callback._average_model)
    return copies


def _accumulation_at(trainer: Trainer, epoch: int) -> int:
    """``accumulate_grad_batches`` in force during ``epoch``: a GradientAccumulationScheduler sets it only in its own
    ``on_train_epoch_start``, after oscars has sized the epoch, so ask the scheduler directly."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            return int(callback.get_accumulate_grad_batches(epoch))
    return int(trainer.accumulate_grad_batches)


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _takes_dataloader_iter(module: LightningModule) -> bool:
    import inspect

    return "dataloader_iter" in inspect.signature(module.training_step).parameters
