"""Validation against the measured 2-rank runs: predicted vs measured train wall and samples/s per configuration
of every profile, and the sensitivity of the error to each input."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.simulator.inputs import machine_inputs, validation_inputs
from benchmarks.simulator.measured import as_number, configs_of, history_of, profile_spec, results_profiles, runs_of
from benchmarks.simulator.prediction import CONFIG_PARADIGMS, ValidationInputs, predict

__all__ = ["sensitivity", "validate_against"]


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1.0


def _measured(config: Mapping[str, Any]) -> dict[str, Any]:
    """The measured figures of one configuration (medians over runs); missing fields become None."""
    runs = runs_of(config)
    walls = [w for w in (as_number(r.get("train_wall_s")) for r in runs) if w]
    rates = [x for x in (as_number(r.get("samples_per_s")) for r in runs) if x]
    rounds = [len(history_of(r)) or as_number(r.get("rounds")) for r in runs]
    rounds = [x for x in rounds if x]
    return {
        "train_s": as_number(config.get("median_train_wall_s")) or (statistics.median(walls) if walls else None),
        "walls": walls,
        "samples_per_s": as_number(config.get("median_samples_per_s")) or (statistics.median(rates) if rates else None),
        "rounds": statistics.median(rounds) if rounds else None,
        "schedules": [r.get("schedule") for r in runs if r.get("schedule")],
    }


def _profile_names(results: Mapping[str, Any], wanted: Sequence[str] | None) -> list[str]:
    names = list(results_profiles(results))
    return [p for p in names if p in wanted] if wanted else names


def _config_row(results: Mapping[str, Any], profile: str, machine: Mapping[str, Any], name: str) -> dict[str, Any]:
    """One configuration of one profile: its inputs, the prediction, the measurement and the errors."""
    paradigm = CONFIG_PARADIGMS[name]
    inputs = validation_inputs(results, profile, machine, config=name)
    predicted = predict(inputs, paradigm)
    measured = _measured(configs_of(results_profiles(results)[profile])[name])
    return {
        "config": name,
        "paradigm": paradigm,
        "inputs": {
            "step_times": list(inputs.step_times),
            "allreduce_s": inputs.allreduce_s,
            "ddp_overhead_s": inputs.ddp_overhead_s,
            "events": [list(e) for e in inputs.events],
            "sources": {k: inputs.sources[k] for k in ("step_times", "allreduce_s")},
        },
        "predicted": predicted,
        "measured": measured,
        "error": {
            "train_s": _rel(predicted["train_s"], measured["train_s"]),
            "samples_per_s": _rel(predicted["samples_per_s"], measured["samples_per_s"]),
            "rounds": _rel(predicted["rounds"], measured["rounds"]) if paradigm != "ddp" else None,
        },
    }


def _speedups(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Predicted and measured train-wall speed-up over ddp of local SGD and oscars."""
    by_name = {r["config"]: r for r in rows}
    speedups = {}
    for name in ("local_sgd", "oscars-exact-uniform"):
        if "ddp" in by_name and name in by_name:
            p = by_name["ddp"]["predicted"]["train_s"] / by_name[name]["predicted"]["train_s"]
            m_d, m_o = by_name["ddp"]["measured"]["train_s"], by_name[name]["measured"]["train_s"]
            m = m_d / m_o if m_d and m_o else None
            speedups[name] = {"predicted": p, "measured": m, "error": _rel(p, m)}
    return speedups


