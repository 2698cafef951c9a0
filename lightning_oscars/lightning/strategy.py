"""``OscarsStrategy``: load-balanced local SGD as a Lightning ``DDPStrategy``.

Every rank iterates the same batches ("slots"); rank ``i`` trains in ``tau_i`` of each round's slots and treats
the rest as no-ops that still advance Lightning's counters, so every trigger and collective stays matched. At a
round's end the scheme combines the models and the control data in one all-reduce. This class only wires the
parts to Lightning's strategy hooks: one ``session.FitSession`` per fit owns what the fit creates and wires its
``rounds.RoundController`` (the round logic, no Lightning), scheme (``schemes``) and ``loader`` to the trainer
through ``callbacks`` and ``adapter.LightningAdapter`` (the patches of Lightning's loops). See ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_oscars.core.control import RoundRecord
from lightning_oscars.core.loader import empty_batch
from lightning_oscars.core.policy import Solver
from lightning_oscars.core.recovery_points import RecoveryPoint
from lightning_oscars.core.replicas import ReplicaLayout
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.solver import DEFAULT_MAX_SPREAD
from lightning_oscars.core.timing import make_clock
from lightning_oscars.core.warmup import StoreCounter
from lightning_oscars.dist._c10d import default_store_or_none, destroy_gloo_group_at_exit, replica_groups, retire_group
from lightning_oscars.dist.local_collectives import LocalWorld
from lightning_oscars.dist.schemes import SyncScheme
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.batch_hooks import BatchBalanceHooks
from lightning_oscars.lightning.collectives import LocalStepCollectives
from lightning_oscars.lightning.namespaces import BindsToTrainerNamespace
from lightning_oscars.lightning.recovery import FitRecovery, find_recovery_point, recovery_store
from lightning_oscars.lightning.session import FitSession
from lightning_oscars.lightning.sharded_replicas import ShardedReplicaHooks
from lightning_oscars.lightning.strategy_options import (
    DDP_WRAPPER_OPTIONS,
    OPTION_NAMES,
    OscarsOptions,
    check_ddp_wrapper_options,
)
from lightning_oscars.lightning.strategy_state import RoundViews
from lightning_oscars.lightning.tuner_runs import TunerRuns

__all__ = ["DEFAULT_TIMEOUT", "OscarsStrategy", "RoundRecord"]

Averaging = Literal["uniform", "samples"]
# Collective timeout: well under NCCL's 30 minutes, yet long enough for a large checkpoint write.
DEFAULT_TIMEOUT = timedelta(minutes=10)


class OscarsStrategy(
    BindsToTrainerNamespace,
    OscarsOptions,
    RoundViews,
    TunerRuns,
    ShardedReplicaHooks,
    BatchBalanceHooks,
    LocalStepCollectives,
):
    """Load-balanced local SGD for clusters whose ranks run at different speeds (the Oscars method).

    Args:
        balance: ``"steps"`` (default: local SGD, fast ranks take more local steps per round) or ``"batch"`` (ddp's
            synchronous steps over ddp's global batch, each rank's share of it sized to its speed and gradients
            weighted by share: ddp's trajectory; ``docs/batch-balance.md``). Under ``"batch"`` only ``warmup_steps``,
            ``min_gain``, ``smoothing``, ``step_times``, ``seed`` and ``batch_sizes`` apply of the options below.
        batch_sizes: a batch size per rank (its memory), a list by rank or a dict by device name
            (``torch.cuda.get_device_name()``). Under ``"steps"`` each rank trains its own (the round's average is
            then weighted by samples); under ``"batch"`` each rank's largest share. ``"auto"``: on CUDA, what a
            probe at fit start finds each device fits (``docs/batch-balance.md``); elsewhere the DataLoader's.
            ``None``: the DataLoader's.
        solver: ``"exact"`` (communication-aware, exact; default), ``"alg1"`` (the paper's Algorithm 1) or
            ``"uniform"`` (fixed-period local SGD: every rank takes ``max_local_steps`` steps per round).
        averaging: ``"uniform"`` (the paper's Eq. 4: plain mean) or ``"samples"`` (weighted by the samples
            each rank trained on in the round).
        average_optimizer_state: also average the optimizers' state (momentum, Adam moments); by default it is local.
        max_spread: ``M``: the local steps of the fastest and slowest rank differ by less than this.
        max_local_steps: no rank takes more than this many local steps per round.
        efficiency_tolerance: the exact solver picks the shortest round whose predicted throughput is within
            this fraction of the best.
        warmup_steps: local steps every rank takes in the first round, which is spent measuring step times;
            shortened to ``max_steps`` when the run is shorter (``fast_dev_run`` included).
        timed_warmup: time-box the first round: faster ranks train until the slowest has taken its ``warmup_steps``
            (``lightning_oscars.core.warmup``). ``False``: every rank takes exactly ``warmup_steps``.
        rebalance_threshold: re-solve when a rank's smoothed step time moved by more than this fraction from
            the times the schedule was solved for.
        min_gain: adopt a re-solved schedule only if it is predicted to be this fraction faster (hysteresis).
        smoothing: weight of the newest round in the step-time moving average.
        deadline_rounds: rounds of a length in seconds: each rank trains while its next step fits and hands back
            the data it did not reach, so per-step jitter costs nobody a wait (``lightning_oscars.core.deadline``).
        step_times: pin every rank's seconds per step (no profiling, one solve, reproducible).
        local_steps: pin every rank's local steps per round (no profiling, no solving).
        seed: seed of the per-epoch shuffle of the training data; by default the seed of the sampler Lightning
            injects, which follows ``seed_everything`` (``PL_GLOBAL_SEED``), else 0.
        monitor: add a :class:`~lightning_oscars.ScheduleMonitor` (per-round metrics, ``tau`` in the progress bar, a
            summary at the end of fit) unless the trainer already has one.
        outer_lr: ``None`` (default): plain averaging. A number: after averaging, an outer Nesterov-SGD step of
            this learning rate on the averaged pseudo-gradient (DiLoCo: 0.7; see ``lightning_oscars.dist.outer``).
        outer_momentum: the outer step's momentum (DiLoCo: 0.9).
        overlap_averaging: post a round's model all-reduce and train the next round meanwhile; its mean is applied
            at the next round's end as ``x += mean - sent`` (``lightning_oscars.dist.overlap``; one more copy of the
            averaged tensors; models still equal at validation, checkpoints and epoch ends). Not with ``outer_lr``.
        replica_size: ranks that train as one replica, data parallel under ``DistributedDataParallel`` while the
            rounds balance the replicas (``replicas.py``): ``1``, ``k`` consecutive ranks, or ``"node"``.
        replica_spans_nodes: allow a replica whose ranks lie on different nodes (by default an error).
        shard_replicas: shard the model inside each replica with torch's FSDP2 (``docs/sharded-replicas.md``): a
            rank holds ``1/k`` of the parameters, gradients and optimizer state, and averages only its shard.
        shard_options: FSDP2's ``fully_shard`` keywords for the default sharding (a module that shards nothing in
            ``configure_model``): ``reshard_after_forward``, ``mp_policy``, ``offload_policy``.
        save_distributed_checkpoint: with ``shard_replicas``, checkpoints are directories of each rank's shards
            (torch's distributed checkpoint, as ``ModelParallelStrategy`` writes them); ``False``: one full-state file.
        recovery: when a round's averaging fails (a rank died), every survivor saves its state, and a restarted fit
            resumes from it by itself, losing only the lost ranks' share of that round (``docs/fault-tolerance.md``).
        recovery_dir: where (default ``<default_root_dir>/oscars-recovery``; a file system every node sees).
        timeout: collective timeout (default 10 minutes): a hung rank is reported after at most this long; a
            rank that dies or raises is reported at once. Raise it if saving a checkpoint can take longer.
        start_method: how Lightning starts the ranks (as for ``ddp``): ``"popen"`` re-runs the script.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; by default NCCL on CUDA, gloo otherwise.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by the Trainer.

    Options of the ``DistributedDataParallel`` wrapper (``find_unused_parameters``, ``bucket_cap_mb``, ...) configure
    each replica's wrapper when ``replica_size`` is not 1; otherwise they are ignored with a warning (oscars does not
    wrap the model). DDP gradient hooks are an error.
    """

    strategy_name = "oscars"
    # What ``register_strategies`` registers: a subclass that sets ``strategy_name`` and ``description`` registers
    # that name; this class registers several named configurations (name -> (description, options)).
    description = ""
    registered_names: dict[str, tuple[str, dict[str, Any]]] = {
        "oscars": ("Load-balanced local SGD (Oscars), exact communication-aware solver", {}),
        "oscars_alg1": ("Load-balanced local SGD with the paper's Algorithm 1 solver", {"solver": "alg1"}),
        "local_sgd": ("Fixed-period local SGD: the same local steps on every rank", {"solver": "uniform"}),
        "every_step_averaging": (
            "Model averaging after every optimizer step (ddp's trajectory for plain SGD, without DDP's wrapper)",
            {"solver": "uniform", "max_local_steps": 1},
        ),
    }

    def __init__(
        self,
        balance: Literal["steps", "batch"] = "steps",
        batch_sizes: list[int] | dict[str, int] | Literal["auto"] | None = None,
        solver: Solver = "exact",
        averaging: Averaging = "uniform",
        average_optimizer_state: bool = False,
        max_spread: int = DEFAULT_MAX_SPREAD,
        max_local_steps: int = 16,
        efficiency_tolerance: float = 0.02,
        warmup_steps: int = 4,
        timed_warmup: bool = True,
        rebalance_threshold: float = 0.2,
        min_gain: float = 0.02,
        smoothing: float = 0.5,
        deadline_rounds: bool = False,
        step_times: Sequence[float] | None = None,
        local_steps: Sequence[int] | None = None,
        seed: int | None = None,
        monitor: bool = True,
        outer_lr: float | None = None,
        outer_momentum: float = 0.9,
        overlap_averaging: bool = False,
        replica_size: int | Literal["node"] = 1,
        replica_spans_nodes: bool = False,
        shard_replicas: bool = False,
        shard_options: dict[str, Any] | None = None,
        save_distributed_checkpoint: bool = True,
        recovery: bool = True,
        recovery_dir: str | None = None,
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
        # Not forwarded to DDPStrategy (LightningCLI would list every DistributedDataParallel argument as ours).
        check_ddp_wrapper_options(ddp_wrapper_kwargs, rank_zero_warn, DDP_WRAPPER_OPTIONS, replica_size != 1)
        DDPStrategy.__init__(
            self,
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            precision_plugin,
            timeout=timeout,
            start_method=start_method,
            process_group_backend=process_group_backend,
        )
        self._set_options({name: value for name, value in locals().items() if name in OPTION_NAMES})  # validated once
        self.make_scheme()  # a bad combination of options fails here, not at the first fit
        self._init_fit_state()
        self._replica_wrapper_options = dict(ddp_wrapper_kwargs)  # what each replica's DDP wrapper gets

    def _init_fit_state(self) -> None:
        """The state fits keep on the strategy, before the first."""
        # The fit in progress (or a tuner's loop run inside it), the fit's own while a tuner's loop run has its own,
        # and the last fit's (for its records).
        self._session: FitSession | None = None
        self._fit_session: FitSession | None = None
        self._last_session: FitSession | None = None
        self._noop_batch: Any = None
        self._in_local_step = self._checkpoint_written = False  # the latter: a checkpoint write's barrier is next
        self._restored: dict[str, Any] | None = None  # a loaded checkpoint's round state, for the next fit
        self._layout, self._replica_group = ReplicaLayout(1), None  # resolved once the ranks are known
        self._recovery_point: RecoveryPoint | None = None  # found by setup_distributed, for the fit about to start

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the class in Lightning's strategy registry, as Lightning's own strategies do (the package does it
        on import for its own): under ``strategy_name`` with ``description``, or under every name of a
        ``registered_names`` of its own. A class with neither (an abstract base) registers nothing."""
        names = cls.__dict__.get("registered_names")
        if names is None:
            names = {cls.strategy_name: (cls.description, {})} if cls.description else {}
        for name, (description, options) in names.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **options)

    # ------------------------------------------------------------------ public state

    @property
    def is_active(self) -> bool:
        """Local SGD is on: fitting with more than one rank, or resuming the survivors of a failed round."""
        return self.world_size > 1 or self._recovery_point is not None

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def configure_ddp(self) -> None:
        # Start from rank 0's weights (a restart after a lost rank: from each survivor's own, merged at the first
        # collective). No DistributedDataParallel wrapper (no gradient all-reduce per step), except with replica
        # groups: each replica is wrapped on its own process group, so its ranks step together.
        assert self.model is not None
        if self.device_mesh is not None:
            return self._configure_sharded(sync=self._recovery_point is None)
        if self._recovery_point is None:
            internals.sync_module_states(self.model)
        if self._replica_group is not None:
            self._ddp_kwargs = {**self._replica_wrapper_options, "process_group": self._replica_group}
            super().configure_ddp()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        destroy_gloo_group_at_exit()
        timeout = timedelta(seconds=internals.collective_timeout_s(self, default=DEFAULT_TIMEOUT.total_seconds()))
        place = (self.world_size, self.global_rank, self.node_rank, timeout)
        self._layout, self._replica_group = replica_groups(self.replica_size, self.replica_spans_nodes, *place)
        self._make_replica_mesh(self._layout)  # shard_replicas: FSDP2's mesh inside each replica
        # A restart after a failed round finds the survivors' states (a collective: every rank asks).
        self._recovery_point = find_recovery_point(self, internals.trainer_of(self.lightning_module))

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self.is_active:
            # Before the parent's setup: configure_optimizers may already read estimated_stepping_batches, which
            # builds the training loader (process_dataloader) with this fit's session.
            self._begin_fit(trainer)
        super().setup(trainer)

    def _begin_fit(self, trainer: Trainer) -> None:
        assert self.lightning_module is not None
        problem = internals.sync_batchnorm_problem(self) or internals.unsupported(trainer, self.lightning_module)
        if problem is not None:
            raise ValueError(problem)
        self._end_fit()  # a previous fit on this Trainer that was not torn down, if any
        if self.balance == "batch":
            self._restored = None
            return self._begin_batch_fit(trainer, self._recovery_point)
        scheme = self.make_scheme()
        store = default_store_or_none()
        sizes = self.rank_batch_sizes(self, self._layout, trainer)
        rounds = self.make_rounds(
            self.make_policy(),
            self.world_size,
            self.global_rank,
            make_clock(self.root_device),
            None if store is None else StoreCounter(store),
            self._layout,
            sizes,
        )
        rounds.begin_fit(trainer.max_steps)
        restored, self._restored = self._restored, None
        store = recovery_store(trainer, self.recovery_dir) if self.recovery else None
        point, rank = self._recovery_point, self.global_rank
        recovery = FitRecovery(store, point, rank, self._layout.replica_size) if store is not None else None
        self._session = self._make_session(scheme, rounds, restored=restored, recovery=recovery, batch_sizes=sizes)
        self._session.begin(trainer, monitor=self.monitor)

    def _make_session(self, scheme: SyncScheme, rounds: RoundController, **kwargs: Any) -> FitSession:
        """A fit session of this strategy (``kwargs``: ``restored``, ``on_training_end``, ``recovery``,
        ``batch_sizes``)."""
        mine: dict[str, Any] = {"seed": self.seed, "average_optimizer_state": self.average_optimizer_state}
        return FitSession(self, scheme, rounds, name=self.strategy_name, **mine, **kwargs)

    def _end_fit(self) -> None:
        """Undo everything the fit created (its session and a tuner run's inside it); keep its records."""
        self._end_tuner_run()  # a tuner's loop run that raised
        session, self._session = self._session, None
        if session is not None:
            session.end()
            self._last_session = session

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = internals.trainer_of(self.lightning_module)
        batch = self._batch
        if batch is not None and batch.fitting(trainer) and trainer.state.stage == RunningStage.TRAINING:  # type: ignore[union-attr]
            assert trainer is not None
            return batch.wrap_dataloader(trainer, dataloader)
        session = self._session
        if session is None or not session.fitting(trainer) or trainer.state.stage != RunningStage.TRAINING:  # type: ignore[union-attr]
            return dataloader
        assert trainer is not None
        return session.wrap_dataloader(trainer, dataloader)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        session = self._session
        loader = None if session is None else session.loader
        trainer = internals.trainer_of(self.lightning_module)
        if loader is None or trainer is None or not trainer.training or not loader.has_pending_slot:
            return super().batch_to_device(batch, device, dataloader_idx)
        assert session is not None
        slot = loader.take_slot()
        session.rounds.begin_slot(slot)  # a real step's clock starts here
        if not slot.real:
            # The empty batch of the last real one, already on the device (no transfer, no transfer hooks). Only a
            # resume into a no-op slot moves its (empty) batch once.
            if self._noop_batch is None:
                self._noop_batch = empty_batch(super().batch_to_device(batch, device, dataloader_idx))
            return self._noop_batch
        moved = super().batch_to_device(batch, device, dataloader_idx)
        self._noop_batch = empty_batch(moved)
        return moved

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_local_step = self.is_active and self._batch is None  # balance="batch": ddp's steps, in lockstep
        try:
            if not self._in_local_step:
                return super().training_step(*args, **kwargs)
            # A collective in user code (a loss that all-reduces every step) acts on this rank alone, or is refused.
            with LocalWorld(self.strategy_name):
                return super().training_step(*args, **kwargs)
        finally:
            self._in_local_step = False

    @override
    def teardown(self) -> None:
        self._end_fit()
        self._end_batch_fit()
        self._noop_batch = None
        super().teardown()
        retire_group(self._replica_group)  # the wrapper that used it is gone; destroyed when the next groups are made
        self._replica_group = None
