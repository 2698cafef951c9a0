"""The parameter-server paradigms as Lightning strategies: ``asp``, ``ssp``, ``dssp``, ``dasp`` (and ``bsp``).

Each is an :class:`OscarsStrategy` whose scheme is a
:class:`~lightning_oscars.server_scheme.ParameterServerScheme` under one staleness rule (``staleness.py``), on
deadline rounds: the padded slots, the data plan (every sample once per epoch; a faster rank takes more of it),
validation, checkpoints, stop conditions, SIGTERM, resume and the failure reports are oscars' own. Options of
oscars that do not apply (solver, averaging, outer steps, ...) are not offered.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from lightning_oscars.schemes import SyncScheme
from lightning_oscars.server_scheme import ParameterServerScheme
from lightning_oscars.staleness import ASP, BSP, DASP, DSSP, SSP, StalenessRule
from lightning_oscars.strategy import DEFAULT_TIMEOUT, OscarsStrategy

__all__ = [
    "ASPStrategy",
    "BSPStrategy",
    "DASPStrategy",
    "DSSPStrategy",
    "ParameterServerStrategy",
    "SSPStrategy",
]


class ParameterServerStrategy(OscarsStrategy):
    """Training on the in-job parameter server under a staleness rule (see the module docstring).

    Args:
        warmup_steps: steps every rank takes in the first round, which measures the step times the deadline
            rounds are sized from.
        max_local_steps: the most steps a rank takes per round (rounds last about this many steps of the fastest).
        seed, monitor, timeout, start_method, process_group_backend: as for ``oscars``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by the Trainer.
    """

    strategy_name = "parameter_server"

    def __init__(
        self,
        warmup_steps: int = 4,
        max_local_steps: int = 16,
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
        self.make_rule()  # validates the rule's options before anything is built
        super().__init__(
            warmup_steps=warmup_steps,
            max_local_steps=max_local_steps,
            timed_warmup=False,
            deadline_rounds=True,
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

    def make_rule(self) -> StalenessRule:
        """A fresh staleness rule for one fit."""
        raise NotImplementedError

    def make_scheme(self) -> SyncScheme:
        seconds = self._timeout.total_seconds() if self._timeout is not None else 1800.0
        return ParameterServerScheme(self.make_policy(), self.make_rule, timeout_s=seconds)

    @property
    def rule(self) -> StalenessRule | None:
        """The current fit's rule as the own shard's server applies it (``None`` before a fit)."""
        server = getattr(self.scheme, "server", None)
        return None if server is None else server.shard.rule


class BSPStrategy(ParameterServerStrategy):
    """Bulk synchronous parallel: every worker waits for every other after each iteration."""

    strategy_name = "bsp"

    def make_rule(self) -> StalenessRule:
        return BSP()


class ASPStrategy(ParameterServerStrategy):
    """Asynchronous parallel: nobody ever waits; a worker continues from whatever the server holds."""

    strategy_name = "asp"

    def make_rule(self) -> StalenessRule:
        return ASP()


class SSPStrategy(ParameterServerStrategy):
    """Stale synchronous parallel: a worker starts its next iteration while it is at most ``staleness`` updates
    ahead of the slowest."""

    strategy_name = "ssp"

    def __init__(self, staleness: int = 3, **kwargs: Any) -> None:
        self.staleness = staleness
        super().__init__(**kwargs)

    def make_rule(self) -> StalenessRule:
        return SSP(self.staleness)


class DSSPStrategy(ParameterServerStrategy):
    """Dynamic SSP: the threshold moves per iteration within ``[s_low, s_low + s_range]`` from the workers'
    iteration times (the rule is written down in ``staleness.py``)."""

    strategy_name = "dssp"

    def __init__(self, s_low: int = 3, s_range: int = 12, **kwargs: Any) -> None:
        self.s_low, self.s_range = s_low, s_range
        super().__init__(**kwargs)

    def make_rule(self) -> StalenessRule:
        return DSSP(self.s_low, self.s_range)


class DASPStrategy(ParameterServerStrategy):
    """Dynamic adaptive synchronous parallel: workers move between a synchronous group and asynchronous states by
    speed (``leave`` / ``rejoin`` times the synchronous workers' median, for ``patience`` pushes; ``staleness.py``)."""

    strategy_name = "dasp"

    def __init__(self, leave: float = 1.5, rejoin: float = 1.2, patience: int = 2, **kwargs: Any) -> None:
        self.leave, self.rejoin, self.patience = leave, rejoin, patience
        super().__init__(**kwargs)

    def make_rule(self) -> StalenessRule:
        return DASP(self.leave, self.rejoin, self.patience)


PARADIGMS: dict[str, tuple[type[ParameterServerStrategy], str]] = {
    "bsp": (BSPStrategy, "Parameter server, bulk synchronous (everybody waits for the slowest every iteration)"),
    "asp": (ASPStrategy, "Parameter server, asynchronous (nobody waits)"),
    "ssp": (SSPStrategy, "Parameter server, stale synchronous (at most `staleness` updates ahead of the slowest)"),
    "dssp": (DSSPStrategy, "Parameter server, dynamic SSP (threshold in [s_low, s_low + s_range] from the speeds)"),
    "dasp": (DASPStrategy, "Parameter server, dynamic adaptive (slow workers leave the synchronous group)"),
}
