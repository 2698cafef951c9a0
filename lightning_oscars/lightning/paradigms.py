"""The paradigms of the seeds as Lightning strategies: the parameter server's ``asp``, ``ssp``, ``dssp``, ``dasp``
(and ``bsp``), and the decentralized ``ripples``.

Each is an :class:`OscarsStrategy` that synchronises after every step, on deadline rounds: the padded slots, the
data plan (every sample once per epoch; a faster rank takes more of it), validation, checkpoints, stop conditions,
SIGTERM, resume and the failure reports are oscars' own. The parameter-server strategies use a
:class:`~lightning_oscars.dist.server_scheme.ParameterServerScheme` under one staleness rule (``staleness.py``);
``ripples`` a :class:`~lightning_oscars.dist.ripples.RipplesScheme`. Options of oscars that do not apply (solver,
averaging, outer steps, ...) are not offered.
"""

from __future__ import annotations

from abc import abstractmethod
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_oscars.core.groups import Generator, validate_options
from lightning_oscars.core.staleness import ASP, BSP, DASP, DSSP, SSP, StalenessRule
from lightning_oscars.dist.ripples import RipplesScheme
from lightning_oscars.dist.schemes import SyncScheme
from lightning_oscars.dist.server_scheme import ParameterServerScheme
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.strategy import DEFAULT_TIMEOUT, OscarsStrategy

__all__ = [
    "ASPStrategy",
    "BSPStrategy",
    "DASPStrategy",
    "DSSPStrategy",
    "ParameterServerStrategy",
    "RipplesStrategy",
    "SSPStrategy",
    "StepSyncStrategy",
]


# Options of ``oscars`` that a step-synchronised paradigm cannot serve, and why. Passed to a paradigm they would reach
# ``OscarsStrategy`` through ``**kwargs`` and be ignored there (the paradigm's scheme replaces the one they configure)
# or break the paradigm's rounds: each is refused when the strategy is built, naming it.
_NOT_SERVED = {
    "overlap_averaging": "a paradigm combines the models after every step and meets at every round's end at once",
    "outer_lr": "a paradigm's round ends with its own combination (the server's state, or the global average), not"
    " an outer Nesterov step",
    "outer_momentum": "it configures outer_lr's outer step, which a paradigm does not take",
    "deadline_rounds": "a paradigm always runs on deadline rounds",
    "replica_size": "a paradigm's ranks exchange after every step on their own; replica groups are for oscars and"
    " local_sgd",
    "replica_spans_nodes": "it configures replica_size, which a paradigm does not take",
    "shard_replicas": "it shards the model inside a replica, and a paradigm takes no replica_size",
    "balance": "a paradigm balances by local steps on deadline rounds; balance='batch' is oscars' synchronous mode",
    "batch_sizes": "per-rank batch sizes need plain rounds, and a paradigm trains on deadline rounds",
}
# Options the parameter-server paradigms cannot serve on top of those.
_NOT_SERVED_ON_THE_SERVER = {
    "local_steps": "pinned local steps make every round a plain one, whose steps are fixed in advance: a rank the"
    " staleness rule must stop early would lose its data, so BSP's equal steps and the bounds of SSP and DSSP could"
    " not hold. Pin step_times instead (deadline rounds sized from them)",
}


def refuse_options(strategy_name: str, options: dict[str, Any], not_served: dict[str, str]) -> None:
    """Raise ``ValueError`` naming the first of ``options`` that ``strategy_name`` cannot serve (see ``not_served``)."""
    for name, why in not_served.items():
        if name in options:
            raise ValueError(
                f"strategy={strategy_name!r} does not take {name}={options[name]!r}: {why}. Leave it out, or use"
                " strategy='oscars' for it."
            )


