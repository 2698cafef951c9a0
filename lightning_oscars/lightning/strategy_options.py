"""The options of ``OscarsStrategy``, validated, and the schedule policy they configure."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_oscars.core.batch_shares import resolve_batch_sizes
from lightning_oscars.core.policy import SchedulePolicy, Solver
from lightning_oscars.core.replicas import ReplicaLayout, replica_batch_sizes
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.solver import DEFAULT_MAX_SPREAD
from lightning_oscars.core.timing import LapClock
from lightning_oscars.core.warmup import WarmupGate
from lightning_oscars.dist.outer import OuterNesterovAveraging
from lightning_oscars.dist.overlap import OverlappedAveraging
from lightning_oscars.dist.schemes import ModelAveraging, SyncScheme
from lightning_oscars.dist.sharding import ShardedModelAveraging, fsdp_keywords, require_fully_shard
from lightning_oscars.lightning.batch_balance import rank_device_names
from lightning_oscars.lightning.batch_probe import auto_rank_batch_sizes

__all__ = ["DDP_WRAPPER_OPTIONS", "OPTION_NAMES", "OscarsOptions", "check_ddp_wrapper_options"]

# The strategy's own options: declared once, with their defaults and documentation, in ``OscarsStrategy.__init__``'s
# signature (which LightningCLI reads); validated once, in ``OscarsOptions._set_options``.
OPTION_NAMES = (
    "balance",
    "batch_sizes",
    "solver",
    "averaging",
    "average_optimizer_state",
    "max_spread",
    "max_local_steps",
    "efficiency_tolerance",
    "warmup_steps",
    "timed_warmup",
    "rebalance_threshold",
    "min_gain",
    "smoothing",
    "deadline_rounds",
    "step_times",
    "local_steps",
    "seed",
    "monitor",
    "outer_lr",
    "outer_momentum",
    "overlap_averaging",
    "replica_size",
    "replica_spans_nodes",
    "shard_replicas",
    "shard_options",
    "save_distributed_checkpoint",
    "recovery",
    "recovery_dir",
)
# Options the schedule policy validates and keeps: option name -> the policy's argument.
_POLICY_ARGS = {
    "max_spread": "max_spread",
    "max_local_steps": "max_local_steps",
    "efficiency_tolerance": "tolerance",
    "warmup_steps": "warmup_steps",
    "rebalance_threshold": "rebalance_threshold",
    "min_gain": "min_gain",
    "smoothing": "smoothing",
    "step_times": "step_times",
    "local_steps": "local_steps",
}


def _path_or_none(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path or None, got {value!r}")
    return None if value is None else os.fspath(value)


# Options that only mean something for local steps, with their defaults: under balance="batch" another value is an
# error naming it (the constructor's defaults; a registered name such as "local_sgd" sets one).
LOCAL_STEP_OPTIONS: dict[str, Any] = {
    "solver": "exact",
    "averaging": "uniform",
    "average_optimizer_state": False,
    "max_spread": DEFAULT_MAX_SPREAD,
    "max_local_steps": 16,
    "efficiency_tolerance": 0.02,
    "timed_warmup": True,
    "rebalance_threshold": 0.2,
    "deadline_rounds": False,
    "local_steps": None,
    "outer_lr": None,
    "overlap_averaging": False,
    "replica_size": 1,
    "shard_replicas": False,
}


def check_balance(o: Mapping[str, Any]) -> None:
    """``balance`` and ``batch_sizes``, and the options ``balance="batch"`` cannot serve."""
    if o["balance"] not in ("steps", "batch"):
        raise ValueError(f"balance must be 'steps' or 'batch', got {o['balance']!r}")
    sizes = o["batch_sizes"]
    if sizes is not None:
        if o["balance"] == "steps" and o["deadline_rounds"]:
            raise ValueError(
                "batch_sizes cannot be combined with deadline_rounds: a deadline round hands a rank's unreached"
                " batches to other ranks, whose batches are of other sizes"
            )
        if isinstance(sizes, str) and sizes != "auto":
            raise ValueError(
                f"batch_sizes must be a list (one per rank), a dict by device name or 'auto', got {sizes!r}"
            )
        if sizes != "auto":
            resolve_batch_sizes(sizes, len(sizes), list(sizes))  # the values; the length is checked at fit start
    if o["balance"] == "batch":
        for name, default in LOCAL_STEP_OPTIONS.items():
            if o[name] != default:
                raise ValueError(
                    f"{name}={o[name]!r} configures local steps, which balance='batch' does not take (every step is"
                    " ddp's synchronous step). Leave it out, or use balance='steps'."
                )


# Options sharded replicas cannot take yet, and why (shard_replicas=True with any of them is an error naming it).
_NOT_WITH_SHARDS = {
    "overlap_averaging": "its posted all-reduce keeps a copy of the whole model, which a shard does not hold",
    "outer_lr": "the outer step keeps whole-model copies of the averaged tensors",
    "average_optimizer_state": "the optimizer state is sharded as the parameters are, and is not averaged yet",
}


_FLAGS = (
    "deadline_rounds",
    "timed_warmup",
    "overlap_averaging",
    "replica_spans_nodes",
    "shard_replicas",
    "save_distributed_checkpoint",
    "recovery",
)


def check_replicas(o: Mapping[str, Any]) -> None:
    """``replica_size``, and the options a replica's ranks stepping together rule out."""
    replica_size = o["replica_size"]
    if replica_size != "node" and (
        isinstance(replica_size, bool) or not isinstance(replica_size, int) or replica_size < 1
    ):
        raise ValueError(f"replica_size must be a positive integer or 'node', got {replica_size!r}")
    if replica_size != 1 and o["deadline_rounds"]:
        raise ValueError(
            f"replica_size={replica_size!r} cannot be combined with deadline_rounds: a deadline round decides each"
            " rank's steps by its own clock, and the ranks of a replica must step together"
        )


