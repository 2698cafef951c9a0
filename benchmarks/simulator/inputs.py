"""Inputs of the validation: the machine's (shared by every profile) and one :class:`ValidationInputs` per
configuration of a profile, derived from the measured runs (command-line overrides first)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.simulator.measured import (
    all_strategy_runs,
    as_number,
    configs_of,
    constant_profiles,
    curve_transient,
    curve_turnover,
    elementwise_median,
    first_round_transient,
    fit_round_costs,
    history_of,
    is_time_varying,
    parse_slowdown,
    profile_spec,
    regime_step_times,
    results_profiles,
    results_setup,
    round_residuals,
    run_allreduce,
    run_load,
    run_step_times,
    runs_of,
    solo_times,
    step_time_model,
)
from benchmarks.simulator.prediction import (
    DEV_BOX_NOOP_S,
    DEV_BOX_ROUND_OVERHEAD_S,
    ValidationInputs,
    fit_ddp_overhead,
)
from benchmarks.task import parse_profile

__all__ = ["machine_inputs", "validation_inputs"]

# ---------------------------------------------------------------------------------------------- machine inputs

Choice = tuple[Any, str]  # a value and where it came from


def _choose(key: str, overrides: Mapping[str, Any], options: Sequence[Choice | None], default: Choice) -> Choice:
    """The command line's value, else the first option found in the measurements, else the default."""
    if overrides.get(key) is not None:
        return float(overrides[key]), "cli"
    return next((option for option in options if option is not None), default)


def _median_option(values: Sequence[float], source: str) -> Choice | None:
    return (max(0.0, statistics.median(values)), source) if values else None


def _measured_options(
    results: Mapping[str, Any], batch: int, epochs: int
) -> dict[str, tuple[list[Choice | None], Choice]]:
    """Per machine input: what the round histories and ddp's validation times give, and the default."""
    strategy_runs = all_strategy_runs(results)
    ddp_runs = [r for s in results_profiles(results).values() for r in runs_of(configs_of(s).get("ddp"))]
    rows = [row for run in strategy_runs for row in round_residuals(run, batch)]
    fitted = fit_round_costs(rows)
    fit = f"fit of {len(rows)} rounds of {sum(1 for r in strategy_runs if history_of(r))} histories"
    transients = [first_round_transient(r, run_step_times(r, batch), batch) for r in strategy_runs]
    transients = [t for t in transients if t is not None]
    ddp_transients = [t for t in (curve_transient(r) for r in ddp_runs) if t is not None]
    turnovers = [t for t in (curve_turnover(r, epochs) for r in ddp_runs) if t is not None]
    return {
        "noop_s": ([(fitted[0], fit) if fitted else None], (DEV_BOX_NOOP_S, "default (no round history)")),
        "round_overhead_s": (
            [(fitted[1], fit) if fitted else None],
            (DEV_BOX_ROUND_OVERHEAD_S, "default (no round history)"),
        ),
        "first_step_s": (
            [
                _median_option(transients, f"first round of {len(transients)} histories"),
                _median_option(ddp_transients, f"ddp's first validation, {len(ddp_transients)} runs"),
            ],
            (0.0, "default"),
        ),
        "epoch_overhead_s": (
            [_median_option(turnovers, f"ddp's validation gaps across epoch ends, {len(turnovers)} runs")],
            (0.0, "default"),
        ),
    }


def _load_choices(results: Mapping[str, Any], overrides: Mapping[str, Any], batch: int, noise: float) -> list[Choice]:
    """The load sigma (``None``: per profile and rank, from the runs) and its correlation time."""
    loads = [run_load(r, batch, noise) for r in all_strategy_runs(results, constant_profiles(results))]
    load_times = [x[1] for x in loads if x and x[1] is not None]
    history = "per profile and rank, from the rounds' step times" if any(loads) else "none (no history)"
    load = (float(overrides["load"]), "cli") if overrides.get("load") is not None else (None, history)
    autocorrelation = f"lag-1 autocorrelation of the rounds' step times, {len(load_times)} runs"
    options = [(statistics.median(load_times), autocorrelation) if load_times else None]
    return [load, _choose("load_time_s", overrides, options, (0.0, "default"))]


