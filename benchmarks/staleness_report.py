"""Staleness histograms of the parameter-server paradigms, from a ``benchmarks.heterogeneous`` results file.

    python -m benchmarks.staleness_report benchmarks/results/paradigms.json

For every profile and paradigm: how stale the parameters a worker started from were (its clock minus the slowest
active worker's, at every reply of rank 0's shard, all runs pooled), and how many replies the rule held back.
Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

BINS = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # lower edges; the last bin is open


def histogram(values: Sequence[int], bins: Sequence[int] = BINS) -> list[int]:
    """Counts of ``values`` per bin: bin ``k`` holds ``bins[k] <= v < bins[k + 1]`` (the last: ``v >= bins[-1]``)."""
    counts = [0] * len(bins)
    for v in values:
        k = max(i for i, low in enumerate(bins) if v >= low) if v >= bins[0] else 0
        counts[k] += 1
    return counts


def _label(k: int, bins: Sequence[int]) -> str:
    low = bins[k]
    if k + 1 == len(bins):
        return f">={low}"
    high = bins[k + 1] - 1
    return str(low) if high == low else f"{low}-{high}"


def report(results: dict) -> str:
    lines = [
        "# Staleness at every reply of rank 0's shard (all runs pooled); share of replies per bin",
        "",
    ]
    for profile, data in results["profiles"].items():
        rows = []
        for name, config in data["configs"].items():
            servers = [r.get("server") for r in config["runs"] if r.get("server")]
            if not servers:
                continue
            values = [max(0, v) for s in servers for v in s["staleness"]]  # behind everybody: 0 (older records)
            counts = histogram(values)
            total = max(1, len(values))
            held = sorted(s["held"] for s in servers)[len(servers) // 2]
            share = " | ".join(f"{c / total:.2f}" for c in counts)
            mean = sum(values) / total
            rows.append(f"| {name} | {len(values)} | {mean:.1f} | {max(values, default=0)} | {held} | {share} |")
        if not rows:
            continue
        bins = " | ".join(_label(k, BINS) for k in range(len(BINS)))
        lines += [
            f"## {profile}",
            "",
            f"| paradigm | replies | mean | max | held (median run) | {bins} |",
            "|---|---:|---:|---:|---:|" + "---:|" * len(BINS),
            *rows,
            "",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    text = report(json.loads(p.parse_args(argv).results.read_text()))
    print(text)
    return text


if __name__ == "__main__":
    main()