def check_sharding(o: Mapping[str, Any]) -> None:
    """``shard_replicas``, its ``shard_options``, and the options it cannot combine with, named."""
    if not o["shard_replicas"]:
        if o["shard_options"] is not None:
            raise ValueError("shard_options configures shard_replicas' default sharding: set shard_replicas=True")
        return
    require_fully_shard()  # an older torch: an error naming the release it needs, before anything is built
    fsdp_keywords(o["shard_options"])  # raises naming a bad key or value
    if o["replica_size"] == 1:
        raise ValueError(
            "shard_replicas=True shards the model inside a replica: set replica_size to 2 or more ranks, or 'node'"
        )
    for name, why in _NOT_WITH_SHARDS.items():
        if o[name] not in (None, False):
            raise ValueError(f"shard_replicas=True cannot be combined with {name}={o[name]!r}: {why}")


class OscarsOptions:
    """The strategy's own constructor options as attributes (what LightningCLI prints and a config sets)."""

    balance: str
    batch_sizes: list[int] | dict[str, int] | Literal["auto"] | None
    solver: Solver
    averaging: str
    average_optimizer_state: bool
    max_spread: int
    max_local_steps: int
    efficiency_tolerance: float
    warmup_steps: int
    timed_warmup: bool
    rebalance_threshold: float
    min_gain: float
    smoothing: float
    deadline_rounds: bool
    pinned_step_times: tuple[float, ...] | None
    pinned_local_steps: tuple[int, ...] | None
    seed: int | None
    monitor: bool
    outer_lr: float | None
    outer_momentum: float
    overlap_averaging: bool
    replica_size: int | str
    replica_spans_nodes: bool
    shard_replicas: bool
    shard_options: dict[str, Any] | None
    save_distributed_checkpoint: bool
    recovery: bool
    recovery_dir: str | None

    def _set_options(self, options: Mapping[str, Any]) -> None:
        """Validate and keep the strategy's own options (``options``: every name of :data:`OPTION_NAMES`, as the
        constructor's signature declares them). Each is checked once: the schedule's by ``SchedulePolicy`` (which
        raises naming the option), the rest here."""
        missing = sorted(set(OPTION_NAMES) - set(options))
        if missing:
            raise TypeError(f"missing options: {missing}")
        o = dict(options)
        check_balance(o)
        if o["averaging"] not in ("uniform", "samples"):
            raise ValueError(f"averaging must be 'uniform' or 'samples', got {o['averaging']!r}")
        seed = o["seed"]
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        for name in _FLAGS:
            if not isinstance(o[name], bool):
                raise ValueError(f"{name} must be True or False, got {o[name]!r}")
        if o["overlap_averaging"] and o["outer_lr"] is not None:
            raise ValueError(
                "overlap_averaging cannot be combined with outer_lr: the outer step needs the round's mean at the"
                " round's end, which overlapping delivers one round late"
            )
        check_replicas(o)
        check_sharding(o)
        OuterNesterovAveraging(1.0 if o["outer_lr"] is None else o["outer_lr"], o["outer_momentum"])  # raises: bad
        policy = SchedulePolicy(
            o["solver"], **{arg: o[name] for name, arg in _POLICY_ARGS.items()}
        )  # raises naming a bad schedule option
        self.balance, self.batch_sizes, self.solver = o["balance"], o["batch_sizes"], o["solver"]
        self.averaging = o["averaging"]
        self.average_optimizer_state = bool(o["average_optimizer_state"])
        self.max_spread, self.max_local_steps, self.warmup_steps = (
            policy.max_spread,
            policy.max_local_steps,
            policy.warmup_steps,
        )
        self.efficiency_tolerance = policy.tolerance
        self.rebalance_threshold, self.min_gain, self.smoothing = (
            policy.rebalance_threshold,
            policy.min_gain,
            policy.smoothing,
        )
        self.deadline_rounds, self.timed_warmup = o["deadline_rounds"], o["timed_warmup"]
        self.pinned_step_times, self.pinned_local_steps = policy.pinned_step_times, policy.pinned_local_steps
        self.seed = seed
        self.monitor = bool(o["monitor"])
        self.outer_lr = None if o["outer_lr"] is None else float(o["outer_lr"])
        self.outer_momentum = float(o["outer_momentum"])
        self.overlap_averaging = o["overlap_averaging"]
        self.replica_size = o["replica_size"]
        self.replica_spans_nodes = o["replica_spans_nodes"]
        self.shard_replicas, self.shard_options = o["shard_replicas"], o["shard_options"]
        self.save_distributed_checkpoint = o["save_distributed_checkpoint"]
        self.recovery, self.recovery_dir = o["recovery"], _path_or_none("recovery_dir", o["recovery_dir"])

    def make_scheme(self) -> SyncScheme:
        """The synchronisation scheme of a fit (override to plug in another; see ``schemes.py``): model averaging,
        followed by an outer Nesterov step when ``outer_lr`` is set, or overlapped with the next round when
        ``overlap_averaging`` is."""
        if self.shard_replicas:
            return ShardedModelAveraging(getattr(self, "shard_group", None))  # the group is known once ranks are
        if self.overlap_averaging:
            return OverlappedAveraging()
        if self.outer_lr is None:
            return ModelAveraging()
        return OuterNesterovAveraging(self.outer_lr, self.outer_momentum)

    def make_rounds(
        self,
        policy: SchedulePolicy,
        world_size: int,
        rank: int,
        clock: LapClock | None = None,
        counter: Callable[[int], int] | None = None,
        layout: ReplicaLayout | None = None,
        batch_sizes: Sequence[int] | None = None,
    ) -> RoundController:
        """The round controller of one fit under ``policy``: sample weighting, deadline rounds and the time-boxed
        warm-up as configured (the warm-up needs ``counter``, shared by the ranks; see ``warmup.py``). With replica
        groups (``layout``) the controller's ranks are the replicas, and the warm-up is not time-boxed: a replica's
        ranks must take the same steps, which each rank's own view of the shared count cannot promise. With per-rank
        ``batch_sizes`` (resolved, one per rank) a rank's step trains its own batch size: the round's average is
        weighted by samples, and the warm-up is not time-boxed (its round hands out single units)."""
        layout = layout or ReplicaLayout(world_size)
        gate = None
        if (
            self.timed_warmup
            and counter is not None
            and world_size > 1
            and layout.replica_size == 1
            and not batch_sizes
        ):
            gate = WarmupGate(world_size, counter)
        return RoundController(
            policy,
            **layout.place(rank),
            weighted=self.averaging == "samples" or batch_sizes is not None,
            deadline=self.deadline_rounds,
            warmup_gate=gate,
            clock=clock,
            batch_sizes=batch_sizes,
        )

    def rank_batch_sizes(self, strategy: ParallelStrategy, layout: ReplicaLayout, trainer: Trainer) -> list[int] | None:
        """Every replica's batch size (per rank) under ``balance="steps"`` from ``batch_sizes`` (a collective on
        every rank when given by device name, a probe and a collective for ``"auto"`` on CUDA); ``None``: the
        DataLoader's ``batch_size`` everywhere."""
        if self.batch_sizes is None or self.balance != "steps":
            return None
        if self.batch_sizes == "auto":
            fits = auto_rank_batch_sizes(strategy, trainer)
            if fits is None:
                return None
            # a replica's ranks step together on one batch: the size its least-memory rank fits
            return [min(fits[r] for r in layout.ranks_of(replica)) for replica in range(layout.replicas)]
        names = rank_device_names(strategy, isinstance(self.batch_sizes, dict))
        sizes = resolve_batch_sizes(self.batch_sizes, strategy.world_size, names)
        return None if sizes is None else replica_batch_sizes(sizes, layout)

    def make_policy(self) -> SchedulePolicy:
        """A fresh schedule policy for one fit."""
        return SchedulePolicy(
            self.solver,
            max_spread=self.max_spread,
            max_local_steps=self.max_local_steps,
            tolerance=self.efficiency_tolerance,
            warmup_steps=self.warmup_steps,
            rebalance_threshold=self.rebalance_threshold,
            min_gain=self.min_gain,
            smoothing=self.smoothing,
            step_times=self.pinned_step_times,
            local_steps=self.pinned_local_steps,
        )


