"""One simulated configuration of the 2-rank benchmark: its inputs (:class:`ValidationInputs`), a simulated run
of it, the prediction averaged over seeds, and the fit of ddp's per-step overhead to a measured train wall."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.simulator.cluster import Cluster, Slowdown
from benchmarks.simulator.engine import SimResult, simulate_bsp, simulate_local_sgd, simulate_oscars
from benchmarks.simulator.policies import OscarsPolicy

__all__ = [
    "CONFIG_PARADIGMS",
    "DEV_BOX_NOOP_S",
    "DEV_BOX_ROUND_OVERHEAD_S",
    "ValidationInputs",
    "fit_ddp_overhead",
    "predict",
    "simulate_config",
]


# Machine inputs of the validation when the results JSON has no round history to derive them from, measured on
# the 2-vCPU development box (torch 2.13 CPU, 1 thread per rank) while other jobs shared it (read them as +-50%):
# * no-op slot: between 0.6 ms (batch-end-to-batch-end minus hook time of a real step, 1 device) and 1.7 ms
#   (the slow rank's no-op slots in a 2-rank oscars run, contended);
# * round overhead: per averaging, round wall minus busiest compute minus all-reduce in a 2-rank oscars history
#   at 1:3 (bookkeeping after the all-reduce, hooks between the last step and the averaging), about 3 ms.
DEV_BOX_NOOP_S = 1.0e-3
DEV_BOX_ROUND_OVERHEAD_S = 3.0e-3
# Configurations of benchmarks.heterogeneous and how the simulator runs them.
CONFIG_PARADIGMS = {
    "ddp": "ddp",
    "local_sgd": "local_sgd",
    "oscars-exact-uniform": "oscars",
    "oscars-exact-samples": "oscars",
    "oscars-alg1-uniform": "oscars_alg1",
    "oscars-alg1-samples": "oscars_alg1",
}


@dataclass(frozen=True)
class ValidationInputs:
    """Inputs of one simulated 2-rank configuration; the simulator predicts the end-to-end figures from them.

    Attributes:
        profile, spec: the benchmark's profile name and slowdown string.
        step_times: per-rank seconds per real step at the start, as the strategy measures them (emulated sleep,
            data loading and Lightning's per-step work included; barrier waits excluded).
        events: ``(rank, start_s, step time)``: a rank's step time from ``start_s`` on (time-varying profiles).
        factors: emulated factor per rank at the start.
        allreduce_s: one averaging all-reduce (parameters, buffers and control data).
        ddp_overhead_s: seconds a DDP step adds over the local step (gradient all-reduce, DDP hooks); not
            scaled by the emulator (it sleeps inside ``training_step``), unless ``emulator_scales_ddp_comm``
            (the old emulator, which slept in proportion to the whole batch).
        noop_s: one no-op slot. round_overhead_s: bookkeeping per averaging beyond the all-reduce.
        first_step_s: start-up transient added to every rank's first step.
        epoch_overhead_s: epoch turnover (validation is excluded from the measured train wall).
        load, load_time_s: per-rank sigma and correlation time of the machine's load (see :class:`Cluster`).
        samples, batch_size, epochs, val_check_interval, local_sgd_steps: the run's set-up.
        noise: per-step lognormal sigma. seeds: simulated runs averaged per prediction.
        sources: where every input came from.
    """

    profile: str
    spec: str
    step_times: tuple[float, ...]
    allreduce_s: float
    ddp_overhead_s: float
    events: tuple[tuple[int, float, float], ...] = ()
    factors: tuple[float, ...] = ()
    noop_s: float = DEV_BOX_NOOP_S
    round_overhead_s: float = DEV_BOX_ROUND_OVERHEAD_S
    first_step_s: float = 0.0
    epoch_overhead_s: float = 0.0
    load: tuple[float, ...] = ()
    load_time_s: float = 0.0
    emulator_scales_ddp_comm: bool = False
    samples: int = 65536
    batch_size: int = 64
    epochs: int = 4
    val_check_interval: float | None = 0.25
    local_sgd_steps: int = 16
    noise: float = 0.1
    seeds: int = 5
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def total_units(self) -> int:
        return self.samples // self.batch_size

    @property
    def units_per_epoch(self) -> int:
        return self.total_units // self.epochs

    def ddp_step_times(self) -> tuple[float, ...]:
        """Per-rank seconds of a DDP step before the barrier: the local step plus the per-step overhead."""
        scale = self.factors if self.emulator_scales_ddp_comm and self.factors else (1.0,) * len(self.step_times)
        return tuple(t + k * self.ddp_overhead_s for t, k in zip(self.step_times, scale))

    def cluster(self, paradigm: str) -> Cluster:
        """The simulated 2 ranks: ddp's steps carry its overhead; local SGD / oscars pay no-op slots."""
        ddp = paradigm == "ddp"
        times = self.ddp_step_times() if ddp else self.step_times
        extra = self.ddp_overhead_s if ddp else 0.0
        slowdowns = tuple(Slowdown(rank, start, (target + extra) / times[rank]) for rank, start, target in self.events)
        return Cluster(
            times,
            noise=self.noise,
            slowdowns=slowdowns,
            noop_s=0.0 if ddp else self.noop_s,
            load=self.load or 0.0,
            load_time_s=self.load_time_s,
        )

    def scaled(self, step: float = 1.0, allreduce: float = 1.0) -> ValidationInputs:
        """The same inputs with every step time (and scheduled change) x ``step``, the all-reduce x ``allreduce``."""
        return replace(
            self,
            step_times=tuple(t * step for t in self.step_times),
            events=tuple((r, s, t * step) for r, s, t in self.events),
            allreduce_s=self.allreduce_s * allreduce,
        )


def fit_ddp_overhead(inputs: ValidationInputs, measured_s: float) -> float:
    """ddp's per-step overhead that makes the simulated train wall equal ``measured_s`` (>= 0; one secant step).

    The wall grows almost linearly with the overhead, slightly faster than ``steps x overhead`` because the load
    factor scales the whole step and each step waits for the slower rank.
    """
    per_rank = inputs.total_units / len(inputs.step_times)
    at_zero = predict(replace(inputs, ddp_overhead_s=0.0), "ddp")["train_s"]
    guess = max(0.0, (measured_s - at_zero) / per_rank)
    if guess == 0.0:
        return 0.0
    slope = (predict(replace(inputs, ddp_overhead_s=guess), "ddp")["train_s"] - at_zero) / guess
    return max(0.0, (measured_s - at_zero) / slope) if slope > 0 else guess


def simulate_config(
    inputs: ValidationInputs, paradigm: str, seed: int = 0, record_batch_size: int | None = None
) -> SimResult:
    """One simulated run of the 2-rank benchmark: ``paradigm`` is ddp, local_sgd, oscars or oscars_alg1.

    ddp's per-step overhead is part of every rank's step (no separate cost); local SGD and oscars run on the
    strategy's epoch plan with forced averagings at validation and ``round_overhead_s`` per averaging.
    """
    common: dict[str, Any] = {
        "units_per_epoch": inputs.units_per_epoch,
        "epoch_overhead_s": inputs.epoch_overhead_s,
        "first_step_s": inputs.first_step_s,
        "val_check_interval": inputs.val_check_interval,
        "record_batch_size": record_batch_size,
        "seed": seed,
    }
    cluster = inputs.cluster(paradigm)
    total = inputs.total_units
    if paradigm == "ddp":
        return simulate_bsp(cluster, total, allreduce_s=0.0, **common)
    common["round_overhead_s"] = inputs.round_overhead_s
    if paradigm == "local_sgd":
        return simulate_local_sgd(
            cluster, total, allreduce_s=inputs.allreduce_s, period=inputs.local_sgd_steps, **common
        )
    if paradigm in ("oscars", "oscars_alg1"):
        policy = OscarsPolicy(solver="alg1" if paradigm == "oscars_alg1" else "exact", name=paradigm)
        return simulate_oscars(cluster, total, allreduce_s=inputs.allreduce_s, policy=policy, **common)
    raise ValueError(f"unknown paradigm {paradigm!r}")


def predict(inputs: ValidationInputs, paradigm: str) -> dict[str, Any]:
    """Mean over ``inputs.seeds`` simulated runs of ``paradigm`` (ddp, local_sgd, oscars, oscars_alg1)."""
    runs = [simulate_config(inputs, paradigm, seed) for seed in range(inputs.seeds)]
    train = statistics.mean(r.wall_s for r in runs)
    return {
        "train_s": train,
        "samples_per_s": inputs.samples / train,
        "rounds": statistics.mean(r.rounds for r in runs),
        "utilization": statistics.mean(r.utilization for r in runs),
        "round_utilization": statistics.mean(r.round_utilization for r in runs),
        "final_local_steps": [list(s) for s in dict.fromkeys(r.final_local_steps for r in runs if r.final_local_steps)],
    }