class StepSyncStrategy(OscarsStrategy):
    """A strategy that synchronises after every step (see the module docstring); subclasses make the scheme.

    Args:
        warmup_steps: steps every rank takes in the first round, which measures the step times the deadline
            rounds are sized from.
        max_local_steps: the most steps a rank takes per round (rounds last about this many steps of the fastest).
        timed_warmup: as for ``oscars``: faster ranks keep training while the slowest takes its warm-up steps
            (off by default: the paradigms were measured without it).
        recovery, recovery_dir: as for ``oscars`` (on by default): a survivor of a lost rank trains no further in the
            round and saves its worker model at the round's end; a restart merges the survivors' models.
        seed, monitor, timeout, start_method, process_group_backend: as for ``oscars``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by the Trainer.
    """

    strategy_name = "step_sync"
    description = ""  # abstract: a concrete paradigm's line in Lightning's strategy registry
    not_served = _NOT_SERVED  # options of oscars refused, with why

    def __init__(
        self,
        warmup_steps: int = 4,
        max_local_steps: int = 16,
        timed_warmup: bool = False,
        recovery: bool = True,
        recovery_dir: str | None = None,
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
        refuse_options(self.strategy_name, ddp_wrapper_kwargs, self.not_served)
        self.validate()  # the paradigm's options, before anything is built
        super().__init__(
            warmup_steps=warmup_steps,
            max_local_steps=max_local_steps,
            timed_warmup=timed_warmup,
            deadline_rounds=True,
            recovery=recovery,
            recovery_dir=recovery_dir,
            seed=seed,
            monitor=monitor,
            timeout=timeout,
            start_method=start_method,
            process_group_backend=process_group_backend,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            **ddp_wrapper_kwargs,
        )

    @abstractmethod
    def validate(self) -> None:
        """Raise ``ValueError`` naming a bad option of the paradigm (a base class: a paradigm defines it)."""

    @property
    def timeout_s(self) -> float:
        return internals.collective_timeout_s(self, default=1800.0)


class ParameterServerStrategy(StepSyncStrategy):
    """Training on the in-job parameter server under a staleness rule (see the module docstring).

    Args:
        server_momentum: the servers' own heavy-ball momentum on every push they apply (``0``, the default: none,
            the workers' optimizers keep their momentum). With it, give the workers a plain optimizer (SGD without
            momentum): the momentum then integrates every worker's updates where they meet, instead of each
            worker re-applying its own stale gradients (docs/paradigms.md, "Momentum").
        Other options as :class:`StepSyncStrategy`'s.
    """

    strategy_name = "parameter_server"
    not_served = {**_NOT_SERVED, **_NOT_SERVED_ON_THE_SERVER}

    def __init__(self, server_momentum: float = 0.0, **kwargs: Any) -> None:
        self.server_momentum = server_momentum
        super().__init__(**kwargs)

    def validate(self) -> None:
        momentum = self.server_momentum
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"server_momentum must be a number in [0, 1), got {momentum!r}")
        self.make_rule()

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self.server_momentum and trainer.state.fn == TrainerFn.FITTING:
            for optimizer in trainer.optimizers:
                if any(group.get("momentum") or group.get("betas") for group in optimizer.param_groups):
                    rank_zero_warn(
                        f"strategy={self.strategy_name!r} with server_momentum={self.server_momentum} and an optimizer"
                        f" with momentum of its own ({type(optimizer).__name__}): the two compound. Give the workers"
                        " plain SGD (momentum=0) when the server holds the momentum."
                    )
                    break

    @abstractmethod
    def make_rule(self) -> StalenessRule:
        """A fresh staleness rule for one fit (a base class: a paradigm defines it)."""

    def make_scheme(self) -> SyncScheme:
        return ParameterServerScheme(self.make_rule, timeout_s=self.timeout_s, server_momentum=self.server_momentum)


class BSPStrategy(ParameterServerStrategy):
    """Bulk synchronous parallel: every worker waits for every other after each iteration."""

    strategy_name = "bsp"
    description = "Parameter server, bulk synchronous (everybody waits for the slowest every iteration)"

    def make_rule(self) -> StalenessRule:
        return BSP()


class ASPStrategy(ParameterServerStrategy):
    """Asynchronous parallel: nobody ever waits; a worker continues from whatever the server holds."""

    strategy_name = "asp"
    description = "Parameter server, asynchronous (nobody waits)"

    def make_rule(self) -> StalenessRule:
        return ASP()


class SSPStrategy(ParameterServerStrategy):
    """Stale synchronous parallel: a worker starts its next iteration while it is at most ``staleness`` updates
    ahead of the slowest."""

    strategy_name = "ssp"
    description = "Parameter server, stale synchronous (at most `staleness` updates ahead of the slowest)"

    def __init__(self, staleness: int = 3, **kwargs: Any) -> None:
        self.staleness = staleness
        super().__init__(**kwargs)

    def make_rule(self) -> StalenessRule:
        return SSP(self.staleness)