# What DDPStrategy would pass on to the wrapper: such an option is dropped with a warning, any other is an error.
DDP_WRAPPER_OPTIONS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
# Options of other strategies of the package that a user may pass to the wrong one: named in the error.
_OPTIONS_ELSEWHERE = {
    "server_momentum": "the parameter-server strategies (bsp, asp, ssp, dssp, dasp)",
    "staleness": "strategy='ssp'",
    "s_low": "strategy='dssp'",
    "s_range": "strategy='dssp'",
    "group_size": "strategy='ripples'",
    "generator": "strategy='ripples'",
}


def check_ddp_wrapper_options(
    options: dict[str, Any], warn: Callable[[str], Any], wrapper_options: Collection[str], applied: bool = False
) -> None:
    """DDP gradient hooks would silently do nothing without the DDP wrapper: an error. A name that is none of
    ``wrapper_options`` (``DistributedDataParallel``'s) either, a typo or another strategy's option: an error. The
    wrapper's other options (``find_unused_parameters``, ``static_graph``, ...) are harmless to drop: a warning.
    ``applied``: replica groups wrap each replica in DDP, which takes these options; those the strategy sets itself
    (the replica's process group, the devices) are an error."""
    hooks = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
    for name in hooks:
        if options.get(name) is not None:
            raise ValueError(
                f"{name} is a DDP gradient-hook option; oscars "
                + ("does not take DDP hooks inside a replica" if applied else "does not wrap the model in DDP")
            )
    if applied:
        for name in ("process_group", "device_ids", "output_device", "device_mesh"):
            if name in options:
                raise ValueError(
                    f"{name} is set by the strategy for each replica (its process group and device); leave it out"
                )
    for name in options:
        if name not in wrapper_options and name not in hooks:
            where = _OPTIONS_ELSEWHERE.get(name)
            raise TypeError(
                f"unexpected option {name}={options[name]!r}"
                + (f": it is an option of {where}" if where else ": neither this strategy's nor DDP's")
            )
    ignored = sorted(name for name in options if name not in hooks)
    if ignored and not applied:
        warn("oscars does not wrap the model in DistributedDataParallel; ignoring " + ", ".join(ignored))
