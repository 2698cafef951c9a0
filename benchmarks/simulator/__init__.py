"""Discrete-event simulator of a heterogeneous cluster: BSP (ddp) vs fixed-period local SGD vs oscars.

    python -m benchmarks.simulator --out benchmarks/results
    python -m benchmarks.simulator --validate benchmarks/results/heterogeneous.json --out benchmarks/results
    python -m benchmarks.simulator --validate benchmarks/results/heterogeneous.json --noop-s 0.001 --no-study

Writes ``simulator.json``, ``simulator.md`` (validation tables and scaling tables) and ``simulator.png`` (fraction
of the ideal throughput and utilisation vs number of ranks, one panel per speed mix) to ``--out``.

Why: the real benchmark (``benchmarks.heterogeneous``) has 2 CPU ranks. The simulator, checked against those
2-rank measurements, extrapolates the three paradigms to 8 .. 1,024 ranks, where the questions that matter are
whether the barrier waits, the per-step noise of many ranks and the all-reduce latency term eat the gain.

Model and assumptions (what the numbers do and do not include):

* Every rank ``i`` has a mean step time ``t_i`` (seconds per optimizer step, data loading included). A step's
  time is ``t_i * f_i(t) * e`` with ``e`` lognormal of mean 1 (``sigma`` = ``noise``), independent across steps
  and ranks, and ``f_i(t)`` an optional piecewise-constant slowdown profile ("rank r is k x slower from t s"),
  read at the start of each round (exact for BSP, whose rounds are one step). ``first_step_s`` is added to
  every rank's first step (start-up transient: allocator, first batch, first optimizer step). An optional
  load factor (mean-1 lognormal per rank, AR(1) in time) scales whole rounds: a shared machine's load, which
  unlike per-step noise moves the per-round medians the strategy re-solves on.
* A round: rank ``i`` runs ``tau_i`` local steps, then idles through ``max tau - tau_i`` no-op slots at
  ``noop_s`` each (the strategy's lock-step slots: Lightning still runs its loop around an empty batch; the
  scaling study takes 0, the 2-rank CPU benchmark about 1 ms), waits at the barrier for the last rank, then
  every rank pays one all-reduce of the model plus ``round_overhead_s`` of bookkeeping. BSP is the round with
  ``tau_i = 1`` whose all-reduce (of the gradients, same size) is hidden behind backward by ``overlap``.
* All-reduce cost: ring, ``2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency`` (0 for one rank); no topology,
  no congestion, the same every round, no overlap of local SGD's averaging with compute.
* Local SGD and oscars run on the strategy's own epoch plan (``lightning_oscars.partition.EpochPlan``): every
  rank iterates the same slots, a round takes the next ``sum tau_i`` units of the epoch, the last rounds of an
  epoch shrink to the data left. Validation every ``val_check_interval`` of the epoch's slots forces an extra
  averaging when it falls inside a round (the strategy averages before validating).
* Oscars is the strategy's own schedule policy (``lightning_oscars.policy.SchedulePolicy``, the object
  ``OscarsStrategy`` drives; the simulator keeps no copy): a time-boxed warm-up round (every rank its
  ``warmup_steps``, faster ranks every step they start before the slowest has taken its own, as the strategy's
  ``timed_warmup``); per averaging the median of each rank's step times, smoothed by an EMA (``smoothing``);
  step times within 5% of each other snapped to their group's slowest before the exact solver runs; re-balancing
  (``lightning_oscars.solver.rebalance``): a re-solve happens when a rank's smoothed time, or the all-reduce
  cost relative to the round (``|c_new - c_old| / (T + c_old)``), drifted by more than ``rebalance_threshold``,
  or when the cost first becomes known (the first solve saw 0), and is adopted only if predicted ``min_gain``
  faster. The engine models the wire format's lag: the all-reduce cost the policy sees is the previous
  averaging's (0 at the first solve). A new schedule re-plans the epoch at the next round boundary. An epoch
  that starts before the speeds are known is sized as the policy's upper bound (``epoch_slot_bound``, the
  strategy's loader length) and cut to the slots it needs as soon as the first schedule is solved.
* Validation (``--validate``, the ``{"meta", "profiles"}`` JSON of ``benchmarks.heterogeneous``): per profile
  the inputs come from the measured runs: per-rank step times and all-reduce cost from the strategy's round
  history (each local SGD / oscars configuration its own, ddp the profile's pooled ones), the no-op slot and
  per-averaging overhead from a fit of every round's wall time across all histories, the start-up transient
  from the first round, the load (per rank) and its correlation time from how the rounds' mean step times
  vary, the epoch turnover from ddp's validation times, and ddp's per-step overhead (gradient
  all-reduce, DDP hooks) fitted once on the homogeneous profile (on the profile itself when that is absent:
  then ddp's row is a fit, not a prediction). The simulator predicts train wall (validation excluded) and
  samples/s; a sensitivity table shows how the error moves with each input.
* Outputs are systems figures: optimizer steps per second summed over ranks (= samples/s / batch size),
  utilisation (compute time / (N x wall)) and per-rank idle fraction (barrier waits and no-op slots / wall).
  Statistical efficiency (accuracy per step of local SGD vs BSP) is not modelled.

Modules: ``cluster`` (ranks, noise, load, slowdowns, ring all-reduce), ``policies`` (the shared policy under the
simulator's names), ``engine`` (rounds on the epoch plan, ``simulate*``, ``SimResult``), ``study`` (scaling
study, speed mixes), ``measured`` (readers and fits of the measured runs), ``inputs`` (validation inputs: the
machine's and per configuration), ``prediction`` (a configuration's simulated runs and prediction),
``validation`` (validation, sensitivity), ``report`` (markdown, plot), ``cli``.
"""

