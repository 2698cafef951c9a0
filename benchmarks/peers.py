"""oscars beside the peers a user would pick instead, on the same task, cluster and samples.

    pip install -e ".[bench]"      # matplotlib and torchft
    python -m benchmarks.peers --regime gpu-like
    python -m benchmarks.peers --regime cpu --profiles 1x/1x,1x/3x

The peers run in plain training loops, one process per rank, as their documentation shows them:

- ``torchft-localsgd``: torchft's ``LocalSGD`` (each rank its own replica group; the lighthouse started here on
  127.0.0.1 and stopped after the run), averaging every ``sync_every`` optimizer steps;
- ``torchft-diloco``: torchft's ``DiLoCo`` with its outer SGD (Nesterov momentum 0.9, lr 0.7) and a synchronous
  quorum;
- ``torch-averager``: torch's ``PeriodicModelAverager`` on a gloo group (what Lightning's post-local-SGD wraps);
- ``torch-ddp``: ``DistributedDataParallel`` in a plain loop, to separate Lightning's own per-step cost.

Lightning's ``ddp`` and ``oscars`` (at its defaults) run through ``benchmarks.train_job``. Every configuration
trains ``BenchModule``'s network from the same seed with its optimizer (SGD, momentum 0.9), on the same shards
(``DistributedSampler``, seed 0), for the same number of epochs, with the same emulated devices
(``benchmarks.task.EmulatedDevice``). Validation pauses the training clock everywhere.

Each peer's ``sync_every`` is swept over ``--sync-every`` once (the sweep's first run), the best by time to the
target accuracy (then throughput) is repeated up to ``--repeats`` runs, and reported at its median. The fixed
peers need every rank to take the same number of steps, so the fast ranks wait at each averaging; the plain loops
evaluate rank 0's model, which is the averaged one whenever a validation point falls on an averaging.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.heterogeneous import PROFILES, REGIMES, plot, run, summarize

# One rank's training loop (peers_loop) and one run of a peer (peers_harness) live in modules of their own; their
# names are re-exported here, where tests and callers import them from.
from benchmarks.peers_harness import RUN_TIMEOUT_S, _kill_group, _regime_value, peer_summary, run_peer  # noqa: F401
from benchmarks.peers_loop import train_rank
from benchmarks.tables import markdown_table

PEERS = ("torchft-localsgd", "torchft-diloco", "torch-averager")
PLAIN = ("torch-ddp",)
LIGHTNING = {"ddp": ["--strategy", "ddp"], "oscars": ["--strategy", "oscars"]}
PEER_PROFILES = {"1x/1x": "", **{k: v for k, v in PROFILES.items() if k != "homogeneous"}}


# ---------------------------------------------------------------------------------------------------- the study


def _rank_key(summary: dict) -> tuple[float, float]:
    """Best first: reaching the target sooner, then more samples per second."""
    reach = summary["median_time_to_target_s"]
    return (reach if reach is not None else float("inf"), -summary["median_samples_per_s"])


def study(profile: str, regime: str, repeats: int, sync_values: list[int], peers: list[str]) -> dict:
    slowdown = PEER_PROFILES[profile]
    regime_args, epochs = REGIMES[regime]["args"], REGIMES[regime]["epochs"]

    def log(name: str, r: dict) -> None:
        print(
            f"{profile:12s} {name:26s} train {r['train_wall_s']:5.1f}s {r['samples_per_s']:6.0f} samples/s "
            f"val_acc {r['val_acc']:.4f}",
            flush=True,
        )

    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):  # the fixed configurations, interleaved
        for name, args in LIGHTNING.items():
            r = run(args + regime_args, epochs, slowdown)
            runs.setdefault(name, []).append(r)
            log(name, r)
        for name in PLAIN:
            r = run_peer(name, 1, regime_args, epochs, slowdown)
            runs.setdefault(name, []).append(r)
            log(name, r)
    sweep: dict[str, dict[int, dict]] = {}
    for name in peers:
        for h in sync_values:
            r = run_peer(name, h, regime_args, epochs, slowdown)
            sweep.setdefault(name, {})[h] = r
            log(f"{name} (sync_every {h})", r)
    # rank the sweep on the fixed configurations' target: one definition for every row
    scored = summarize({**runs, **{f"{n}@{h}": [r] for n, by_h in sweep.items() for h, r in by_h.items()}})
    best = {n: min(by_h, key=lambda h: _rank_key(scored["configs"][f"{n}@{h}"])) for n, by_h in sweep.items()}
    for name, h in best.items():
        runs[name] = [sweep[name][h]]
    for _ in range(repeats - 1):
        for name, h in best.items():
            r = run_peer(name, h, regime_args, epochs, slowdown)
            log(f"{name} (sync_every {h})", r)
            runs[name].append(r)
    summary = summarize(runs)
    summary["sweep"] = {
        n: {
            h: {
                k: scored["configs"][f"{n}@{h}"][k]
                for k in ("median_samples_per_s", "median_time_to_target_s", "median_val_acc")
            }
            for h in by_h
        }
        for n, by_h in sweep.items()
    }
    summary["best_sync_every"] = best
    return summary


def _best_peer(summary: dict) -> str | None:
    named = [n for n in PEERS if n in summary["configs"]]
    return max(named, key=lambda n: summary["configs"][n]["median_samples_per_s"]) if named else None


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(profile: str, summary: dict) -> list[str]:
    configs = summary["configs"]
    best = _best_peer(summary)
    ref = configs[best] if best else None
    headers = ["configuration", "sync_every", "train wall s (runs)", "samples/s", "vs ddp", "vs best peer"]
    headers += ["of ideal", "idle s per rank", "to target s", "val acc", "delta pts"]
    rows = []
    for name, s in configs.items():
        idle = "/".join(f"{v:.1f}" for v in s["median_idle_s"]) if "median_idle_s" in s else "-"
        h = summary["best_sync_every"].get(name)
        vs_peer = s["median_samples_per_s"] / ref["median_samples_per_s"] if ref else None
        rows.append(
            [
                name,
                "auto" if name == "oscars" else (str(h) if h else "-"),
                f"{s['median_train_wall_s']:.1f} ({', '.join(str(w) for w in s['walls'])})",
                f"{s['median_samples_per_s']:.0f}",
                f"{_f(s['throughput_vs_ddp'], '.2f')}x",
                f"{_f(vs_peer, '.2f')}x",
                _f(s.get("median_fraction_of_ideal"), ".3f"),
                idle,
                _f(s["median_time_to_target_s"], ".1f"),
                f"{s['median_val_acc']:.4f}",
                _f(s["acc_delta_pts"], "+.2f"),
            ]
        )
    sweep_rows = [
        [
            n,
            h,
            f"{v['median_samples_per_s']:.0f}",
            _f(v["median_time_to_target_s"], ".1f"),
            f"{v['median_val_acc']:.4f}",
        ]
        for n, by_h in summary["sweep"].items()
        for h, v in by_h.items()
    ]
    return [
        f"### {profile}: slowdown `{PEER_PROFILES[profile] or 'none'}`, target accuracy "
        f"{_f(summary['target_acc'], '.4f')}",
        "",
        *markdown_table(headers, rows, "lllrrrrlrrr"),
        "",
        *(f"- {line}" for line in ratios(summary)),
        "",
        "Sweep (first run of each sync_every):",
        "",
        *markdown_table(["peer", "sync_every", "samples/s", "to target s", "val acc"], sweep_rows, "lrrrr"),
    ]


def ratios(summary: dict) -> list[str]:
    """The figures the README quotes: oscars against the best-tuned peer, and Lightning's own per-step cost."""
    configs = summary["configs"]
    lines = []
    best = _best_peer(summary)
    oscars = configs.get("oscars")
    if best and oscars:
        speed = oscars["median_samples_per_s"] / configs[best]["median_samples_per_s"]
        reached = [configs[n]["median_time_to_target_s"] for n in PEERS if n in configs]
        reached = [t for t in reached if t is not None]
        mine = oscars["median_time_to_target_s"]
        lead = f"{min(reached) / mine:.2f}x" if reached and mine else "not comparable (a target not reached)"
        lines.append(f"oscars against the fastest peer ({best}): {speed:.2f}x the samples/s; time to target: {lead}")
    if "ddp" in configs and "torch-ddp" in configs:
        lightning, plain = configs["ddp"], configs["torch-ddp"]
        steps = max(lightning["runs"][0]["real_steps"])
        walls = lightning["median_train_wall_s"], plain["median_train_wall_s"]
        extra_ms = 1e3 * (walls[0] - walls[1]) / steps
        lines.append(
            f"Lightning's own cost: ddp {walls[0]:.2f} s against a plain DDP loop's {walls[1]:.2f} s "
            f"({walls[0] / walls[1]:.2f}x, {extra_ms:.1f} ms per step)"
        )
    return lines


