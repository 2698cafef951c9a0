"""The report of the paradigms-at-scale study (``scale_paradigms``): its markdown, from the study's rows or
re-rendered from the JSON a study wrote.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.simulator.scale_models import RIPPLES, ScaleConfig, Window
from benchmarks.tables import markdown_table

__all__ = ["markdown"]

LABELS = {"mixed": "mixed", "homogeneous": "homogeneous", "one_in_16": "1 in 16 at 5x"}


def markdown(rows: Sequence[dict[str, Any]], cfg: ScaleConfig, cold: dict[str, dict[str, float]] | None = None) -> str:
    """The report: per rank count a table of throughput vs ddp (fraction of ideal) and idle per cluster, then the
    staleness / slow-group figures and the notes."""
    lines = _preamble(cfg)
    for n in cfg.ranks:
        lines += _ranks_section(rows, cfg, n)
    lines += _staleness_section(rows)
    if cold:
        lines += _cold_start_section(cold)
    return "\n".join(lines) + "\n"


def _preamble(cfg: ScaleConfig) -> list[str]:
    """The title, the study's settings, the caveat that throughput is not convergence, and the model notes."""
    return [
        "# Paradigms at scale (simulated)",
        "",
        f"1x step {cfg.base_s} s, lognormal per-step jitter sigma {cfg.sigma}, all-reduce {cfg.allreduce_steps} fast"
        f" steps ({cfg.allreduce_s() * 1e3:.0f} ms), PS push {cfg.push_factor:g} x all-reduce per iteration, Ripples"
        f" groups of {cfg.group_size} (buffer {cfg.buffer_size}), partial all-reduce = all-reduce x ln k / ln N;"
        f" medians of seeds {', '.join(map(str, cfg.seeds))}. Cell: throughput vs ddp (fraction of ideal"
        " sum 1/t_i); idle: mean share of the window a rank waits (communication is not idle).",
        "",
        "**Throughput is not convergence.** Staleness (PS), partial mixing (Ripples) and local SGD's drift (oscars)"
        " change the accuracy reached per step; none of that is modelled here, so a paradigm ahead in this table may"
        " still be behind in time to accuracy.",
        "",
        "Model notes:",
        "",
        "* ddp: a barrier and an all-reduce every step; oscars: the strategy's policy (warm-up, solved local steps,"
        " re-solves), one all-reduce per round; both from ``benchmarks.simulator.engine``.",
        "* Parameter server (``simulate_paradigm``): every iteration pays the push cost on top of the step (one server"
        " shard per rank on the workers' machines: each link carries its own push and pull plus its shard's share of"
        " everyone else's, twice a ring all-reduce's traffic); no server contention beyond that. Its throughput is"
        " read between the first and the last move of the slowest clock inside the window (SSP / DSSP move in bursts"
        " tied to it). Staleness: updates the server applied between a worker's pull and its push, so it grows with"
        " N (about N - 1 for one iteration of every other worker).",
        "* Ripples (``simulate_ripples`` on ``lightning_oscars.core.groups.GroupBoard``): the board is warm (every"
        " worker's mean step time known at launch), the best case; a cold board's launch is in the last"
        " table. Slow groups: groups of two or more performed by a worker of a faster class that included a worker"
        " of the slowest class, per fast worker over the window. Static groups cut *consecutive* ranks, so on"
        " ``mixed`` (ranks in class order) most of them stay within one speed class: the layout matters to static.",
        "* Every figure is counted over a steady-state window (below), launch transients excluded; the step times of"
        " a seed are common to PS and Ripples (per worker and iteration), ddp and oscars draw their own.",
    ]


def _window_spans(cfg: ScaleConfig, n: int) -> str:
    """The steady-state windows at ``n`` ranks, each with the paradigms counted over it."""
    by_window: dict[Window, list[str]] = {}
    for paradigm in cfg.paradigms:
        by_window.setdefault(tuple(cfg.window(n, paradigm)), []).append(paradigm)  # type: ignore[arg-type]
    return "; ".join(f"{', '.join(names)}: {a:g}-{b:g} s" for (a, b), names in by_window.items())