from benchmarks.simulator.cli import main
from benchmarks.simulator.cluster import Cluster, Slowdown, ring_allreduce_time
from benchmarks.simulator.cluster import fit_to_remaining as _fit_to_remaining
from benchmarks.simulator.cluster import row_medians as _row_medians
from benchmarks.simulator.engine import SimResult, simulate, simulate_bsp, simulate_local_sgd, simulate_oscars
from benchmarks.simulator.inputs import machine_inputs, validation_inputs
from benchmarks.simulator.measured import (
    curve_transient,
    curve_turnover,
    first_round_transient,
    fit_round_costs,
    parse_slowdown,
    round_residuals,
    run_allreduce,
    run_load,
    run_step_times,
)
from benchmarks.simulator.policies import FixedPolicy, OscarsPolicy
from benchmarks.simulator.prediction import (
    CONFIG_PARADIGMS,
    ValidationInputs,
    fit_ddp_overhead,
    predict,
    simulate_config,
)
from benchmarks.simulator.report import plot, scaling_markdown, sensitivity_markdown, validation_markdown
from benchmarks.simulator.study import MIXES, PARADIGMS, RANKS, StudyConfig, mix_step_times, scaling_study
from benchmarks.simulator.validation import sensitivity, validate_against
from benchmarks.task import parse_profile

__all__ = [
    "CONFIG_PARADIGMS",
    "MIXES",
    "PARADIGMS",
    "RANKS",
    "Cluster",
    "FixedPolicy",
    "OscarsPolicy",
    "SimResult",
    "Slowdown",
    "StudyConfig",
    "ValidationInputs",
    "_fit_to_remaining",
    "_row_medians",
    "curve_transient",
    "curve_turnover",
    "first_round_transient",
    "fit_ddp_overhead",
    "fit_round_costs",
    "machine_inputs",
    "main",
    "mix_step_times",
    "parse_profile",
    "parse_slowdown",
    "plot",
    "predict",
    "ring_allreduce_time",
    "round_residuals",
    "run_allreduce",
    "run_load",
    "run_step_times",
    "scaling_markdown",
    "scaling_study",
    "sensitivity",
    "sensitivity_markdown",
    "simulate",
    "simulate_bsp",
    "simulate_config",
    "simulate_local_sgd",
    "simulate_oscars",
    "validate_against",
    "validation_inputs",
    "validation_markdown",
]