class DSSPStrategy(ParameterServerStrategy):
    """Dynamic SSP: the threshold moves per iteration within ``[s_low, s_low + s_range]`` from the workers'
    iteration times (the rule is written down in ``staleness.py``)."""

    strategy_name = "dssp"
    description = "Parameter server, dynamic SSP (threshold in [s_low, s_low + s_range] from the speeds)"

    def __init__(self, s_low: int = 3, s_range: int = 12, **kwargs: Any) -> None:
        self.s_low, self.s_range = s_low, s_range
        super().__init__(**kwargs)

    def make_rule(self) -> StalenessRule:
        return DSSP(self.s_low, self.s_range)


class DASPStrategy(ParameterServerStrategy):
    """Dynamic adaptive synchronous parallel: workers move between a synchronous group and asynchronous states by
    speed (``leave`` / ``rejoin`` times the synchronous workers' median, for ``patience`` pushes; ``staleness.py``)."""

    strategy_name = "dasp"
    description = "Parameter server, dynamic adaptive (slow workers leave the synchronous group)"

    def __init__(self, leave: float = 1.5, rejoin: float = 1.2, patience: int = 2, **kwargs: Any) -> None:
        self.leave, self.rejoin, self.patience = leave, rejoin, patience
        super().__init__(**kwargs)

    def make_rule(self) -> StalenessRule:
        return DASP(self.leave, self.rejoin, self.patience)


class RipplesStrategy(StepSyncStrategy):
    """Ripples (seed 001): after every step a worker averages its model with a group of workers (a partial
    all-reduce); a generator on rank 0 makes the groups (``groups.py`` writes down our reading of Group Buffer and
    Group Division); every round's end averages all ranks, so validation, checkpoints and the end of fit see one
    model.

    Args:
        group_size: the most workers in a group (>= 2).
        generator: ``"static"`` (a fixed rotating division, for homogeneous clusters), ``"random"`` (a random
            division of the workers) or ``"smart"`` (the requester with the workers expected soonest, within
            ``tolerance`` of its own step time: slow workers do not hold fast ones back).
        buffer_size: a worker is given no new group while this many wait in its buffer beyond its current one.
        tolerance: ``smart``: how long, in the requester's step times, a partner may be expected to take.
        max_local_steps: the most steps of the fastest rank between two global averages.
        overlap: exchange with each group while the next step runs and apply the group's mean one step late, as a
            correction that keeps this rank's own progress (nobody waits for a member's step to end). The default:
            faster to the same accuracy in every measured profile. ``False``: the seed's synchronous partial
            all-reduce.
        timed_warmup: as :class:`StepSyncStrategy`'s, but on by default here: with one rank 2x or 5x slower or
            speeds that change, the fast ranks' training during the warm-up round paid 3-8% throughput (4 ranks; the
            run is not kept: docs/benchmarks.md's decisions table); on equal ranks it cost 3%.
        Other options as :class:`StepSyncStrategy`'s.
    """

    strategy_name = "ripples"
    description = "Decentralized: partial all-reduce with a group after every step (Ripples)"

    def __init__(
        self,
        group_size: int = 3,
        generator: Generator = "smart",
        buffer_size: int = 2,
        tolerance: float = 0.1,
        max_local_steps: int = 32,
        overlap: bool = True,
        timed_warmup: bool = True,
        **kwargs: Any,
    ) -> None:
        self.group_size, self.generator, self.buffer_size, self.tolerance = (
            group_size,
            generator,
            buffer_size,
            tolerance,
        )
        self.overlap = overlap
        super().__init__(max_local_steps=max_local_steps, timed_warmup=timed_warmup, **kwargs)

    def validate(self) -> None:
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")
        # world_size is not known yet: a group larger than the cluster is simply the whole cluster
        validate_options(1, self.group_size, self.generator, self.buffer_size, self.tolerance)

    def make_scheme(self) -> SyncScheme:
        options = {
            "group_size": self.group_size,
            "generator": self.generator,
            "buffer_size": self.buffer_size,
            "tolerance": self.tolerance,
            "seed": self.seed if self.seed is not None else 0,
        }
        return RipplesScheme(options, timeout_s=self.timeout_s, overlap=self.overlap)


# The registered paradigms, by name: each class registers itself (``register_strategies``).
PARADIGMS: dict[str, tuple[type[StepSyncStrategy], str]] = {
    cls.strategy_name: (cls, cls.description)
    for cls in (BSPStrategy, ASPStrategy, SSPStrategy, DSSPStrategy, DASPStrategy, RipplesStrategy)
}
