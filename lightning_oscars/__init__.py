"""lightning-oscars: load-balanced local SGD for heterogeneous clusters, as a Lightning strategy.

Importing the package registers ``strategy="oscars"`` (and the fixed-period baseline ``"local_sgd"``), and the
parameter-server paradigms ``"bsp"``, ``"asp"``, ``"ssp"``, ``"dssp"`` and ``"dasp"``."""

from __future__ import annotations

from typing import Any

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
from lightning_oscars.schemes import ModelAveraging, SyncScheme, adaptive_rounds, every_step, fixed_period
from lightning_oscars.solver import (
    Schedule,
    schedule_from_local_steps,
    solve_schedule,
    solve_schedule_alg1,
)
from lightning_oscars.strategy import OscarsStrategy

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
    "RoundRecord",
    "SSPStrategy",
    "StepSyncStrategy",
    "SUPPORTED_LIGHTNING",
    "Schedule",
    "ScheduleMonitor",
    "SchedulePolicy",
    "SlowdownProfile",
    "SyncScheme",
    "adaptive_rounds",
    "check_lightning_version",
    "every_step",
    "fixed_period",
    "plan_rounds",
    "planned_slots",
    "round_metrics",
    "round_quotas",
    "schedule_from_local_steps",
    "solve_schedule",
    "solve_schedule_alg1",
    "summarize_history",
]

_REGISTERED: dict[str, tuple[str, dict[str, Any]]] = {
    "oscars": ("Load-balanced local SGD (Oscars), exact communication-aware solver", {}),
    "oscars_alg1": ("Load-balanced local SGD with the paper's Algorithm 1 solver", {"solver": "alg1"}),
    "local_sgd": ("Fixed-period local SGD: the same local steps on every rank", {"solver": "uniform"}),
    "every_step_averaging": (
        "Model averaging after every optimizer step (ddp's trajectory for plain SGD, without DDP's wrapper)",
        {"solver": "uniform", "max_local_steps": 1},
    ),
}
for _name, (_description, _params) in _REGISTERED.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, OscarsStrategy, description=_description, **_params)
for _name, (_cls, _description) in PARADIGMS.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _cls, description=_description)
