"""lightning-oscars: load-balanced local SGD for heterogeneous clusters, as a Lightning strategy.

Importing the package registers ``strategy="oscars"`` (with ``"oscars_alg1"``, the fixed-period baseline
``"local_sgd"`` and ``"every_step_averaging"``), the parameter-server paradigms ``"bsp"``, ``"asp"``, ``"ssp"``,
``"dssp"`` and ``"dasp"``, and the decentralized ``"ripples"``. ``plot_timeline`` draws a fit's rounds."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

# First: refuses an unsupported Lightning release before anything touches its internals.
from lightning_oscars.adapter import SUPPORTED_LIGHTNING, check_lightning_version
from lightning_oscars.control import RoundRecord
from lightning_oscars.heterogeneity import HeterogeneityEmulator, SlowdownProfile
from lightning_oscars.loader import LoadBalancedLoader
from lightning_oscars.monitor import ScheduleMonitor, round_metrics, summarize_history
from lightning_oscars.paradigms import (
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
from lightning_oscars.partition import EpochPlan, plan_rounds, planned_slots, round_quotas
from lightning_oscars.policy import SchedulePolicy
from lightning_oscars.rounds import RoundController, RoundOutcome
from lightning_oscars.schemes import ModelAveraging, RoundMeeting, SyncScheme
from lightning_oscars.solver import (
    Schedule,
    schedule_from_local_steps,
    solve_schedule,
    solve_schedule_alg1,
)
from lightning_oscars.strategy import OscarsStrategy
from lightning_oscars.timeline import plot_timeline

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