def _ddp_overhead_choice(results: Mapping[str, Any], overrides: Mapping[str, Any], values: Mapping[str, Any]) -> Choice:
    """ddp's per-step overhead: the command line's, else fitted on the homogeneous profile's ddp runs."""
    if overrides.get("ddp_overhead_s") is not None:
        return float(overrides["ddp_overhead_s"]), "cli"
    homogeneous = results_profiles(results).get("homogeneous")
    measured = as_number(configs_of(homogeneous).get("ddp", {}).get("median_train_wall_s"))
    if not measured:
        return None, "fit to each profile's own ddp runs (no homogeneous profile): not a prediction"
    base = validation_inputs(results, "homogeneous", {**values, "ddp_overhead_s": 0.0}, config="ddp")
    return fit_ddp_overhead(base, measured), "fit to the homogeneous ddp runs"


def machine_inputs(results: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Inputs shared by every profile (the machine and Lightning, not the slowdown), with their sources.

    Command line (``overrides``) over what the round histories and ddp's validation times give over defaults.
    ddp's per-step overhead is fitted on the homogeneous profile (``None`` when absent: each profile's ddp is
    then fitted to itself).
    """
    overrides = dict(overrides or {})
    batch = int(overrides.get("batch_size") or 64)
    setup = results_setup(results)
    values: dict[str, Any] = {"batch_size": batch, **setup}
    sources: dict[str, str] = {}
    for key, (options, default) in _measured_options(results, batch, setup["epochs"]).items():
        values[key], sources[key] = _choose(key, overrides, options, default)
    values["noise"] = float(overrides["noise"]) if overrides.get("noise") is not None else 0.1
    load, load_time = _load_choices(results, overrides, batch, values["noise"])
    (values["load"], sources["load"]), (values["load_time_s"], sources["load_time_s"]) = load, load_time
    values["seeds"] = int(overrides.get("seeds") or 5)
    values["emulator_scales_ddp_comm"] = bool(overrides.get("emulator_scales_ddp_comm", False))
    values["allreduce_s"] = overrides.get("allreduce_s")
    values["ddp_overhead_s"], sources["ddp_overhead_s"] = _ddp_overhead_choice(results, overrides, values)
    values["sources"] = sources
    return values


# ---------------------------------------------------------------------------------------------- per configuration


@dataclass(frozen=True)
class _StepModel:
    """Step time of every (rank, emulated factor): measured regimes, else ``a + b (k - 1)``, plus ddp's gap."""

    regimes: Mapping[tuple[int, float], float]
    factors: tuple[float, ...]
    changes: tuple[tuple[int, float, float], ...]
    a: float = 0.0
    b: float = 0.0
    gap: tuple[float, ...] = ()

    def step(self, rank: int, k: float) -> float:
        gap = self.gap[rank] if self.gap else 0.0
        return self.regimes.get((rank, k), self.a + self.b * (k - 1.0)) + (k - 1.0) * gap

    def step_times(self) -> tuple[float, ...]:
        return tuple(float(self.step(i, k)) for i, k in enumerate(self.factors))

    def events(self) -> tuple[tuple[int, float, float], ...]:
        return tuple((rank, start, self.step(rank, k)) for rank, start, k in self.changes)


def _varying_steps(
    results: Mapping[str, Any], profile: str, spec: str, runs: Sequence[Mapping[str, Any]], own: bool, batch: int
) -> tuple[_StepModel, str]:
    """A time-varying profile: the histories' rounds split by speed regime (nearest of ``t(k)``)."""
    model = step_time_model(results, batch)
    if model is None:
        raise ValueError(f"profile {profile!r} varies in time and no constant profiles give t(k)")
    a, b = model
    entries = parse_profile(spec)
    regimes = regime_step_times(runs, batch, entries, lambda k: a + b * (k - 1.0), 2)
    changes = tuple((rank, start, k) for rank, es in entries.items() for start, k in es if start > 0)
    steps = _StepModel(regimes, parse_slowdown(spec, 2, at_s=0.0), changes, a, b)
    if regimes:
        where = "own runs" if own else "profile's local SGD / oscars runs"
        return steps, f"{where}, rounds split by speed regime (nearest of t(k) = a + b (k-1))"
    return steps, f"t(k) = {a * 1e3:.2f} + {b * 1e3:.2f} (k-1) ms, fitted on the constant profiles"


