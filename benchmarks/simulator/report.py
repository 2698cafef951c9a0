"""The simulator's report: markdown for the validation, its sensitivity and the scaling study, and the plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.simulator.prediction import CONFIG_PARADIGMS
from benchmarks.simulator.study import PARADIGMS, StudyConfig
from benchmarks.simulator.validation import ddp_is_fit
from benchmarks.tables import markdown_table
from lightning_oscars.core.solver import DEFAULT_MAX_SPREAD

__all__ = ["plot", "scaling_markdown", "sensitivity_markdown", "validation_markdown"]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ms(times: Sequence[float]) -> str:
    return "/".join(f"{1e3 * t:.2f}" for t in times)


def _machine_paragraph(m: Mapping[str, Any], src: Mapping[str, str]) -> str:
    ddp_ov = m.get("ddp_overhead_s")
    return (
        f"Machine inputs (every profile): no-op slot {m['noop_s'] * 1e3:.2f} ms, per-averaging overhead "
        f"{m['round_overhead_s'] * 1e3:.2f} ms, start-up transient {m['first_step_s']:.3f} s, epoch turnover "
        f"{m['epoch_overhead_s']:.3f} s, ddp per-step overhead "
        + ("fitted per profile" if ddp_ov is None else f"{ddp_ov * 1e3:.2f} ms")
        + f"; per-step noise sigma {m['noise']}, {m['seeds']} seeds per prediction; {m['samples']} samples, "
        f"{m['epochs']} epochs, batch {m['batch_size']}, validation every {_num(m['val_check_interval'])} epoch "
        "(excluded from train wall, its forced averagings simulated). Sources: "
        + "; ".join(f"{k}: {v}" for k, v in src.items())
        + ". Step times and all-reduce per configuration: its own round histories (ddp: the profile's local SGD /"
        " oscars runs). Train wall = training time without validation, from after the start-up calibration."
    )


def _error_summary(report: Mapping[str, Any]) -> list[str]:
    """Train-wall error of every configuration, one line per profile, and the oscars/ddp speed-up."""
    configs = [c for c in CONFIG_PARADIGMS if any(c in _row_names(p) for p in report["profiles"].values())]
    rows = []
    for profile, p in report["profiles"].items():
        by_config = {r["config"]: r for r in p["rows"]}
        cells = []
        for c in configs:
            if c not in by_config:
                cells.append("-")
                continue
            text = _pct(by_config[c]["error"]["train_s"])
            cells.append(text + (" fit" if c == "ddp" and ddp_is_fit(report, p) else ""))
        s = p["speedup_vs_ddp"].get("oscars-exact-uniform")
        speed = f"{s['predicted']:.2f}x ({_num(s['measured'])}x)" if s else "-"
        rows.append([profile, *cells, speed])
    headers = ["profile", *configs, "oscars/ddp speed-up predicted (measured)"]
    return [
        "Train-wall error per profile (predicted / measured - 1; `fit` = ddp fitted there, not predicted). "
        f"Largest |error| of the predictions: {_pct(report.get('max_abs_train_error')).lstrip('+')} (target 15%).",
        "",
        *markdown_table(headers, rows, "l" + "r" * (len(configs) + 1)),
    ]


_PROFILE_HEADERS = [
    "config",
    "step times ms",
    "all-reduce ms",
    "train s predicted",
    "train s measured (runs)",
    "error",
    "samples/s predicted",
    "measured",
    "error",
    "averagings predicted",
    "measured",
    "final tau predicted",
    "measured",
]


def _profile_row(r: Mapping[str, Any]) -> list[str]:
    """One configuration's inputs, predicted and measured figures and errors."""
    pr, me, er, inp = r["predicted"], r["measured"], r["error"], r["inputs"]
    is_ddp = r["paradigm"] == "ddp"
    steps = _ms(inp["step_times"])
    if inp["events"]:
        steps += " then " + ", ".join(f"r{rank}: {1e3 * t:.2f} at {s:g} s" for rank, s, t in inp["events"])
    if is_ddp:
        steps += f" + {inp['ddp_overhead_s'] * 1e3:.2f}"
    walls = ", ".join(f"{w:.2f}" for w in me["walls"])
    return [
        r["config"],
        steps,
        "-" if is_ddp else f"{inp['allreduce_s'] * 1e3:.2f}",
        f"{pr['train_s']:.2f}",
        f"{_num(me['train_s'])} ({walls})",
        _pct(er["train_s"]),
        f"{pr['samples_per_s']:.0f}",
        _num(me["samples_per_s"], ".0f"),
        _pct(er["samples_per_s"]),
        "-" if is_ddp else f"{pr['rounds']:.0f}",
        "-" if is_ddp else _num(me["rounds"], ".0f"),
        _tau_list(pr["final_local_steps"]),
        _tau_list(me["schedules"]),
    ]


def _profile_section(profile: str, p: Mapping[str, Any]) -> list[str]:
    notes = {f"{r['config']}: step times from {r['inputs']['sources']['step_times']}" for r in p["rows"]}
    notes |= {
        f"{r['config']}: all-reduce from {r['inputs']['sources']['allreduce_s']}"
        for r in p["rows"]
        if r["paradigm"] != "ddp"
    }
    return [
        "",
        f"### {profile} (`{p['spec'] or 'equal speeds'}`)",
        "",
        *markdown_table(_PROFILE_HEADERS, [_profile_row(r) for r in p["rows"]], "llrrlrrrrrrll"),
        "",
        "Sources: " + "; ".join(sorted(notes)) + ".",
    ]


