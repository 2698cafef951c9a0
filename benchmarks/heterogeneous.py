"""Heterogeneous speed-up: ddp vs oscars on 2 ranks with rank 1 emulated k times slower, same data and epochs.

    python -m benchmarks.heterogeneous --repeats 3 --slowdown 1:3

Runs every configuration `--repeats` times, interleaved, and reports medians and the ratio to ddp measured in
the same invocation. Writes benchmarks/results/heterogeneous.json and .md."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "ddp": ["--strategy", "ddp"],
    "oscars": ["--strategy", "oscars"],
}


def run(args: list[str], epochs: int, slowdown: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.train_job",
            *args,
            "--epochs",
            str(epochs),
            "--slowdown",
            slowdown,
            "--out",
            str(out),
        ]
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, timeout=900, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--slowdown", default="1:3")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    names = a.configs.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.repeats):
        for name in names:
            r = run(CONFIGS[name], a.epochs, a.slowdown)
            runs[name].append(r)
            print(f"[{i + 1}/{a.repeats}] {name:8s} wall {r['wall_s']:.1f}s  val_acc {r['val_acc']:.4f}", flush=True)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            "median_wall_s": statistics.median(r["wall_s"] for r in rs),
            "median_val_acc": statistics.median(r["val_acc"] for r in rs),
            "median_samples_per_s": statistics.median(r["samples"] / r["wall_s"] for r in rs),
            "schedule": rs[-1]["schedule"],
            "runs": rs,
        }
    base = summary.get("ddp")
    lines = [
        f"Slowdown profile `{a.slowdown}`, {a.epochs} epochs, {a.repeats} repeats (medians).",
        "",
        "| strategy | wall s | samples/s | val acc | speed-up vs ddp | acc delta (pts) |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        speedup = base["median_wall_s"] / s["median_wall_s"] if base else float("nan")
        delta = 100 * (s["median_val_acc"] - base["median_val_acc"]) if base else float("nan")
        s["speedup_vs_ddp"] = speedup
        lines.append(
            f"| {name} | {s['median_wall_s']:.1f} | {s['median_samples_per_s']:.0f} | {s['median_val_acc']:.4f} |"
            f" {speedup:.2f}x | {delta:+.2f} |"
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heterogeneous.json").write_text(json.dumps(summary, indent=1))
    (out / "heterogeneous.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
