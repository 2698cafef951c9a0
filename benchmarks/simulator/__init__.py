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
* Local SGD and oscars run on the strategy's own round logic: rank 0's ``lightning_oscars.core.rounds.RoundController``
  (every rank computes the same outcome from the same control data) plans and sizes every epoch, lays out the
  warm-up round, takes every averaging's control data, keeps the ledger of round costs and the records, re-solves,
  re-plans, re-sizes the epoch and settles the warm-up, as it does in ``OscarsStrategy``; the schedule policy is the
  strategy's ``SchedulePolicy`` (solver, snapping, smoothing, re-balancing, the epoch-slot bound). The simulator
  keeps no copy of any of it. It simulates what the ranks do and measure: which slots each rank trains in (the
  plan's ``Round.real_offsets``; in the time-boxed warm-up the slots a rank starts before the slowest has taken its
  ``warmup_steps``), every slot's seconds, the clock, and every rank's row of the control data as
  ``RoundController.contribution`` writes it (``engine.rank_reports``; a test checks the two agree): the median of
  its measured steps (a step's interval includes the no-op slots since the rank's previous step), their standard
  error, its compute and, one averaging late as the wire carries them, its all-reduce and the part of its round
  not spent in its own steps, from which the controller's ledger prices a round's fixed cost (the median of recent
  rounds'; known from averaging 3 on). Rounds end where Lightning validates (the plan's boundaries); after a
  mid-epoch re-size the validations owed are re-placed as the adapter does (``validations_after_resize``), and one
  that falls inside a round forces an extra averaging there.
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
simulator's names), ``engine`` (the round controller on a simulated clock, ``simulate*``, ``SimResult``),
``study`` (scaling study, speed mixes), ``measured`` (readers and fits of the measured runs), ``inputs``
(validation inputs: the machine's and per configuration), ``prediction`` (a configuration's simulated runs and
prediction), ``validation`` (validation, sensitivity), ``report`` (markdown, plot), ``cli``.
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