def report(data: dict, out: Path, name: str) -> None:
    """``name``.md and ``name``.png from the JSON a study wrote (``--report`` rebuilds them)."""
    meta, results = data["meta"], data["profiles"]
    setup = " ".join(meta["regime_args"]) or "real compute only"
    epochs = REGIMES[meta["regime"]]["epochs"]
    lines = [
        f"Regime `{meta['regime']}` ({setup}), {epochs} epochs, medians of up to {meta['repeats']} runs; the peers'"
        f" sync_every swept over {meta['sync_every']}.",
        "",
        "`of ideal` uses oscars' measured 1x step, which includes Lightning's per-step work: a plain loop can"
        " exceed 1. `vs best peer`: against the peer with the most samples/s. Idle per rank: train wall minus"
        " emulated device time.",
        "",
    ]
    for profile, summary in results.items():
        lines += table(profile, summary) + [""]
    (out / f"{name}.md").write_text("\n".join(lines))
    plot(results, out / f"{name}.png", accuracy=True)
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", choices=sorted(REGIMES), default="gpu-like")
    p.add_argument("--profiles", default="1x/1x,1x/3x,1x/5x,volatile,1x/1x/2x/4x")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sync-every", default="4,8,16,32", help="the peers' sweep")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="default: peers (gpu-like), peers_cpu (cpu)")
    # one rank of a plain-loop run (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (
        ("--algo", str),
        ("--rank", int),
        ("--world", int),
        ("--slowdown", str),
        ("--lighthouse", str),
        ("--port", int),
        ("--step-ms", float),
        ("--hidden", int),
        ("--n-train", int),
        ("--epochs", int),
        ("--val-check-interval", float),
        ("--jitter", float),
    ):
        p.add_argument(flag, type=kind, default=0.0 if kind is float else None, help=argparse.SUPPRESS)
    p.add_argument("--report", metavar="JSON", help="only rebuild the markdown and the plot from a study's JSON")
    a = p.parse_args()
    if a.report:
        path = Path(a.report)
        report(json.loads(path.read_text()), path.parent, a.name or path.stem)
        return
    if a.worker:
        a.sync_every = int(a.sync_every)
        train_rank(a)
        return
    name = a.name or ("peers" if a.regime == "gpu-like" else "peers_cpu")
    sync_values = [int(x) for x in a.sync_every.split(",")]
    results = {
        profile: study(profile, a.regime, a.repeats, sync_values, a.peers.split(","))
        for profile in a.profiles.split(",")
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "regime": a.regime,
        "regime_args": REGIMES[a.regime]["args"],
        "repeats": a.repeats,
        "sync_every": sync_values,
        "profiles": {k: PEER_PROFILES[k] for k in results},
    }
    data = {"meta": meta, "profiles": results}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    report(json.loads(json.dumps(data)), out, name)  # as --report reads it back


if __name__ == "__main__":
    main()
