"""lightning-oscars: load-balanced local SGD for heterogeneous clusters, as a Lightning strategy.

Importing the package registers ``strategy="oscars"`` (and the fixed-period baseline ``"local_sgd"``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import Version

SUPPORTED_LIGHTNING = (">=2.6.0", "<2.7")


def _check_lightning() -> None:
    try:
        found = Version(version("lightning"))
    except PackageNotFoundError:  # pragma: no cover - the dependency is declared
        raise ImportError("lightning-oscars needs the 'lightning' package (>=2.6,<2.7)") from None
    if not (Version("2.6.0") <= found < Version("2.7")):
        raise ImportError(
            f"lightning-oscars supports lightning>=2.6.0,<2.7 (it relies on that release's loop internals);"
            f" found lightning=={found}. Install a supported release: pip install 'lightning>=2.6,<2.7'."
        )


_check_lightning()

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_oscars.heterogeneity import HeterogeneityEmulator, SlowdownProfile  # noqa: E402
from lightning_oscars.loader import LoadBalancedLoader  # noqa: E402
from lightning_oscars.monitor import ScheduleMonitor, round_metrics, summarize_history  # noqa: E402
from lightning_oscars.partition import EpochPlan, plan_rounds, planned_slots, round_quotas  # noqa: E402
from lightning_oscars.solver import (  # noqa: E402
    Schedule,
    schedule_from_local_steps,
    solve_schedule,
    solve_schedule_alg1,
)
from lightning_oscars.strategy import OscarsStrategy, RoundRecord  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "EpochPlan",
    "HeterogeneityEmulator",
    "LoadBalancedLoader",
    "OscarsStrategy",
    "RoundRecord",
    "Schedule",
    "ScheduleMonitor",
    "SlowdownProfile",
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
}
for _name, (_description, _params) in _REGISTERED.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, OscarsStrategy, description=_description, **_params)