def _constant_steps(
    profile: str, spec: str, own: Sequence[Mapping[str, Any]], pooled: Sequence[Mapping[str, Any]], batch: int
) -> tuple[_StepModel, str]:
    """A constant profile: the configuration's own runs' step times, else the profile's other strategy runs'."""
    times = elementwise_median([run_step_times(r, batch) for r in own])
    source = "own runs"
    if times is None:
        times = elementwise_median([run_step_times(r, batch) for r in pooled])
        source = "profile's local SGD / oscars runs"
    if not any(history_of(r) for r in (own or pooled)):
        source += " (no history: last round's smoothed times)"
    if times is None:
        raise ValueError(f"profile {profile!r}: no local SGD / oscars run gives step times")
    factors = parse_slowdown(spec, len(times), at_s=0.0)
    return _StepModel({(i, k): t for i, (t, k) in enumerate(zip(times, factors))}, factors, ()), source


def _ddp_gap(
    configs: Mapping[str, Any], pooled: Sequence[Mapping[str, Any]], steps: _StepModel, spec: str
) -> tuple[tuple[float, ...], str]:
    """ddp has no step times of its own: the strategy runs', with the emulated sleep ((k-1) x the rank's
    calibrated compute time) re-scaled to the ddp runs' own calibration."""
    ddp_solo, pooled_solo = solo_times(runs_of(configs.get("ddp"))), solo_times(pooled)
    if not (ddp_solo and pooled_solo and len(ddp_solo) == len(steps.factors) == len(pooled_solo)):
        return (), ""
    gap = tuple(d - p for d, p in zip(ddp_solo, pooled_solo))
    entries = parse_profile(spec)
    slowed = [i for i in range(len(gap)) if any(k != 1.0 for _, k in entries.get(i, []))]
    shifts = ", ".join(f"rank {i} {1e3 * gap[i]:+.2f} ms" for i in slowed)
    return gap, f"; sleep per (k-1) re-scaled to ddp's calibration ({shifts or 'no slow rank'})"


