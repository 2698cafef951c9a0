"""The schedule policies the simulator runs: the strategy's own :class:`~lightning_oscars.core.policy.SchedulePolicy`.

The simulator keeps no policy logic of its own: solver, snapping, smoothing, the re-balancing rule and the
epoch-slot bound are the shared object's. These two classes only name a configuration (``name`` is the
paradigm a :class:`~benchmarks.simulator.engine.SimResult` reports) and keep the simulator's argument names.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_oscars.core.policy import SchedulePolicy, Solver
from lightning_oscars.core.solver import DEFAULT_MAX_SPREAD

__all__ = ["FixedPolicy", "OscarsPolicy"]


class FixedPolicy(SchedulePolicy):
    """The same ``steps`` local steps on every rank every round: BSP (1) or fixed-period local SGD (H).

    ``OscarsStrategy(solver="uniform", max_local_steps=steps)``'s policy.
    """

    def __init__(self, steps: int, name: str = "local_sgd") -> None:
        super().__init__("uniform", max_local_steps=steps)
        self.name = name

    @property
    def steps(self) -> int:
        return self.max_local_steps


class OscarsPolicy(SchedulePolicy):
    """Oscars as ``OscarsStrategy`` runs it: a :class:`SchedulePolicy` under the simulator's argument names.

    Args:
        solver: ``"exact"`` (snapped step times, communication-aware) or ``"alg1"`` (the paper's Algorithm 1 on
            the raw times, blind to the all-reduce cost), as the strategy's option.
        tolerance: the strategy's ``efficiency_tolerance``.
        resolve: re-solve on drift (the strategy's behaviour, also after ``initial_step_times``); ``False``
            keeps the first schedule.
        initial_step_times / initial_allreduce_s: solve before the first round from these (an oracle, or the
            strategy's pinned ``step_times``) instead of a warm-up round. The simulator's engine hands the policy
            ``initial_allreduce_s`` as the cost at the first averaging (an oracle knows it from the start).
        timed_warmup: the strategy's option: the warm-up round lasts until the slowest rank has taken
            ``warmup_steps``, faster ranks training meanwhile (``False``: every rank takes ``warmup_steps``).
        name: the paradigm reported in the results.
    """

    def __init__(
        self,
        warmup_steps: int = 4,
        max_spread: int = DEFAULT_MAX_SPREAD,
        max_local_steps: int = 16,
        tolerance: float = 0.02,
        rebalance_threshold: float = 0.2,
        min_gain: float = 0.02,
        smoothing: float = 0.5,
        solver: Solver = "exact",
        resolve: bool = True,
        initial_step_times: Sequence[float] | None = None,
        initial_allreduce_s: float = 0.0,
        timed_warmup: bool = True,
        name: str = "oscars",
    ) -> None:
        super().__init__(
            solver,
            max_spread=max_spread,
            max_local_steps=max_local_steps,
            tolerance=tolerance,
            warmup_steps=warmup_steps,
            rebalance_threshold=rebalance_threshold,
            min_gain=min_gain,
            smoothing=smoothing,
            step_times=initial_step_times,
            resolve=resolve,
            initial_allreduce_s=initial_allreduce_s,
        )
        self.name = name
        self.timed_warmup = timed_warmup
        if self.pinned_step_times is not None:  # the world size is known: solve now (``begin`` solves again)
            self.begin(len(self.pinned_step_times))
