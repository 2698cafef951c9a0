"""lightning-oscars: load-balanced local SGD for heterogeneous clusters, as a Lightning strategy.

Importing the package registers ``strategy="oscars"`` (with ``"oscars_alg1"``, the fixed-period baseline
``"local_sgd"`` and ``"every_step_averaging"``), the parameter-server paradigms ``"bsp"``, ``"asp"``, ``"ssp"``,
``"dssp"`` and ``"dasp"``, and the decentralized ``"ripples"``. ``plot_timeline`` draws a fit's rounds."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_oscars.core.control import RoundRecord
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan, plan_rounds, planned_slots, round_quotas
from lightning_oscars.core.policy import SchedulePolicy
from lightning_oscars.core.rounds import RoundController, RoundOutcome
from lightning_oscars.core.solver import (
    Schedule,
    schedule_from_local_steps,
    solve_schedule,
    solve_schedule_alg1,
)
from lightning_oscars.core.timeline import plot_timeline
from lightning_oscars.dist.schemes import ModelAveraging, RoundMeeting, SyncScheme

# First: refuses an unsupported Lightning release before anything touches its internals.
from lightning_oscars.lightning._internals import SUPPORTED_LIGHTNING, check_lightning_version
from lightning_oscars.lightning.heterogeneity import HeterogeneityEmulator, SlowdownProfile
from lightning_oscars.lightning.monitor import ScheduleMonitor, round_metrics, summarize_history
from lightning_oscars.lightning.namespaces import bind as _bind_namespaces
from lightning_oscars.lightning.paradigms import (
    PARADIGMS,
    ASPStrategy,
    BSPStrategy,
    DASPStrategy,
    DSSPStrategy,
    ParameterServerStrategy,
    RipplesStrategy,
    SSPStrategy,
    StepSyncStrategy,
)
from lightning_oscars.lightning.strategy import OscarsStrategy

__version__ = "0.1.0"

__all__ = [
    "ASPStrategy",
    "BSPStrategy",
    "DASPStrategy",
    "DSSPStrategy",
    "EpochPlan",
    "HeterogeneityEmulator",
    "LoadBalancedLoader",
    "ModelAveraging",
    "OscarsStrategy",
    "ParameterServerStrategy",
    "RipplesStrategy",
    "RoundController",
    "RoundOutcome",
    "RoundMeeting",
    "RoundRecord",
    "SSPStrategy",
    "StepSyncStrategy",
    "SUPPORTED_LIGHTNING",
    "Schedule",
    "ScheduleMonitor",
    "SchedulePolicy",
    "SlowdownProfile",
    "SyncScheme",
    "check_lightning_version",
    "plan_rounds",
    "planned_slots",
    "plot_timeline",
    "round_metrics",
    "round_quotas",
    "schedule_from_local_steps",
    "solve_schedule",
    "solve_schedule_alg1",
    "summarize_history",
]

_STRATEGIES: list[type[OscarsStrategy]] = [OscarsStrategy, *(_cls for _cls, _ in PARADIGMS.values())]
for _strategy in _STRATEGIES:
    _strategy.register_strategies(StrategyRegistry)
# The same strategies for the standalone pytorch_lightning package (lightning/namespaces.py): this file, compiled with
# its Lightning imports renamed, is lightning_oscars.pytorch_lightning.
_bind_namespaces(__name__, _STRATEGIES)