def _load_of(
    results: Mapping[str, Any],
    profile: str,
    runs: tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]],
    batch: int,
    noise: float,
    n: int,
) -> tuple[float, ...]:
    """Per-rank load sigma: the configuration's own runs, else the profile's, else every constant profile's."""
    own, pooled = runs

    def loads(of: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [(run_load(r, batch, noise) or ([], None))[0] for r in of]

    constant = profile in constant_profiles(results)
    load = (constant and elementwise_median(loads(own))) or ()
    if constant and not load:
        load = elementwise_median(loads(pooled)) or ()
    if not load:  # time-varying profile, or no history here: the median over every constant profile's ranks
        flat = [x for row in loads(all_strategy_runs(results, constant_profiles(results))) for x in row]
        load = (float(statistics.median(flat)),) * n if flat else ()
    return tuple(float(x) for x in load)


def _allreduce_of(
    results: Mapping[str, Any], own: Sequence[Mapping[str, Any]], pooled: Sequence[Mapping[str, Any]]
) -> Choice:
    """Median averaging cost of the configuration's own runs, else the profile's, else every profile's."""
    for runs, source in (
        (own, "own runs"),
        (pooled, "profile's local SGD / oscars runs"),
        (all_strategy_runs(results), "all profiles' runs"),
    ):
        costs = [c for c in (run_allreduce(r) for r in runs) if c]
        if costs:
            return float(statistics.median(costs)), source
    raise ValueError("no run gives an all-reduce cost; pass --allreduce-s")


def validation_inputs(
    results: Mapping[str, Any],
    profile: str,
    machine: Mapping[str, Any] | None = None,
    config: str | None = None,
) -> ValidationInputs:
    """Inputs of one configuration of one profile (``machine``: :func:`machine_inputs`, computed if absent).

    Step times and all-reduce cost: the configuration's own round histories (local SGD, oscars), else the
    median over the profile's local SGD / oscars runs (ddp, whose emulated sleep is re-scaled to its own
    runs' calibration), else the machine-wide all-reduce. A time-varying profile (``volatile``) splits the
    histories' rounds by speed regime (nearest of ``t(k) = a + b (k - 1)``, fitted on the constant profiles).
    """
    machine = dict(machine) if machine is not None else machine_inputs(results)
    batch = int(machine.get("batch_size") or 64)
    sources = dict(machine.get("sources", {}))
    spec = profile_spec(results, profile)
    configs = configs_of(results_profiles(results).get(profile))
    pooled = [r for name, c in configs.items() if name != "ddp" for r in runs_of(c)]
    own = runs_of(configs.get(config)) if config and config != "ddp" else []
    if is_time_varying(spec):
        steps, sources["step_times"] = _varying_steps(results, profile, spec, own or pooled, bool(own), batch)
    else:
        steps, sources["step_times"] = _constant_steps(profile, spec, own, pooled, batch)
    if config == "ddp":
        gap, note = _ddp_gap(configs, pooled, steps, spec)
        steps, sources["step_times"] = replace(steps, gap=gap), sources["step_times"] + note
    times = steps.step_times()
    noise = float(machine.get("noise", 0.1))
    if machine.get("load") is not None:
        load: tuple[float, ...] = (float(machine["load"]),) * len(times)
    else:
        load = _load_of(results, profile, (own, pooled), batch, noise, len(times))
    if machine.get("allreduce_s") is not None:
        allreduce, sources["allreduce_s"] = float(machine["allreduce_s"]), "cli"
    else:
        allreduce, sources["allreduce_s"] = _allreduce_of(results, own, pooled)
    inputs = _assemble(profile, spec, steps, times, allreduce, load, machine, sources)
    overhead = machine.get("ddp_overhead_s")
    if overhead is None:  # no homogeneous profile: fit this profile's ddp to itself
        measured = as_number(configs.get("ddp", {}).get("median_train_wall_s")) if config == "ddp" else None
        overhead = fit_ddp_overhead(inputs, measured) if measured else 0.0
    return replace(inputs, ddp_overhead_s=float(overhead))


def _assemble(
    profile: str,
    spec: str,
    steps: _StepModel,
    times: tuple[float, ...],
    allreduce: float,
    load: tuple[float, ...],
    machine: Mapping[str, Any],
    sources: Mapping[str, str],
) -> ValidationInputs:
    return ValidationInputs(
        profile=profile,
        spec=spec,
        step_times=times,
        allreduce_s=allreduce,
        ddp_overhead_s=0.0,
        events=steps.events(),
        factors=tuple(steps.factors),
        noop_s=float(machine.get("noop_s", DEV_BOX_NOOP_S)),
        round_overhead_s=float(machine.get("round_overhead_s", DEV_BOX_ROUND_OVERHEAD_S)),
        first_step_s=float(machine.get("first_step_s", 0.0)),
        epoch_overhead_s=float(machine.get("epoch_overhead_s", 0.0)),
        load=load,
        load_time_s=float(machine.get("load_time_s") or 0.0),
        emulator_scales_ddp_comm=bool(machine.get("emulator_scales_ddp_comm", False)),
        samples=int(machine.get("samples", 65536)),
        batch_size=int(machine.get("batch_size") or 64),
        epochs=int(machine.get("epochs", 4)),
        val_check_interval=machine.get("val_check_interval", 0.25),
        noise=float(machine.get("noise", 0.1)),
        seeds=int(machine.get("seeds", 5)),
        sources=dict(sources),
    )