def validation_markdown(report: Mapping[str, Any]) -> list[str]:
    """Machine inputs, a summary of train-wall errors, then one table per profile."""
    lines = [
        "## Validation against the 2-rank benchmark",
        "",
        _machine_paragraph(report["machine"], report["sources"]),
        "",
        *_error_summary(report),
    ]
    for profile, p in report["profiles"].items():
        lines += _profile_section(profile, p)
    return lines


def _row_names(profile_report: Mapping[str, Any]) -> set[str]:
    return {r["config"] for r in profile_report["rows"]}


def _tau_list(schedules: Sequence[Any]) -> str:
    distinct = list(dict.fromkeys(tuple(s) for s in schedules if s))
    return " ".join(str(list(s)) for s in distinct) if distinct else "-"


def sensitivity_markdown(sens: Mapping[str, Any]) -> list[str]:
    """Train-wall error per input variant (see :func:`~benchmarks.simulator.validation.sensitivity`)."""
    if not sens.get("rows"):
        return []
    configs = sens["configs"]
    rows = [[r["variant"], *(_pct(r.get(c)) for c in configs)] for r in sens["rows"]]
    return [
        f"Sensitivity ({sens['profile']}): train-wall error when one input changes.",
        "",
        *markdown_table(["variant", *configs], rows, "l" + "r" * len(configs)),
    ]


_SCALING_HEADERS = [
    "N",
    "all-reduce ms",
    "ideal steps/s",
    *(f"{label} {figure}" for label in ("BSP", "local", "oscars") for figure in ("thr", "util", "idle")),
    "oscars tau",
    "oracle thr",
    "oracle tau",
]


def _scaling_row(r: Mapping[str, Any]) -> list[str]:
    cells = [str(r["ranks"]), f"{r['allreduce_s'] * 1e3:.1f}", f"{r['ideal_throughput']:.0f}"]
    for name in PARADIGMS:
        s = r[name]
        cells += [
            f"{s['throughput']:.0f} ({100 * s['fraction_of_ideal']:.0f}%)",
            f"{s['utilization']:.3f}",
            f"{s['idle_mean']:.3f}",
        ]
    cells.append(_tau_text(r["oscars"]["final_local_steps"]))
    oracle = r.get("oscars_oracle")
    if oracle:
        cells += [
            f"{oracle['throughput']:.0f} ({100 * oracle['fraction_of_ideal']:.0f}%)",
            _tau_text(oracle["final_local_steps"]),
        ]
    return cells


def scaling_markdown(rows: Sequence[Mapping[str, Any]], cfg: StudyConfig) -> list[str]:
    """One table per mix: throughput (share of ideal), utilisation and mean idle fraction per paradigm."""
    lines = [
        "## Scaling study",
        "",
        f"Step time {cfg.step_time_s * 1e3:.0f} ms at 1x, per-step lognormal noise sigma {cfg.noise}, model "
        f"{cfg.params / 1e6:.0f}M params x {cfg.bytes_per_param:.0f} B, ring all-reduce at "
        f"{cfg.bandwidth / 1e9:.0f} GB/s and {cfg.latency * 1e6:.0f} us per hop, BSP overlap {cfg.overlap}, "
        f"local SGD H={cfg.local_period}, oscars with the strategy's defaults (M={DEFAULT_MAX_SPREAD}, max 16 local "
        "steps, tolerance 0.02, warm-up 4, step times within 5% snapped, re-solve on 20% drift of a step time or of "
        "the all-reduce cost relative to the round, first epoch cut once solved). "
        f"{cfg.steps_per_rank} x N optimizer steps per run. thr = optimizer steps/s "
        "summed over ranks (% of the ideal sum_i 1/t_i); util = compute / (N x wall); idle = mean share of "
        "wall a rank waits at the barrier or in no-op slots; tau = final local steps per speed class; oracle = "
        "oscars solved up front from the true mean step times and all-reduce cost (no warm-up).",
    ]
    for mix in dict.fromkeys(r["mix"] for r in rows):
        table = [_scaling_row(r) for r in rows if r["mix"] == mix]
        lines += ["", f"### {mix}", "", *markdown_table(_SCALING_HEADERS, table, "r" * 12 + "lrl")]
    return lines


def _tau_text(tau: Any) -> str:
    return ", ".join(f"{k}: {v}" for k, v in tau.items()) if isinstance(tau, dict) else str(tau)


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Fraction of the ideal throughput (solid) and utilisation (dashed) vs N, one panel per mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(dict.fromkeys(r["mix"] for r in rows))
    fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), sharey=True, squeeze=False)
    colors = {"bsp": "tab:red", "local_sgd": "tab:blue", "oscars": "tab:green"}
    for ax, mix in zip(axes[0], mixes):
        sel = [r for r in rows if r["mix"] == mix]
        n = [r["ranks"] for r in sel]
        for name in PARADIGMS:
            ax.plot(n, [r[name]["fraction_of_ideal"] for r in sel], "-o", color=colors[name], label=f"{name} thr/ideal")
            ax.plot(n, [r[name]["utilization"] for r in sel], "--", color=colors[name], label=f"{name} utilisation")
        if all("oscars_oracle" in r for r in sel):
            oracle = [r["oscars_oracle"]["fraction_of_ideal"] for r in sel]
            ax.plot(n, oracle, ":", color="black", label="oscars, solved from true times and cost")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("ranks")
        ax.set_title(mix)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("fraction")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