def validate_against(results_json_path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Predict every profile's ddp, local SGD and oscars train wall and samples/s; compare with the measurements.

    ``overrides``: command-line inputs (keys of :func:`machine_inputs`, ``allreduce_s`` for every profile) and
    ``profiles`` (a subset to validate). Train wall excludes validation, as the benchmark measures it.
    """
    results = json.loads(Path(results_json_path).read_text())
    overrides = dict(overrides or {})
    machine = machine_inputs(results, overrides)
    out: dict[str, Any] = {
        "machine": {k: v for k, v in machine.items() if k != "sources"},
        "sources": machine["sources"],
    }
    out["profiles"] = {}
    for profile in _profile_names(results, overrides.get("profiles")):
        configs = configs_of(results_profiles(results)[profile])
        rows = [_config_row(results, profile, machine, name) for name in CONFIG_PARADIGMS if name in configs]
        out["profiles"][profile] = {
            "spec": profile_spec(results, profile),
            "rows": rows,
            "speedup_vs_ddp": _speedups(rows),
        }
    errors = [
        abs(r["error"]["train_s"])
        for p in out["profiles"].values()
        for r in p["rows"]
        if r["error"]["train_s"] is not None and not (r["paradigm"] == "ddp" and ddp_is_fit(out, p))
    ]
    out["max_abs_train_error"] = max(errors) if errors else None
    return out


def ddp_is_fit(report: Mapping[str, Any], profile_report: Mapping[str, Any]) -> bool:
    """ddp's row is a fit, not a prediction: on the homogeneous profile, or everywhere without one."""
    source = report["sources"].get("ddp_overhead_s", "")
    if source.startswith("fit to each profile"):
        return True
    return source.startswith("fit to the homogeneous") and profile_report.get("spec") == ""


Variant = tuple[str, Callable[[ValidationInputs], ValidationInputs]]


def _variants(noop: float, over: float) -> list[Variant]:
    """The input changes the sensitivity table tries, each a label and a change of the inputs."""
    return [
        ("as above", lambda i: i),
        ("no-op slot 0", lambda i: replace(i, noop_s=0.0)),
        (f"no-op slot x2 ({2e3 * noop:.2f} ms)", lambda i: replace(i, noop_s=2 * i.noop_s)),
        ("round overhead 0", lambda i: replace(i, round_overhead_s=0.0)),
        (f"round overhead x2 ({2e3 * over:.2f} ms)", lambda i: replace(i, round_overhead_s=2 * i.round_overhead_s)),
        ("step times x0.9", lambda i: i.scaled(step=0.9)),
        ("step times x1.1", lambda i: i.scaled(step=1.1)),
        ("all-reduce x2", lambda i: i.scaled(allreduce=2.0)),
        ("start-up transient 0", lambda i: replace(i, first_step_s=0.0)),
        ("epoch turnover +0.05 s", lambda i: replace(i, epoch_overhead_s=i.epoch_overhead_s + 0.05)),
        ("load 0", lambda i: replace(i, load=())),
        ("noise sigma 0", lambda i: replace(i, noise=0.0)),
        ("noise sigma 0.2", lambda i: replace(i, noise=0.2)),
        ("ddp overhead x0.5", lambda i: replace(i, ddp_overhead_s=0.5 * i.ddp_overhead_s)),
        ("ddp overhead x1.5", lambda i: replace(i, ddp_overhead_s=1.5 * i.ddp_overhead_s)),
    ]


def sensitivity(
    results_json_path: str | Path, overrides: Mapping[str, Any] | None = None, profile: str | None = None
) -> dict[str, Any]:
    """Train-wall error of ddp, local SGD and oscars on one profile when one input moves.

    Why: the inputs were measured on a shared 2-vCPU box; an error that flips sign within their plausible range
    says the inputs, not the model, limit the check.
    """
    results = json.loads(Path(results_json_path).read_text())
    overrides = dict(overrides or {})
    names = _profile_names(results, overrides.get("profiles"))
    if profile is None:
        profile = next((p for p in ("1x/3x", "1x/5x", "1x/2x") if p in names), names[0] if names else None)
    if profile is None:
        return {"profile": None, "rows": []}
    machine = machine_inputs(results, overrides)
    configs = configs_of(results_profiles(results)[profile])
    chosen = [c for c in ("ddp", "local_sgd", "oscars-exact-uniform") if c in configs]
    base = {c: validation_inputs(results, profile, machine, config=c) for c in chosen}
    measured = {c: _measured(configs[c])["train_s"] for c in chosen}
    rows = []
    for label, change in _variants(base[chosen[0]].noop_s, base[chosen[0]].round_overhead_s):
        row: dict[str, Any] = {"variant": label}
        for c in chosen:
            row[c] = _rel(predict(change(base[c]), CONFIG_PARADIGMS[c])["train_s"], measured[c])
        rows.append(row)
    return {"profile": profile, "configs": chosen, "rows": rows}