def _ranks_section(rows: Sequence[dict[str, Any]], cfg: ScaleConfig, n: int) -> list[str]:
    """The section of one rank count: its windows, a row per paradigm with throughput vs ddp (fraction of ideal)
    and idle on every cluster, and the seeds that disagree."""
    here = [r for r in rows if r["ranks"] == n]
    clusters = [c for c in cfg.clusters if any(r["cluster"] == c for r in here)]
    headers = ["paradigm"] + [h for c in clusters for h in (f"{LABELS[c]}: vs ddp", "idle")]
    table = []
    for paradigm in cfg.paradigms:
        cells = [paradigm]
        for c in clusters:
            r = next(r for r in here if r["cluster"] == c and r["paradigm"] == paradigm)
            cells += [f"{r['vs_ddp']:.2f}x ({r['of_ideal']:.2f})", f"{r['idle']:.2f}"]
        table.append(cells)
    lines = ["", f"## {n} ranks", "", f"Windows (simulated seconds): {_window_spans(cfg, n)}.", ""]
    lines += markdown_table(headers, table, "l" + "rr" * len(clusters))
    lines += _seed_spread(here)
    return lines


def _staleness_section(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The PS paradigms' staleness and, off the homogeneous cluster, how often Ripples' groups held a slow worker."""
    lines = ["", "## Staleness (PS) and slow workers in Ripples' groups", ""]
    extra_headers = ["ranks", "cluster", "paradigm", "mean staleness", "max staleness", "slow groups / fast worker"]
    extra_headers += ["share of fast workers' groups with a slow one"]
    extra = []
    for r in rows:
        if "staleness_mean" in r:
            extra.append([r["ranks"], LABELS[r["cluster"]], r["paradigm"], f"{r['staleness_mean']:.1f}"])
            extra[-1] += [str(r["staleness_max"]), "-", "-"]
        elif "slow_group_share" in r and r["cluster"] != "homogeneous":
            extra.append([r["ranks"], LABELS[r["cluster"]], r["paradigm"], "-", "-"])
            extra[-1] += [f"{r['slow_groups_per_fast_worker']:.2f}", f"{r['slow_group_share']:.3f}"]
    return lines + markdown_table(extra_headers, extra, "rllrrrr")


def _cold_start_section(cold: dict[str, dict[str, float]]) -> list[str]:
    """Ripples launched on a cold board: the fraction of ideal per rank count, counted from the launch."""
    lines = ["", "## Ripples from a cold board (homogeneous cluster, seed 0)", ""]
    lines += ["Workers join the board at their first request (as ``GroupBoard`` starts, and as every round starts"]
    lines += ["after ``end_round``); fraction of ideal over the window, counted from the launch.", ""]
    table = [[n, c["window"], *(f"{c[p]:.3f}" for p in RIPPLES)] for n, c in cold.items()]
    return lines + markdown_table(["ranks", "window s", *RIPPLES], table, "rr" + "r" * len(RIPPLES))


def _seed_spread(rows: Sequence[dict[str, Any]], factor: float = 1.5) -> list[str]:
    """Lines naming the configurations whose seeds disagree by more than ``factor`` in throughput, with every
    seed's throughput vs ddp: there the median is one regime (e.g. a run still in its launch transient)."""
    ddp = {r["cluster"]: r for r in rows if r["paradigm"] == "ddp"}
    out = []
    for r in rows:
        values = [s["throughput"] for s in r["seeds"]]
        if min(values) <= 0 or max(values) / min(values) > factor:
            base = ddp[r["cluster"]]["seeds"]
            ratios = ", ".join(f"{s['throughput'] / d['throughput']:.2f}x" for s, d in zip(r["seeds"], base))
            out.append(f"* {LABELS[r['cluster']]}, {r['paradigm']}: per seed {ratios} vs ddp.")
    return ["", "Seeds that disagree (the median is one of them):", "", *out] if out else []


def _render(stem: Path) -> str:
    """The markdown of a study already run, from its JSON (to re-render the report without re-running it)."""
    payload = json.loads(stem.with_suffix(".json").read_text())
    config = dict(payload["config"])
    windows = {int(n): {k: tuple(v) for k, v in w.items()} for n, w in config.pop("windows").items()}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    cfg = ScaleConfig(**fields, windows=lambda n: windows[n])
    cold = {int(n): c for n, c in payload.get("cold_start", {}).items()}
    return markdown(payload["rows"], cfg, cold) + f"\nStudy runtime: {payload['runtime_s']:.0f} s.\n"
