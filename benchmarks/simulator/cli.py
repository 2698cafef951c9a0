"""``python -m benchmarks.simulator``: the validation and the scaling study, written to ``--out``."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.simulator.report import plot, scaling_markdown, sensitivity_markdown, validation_markdown
from benchmarks.simulator.study import MIXES, RANKS, StudyConfig, scaling_study
from benchmarks.simulator.validation import sensitivity, validate_against

__all__ = ["main"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _parser() -> argparse.ArgumentParser:
    from benchmarks import simulator

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.simulator",
        description=simulator.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--validate", metavar="JSON", help="results of benchmarks.heterogeneous to validate against")
    v = p.add_argument_group("validation inputs (override what the results JSON gives)")
    v.add_argument("--profiles", help="comma-separated subset of the JSON's profiles (default: all)")
    v.add_argument("--allreduce-s", type=float, help="seconds of one oscars averaging all-reduce (every profile)")
    v.add_argument("--ddp-overhead-s", type=float, help="seconds a DDP step adds over the local step")
    v.add_argument(
        "--emulated-ddp-comm",
        action="store_true",
        help="results of the old emulator, which slowed DDP's in-step all-reduce down by k on a k-times rank",
    )
    v.add_argument("--noop-s", type=float, help="seconds of one no-op slot")
    v.add_argument("--round-overhead-s", type=float, help="bookkeeping seconds per averaging beyond the all-reduce")
    v.add_argument("--first-step-s", type=float, help="start-up transient added to every rank's first step")
    v.add_argument("--epoch-overhead-s", type=float, help="epoch turnover seconds (validation is excluded)")
    v.add_argument("--load", type=float, help="sigma of the per-round load factor, every rank (0: none)")
    v.add_argument("--load-time-s", type=float, help="correlation time of the load, seconds")
    v.add_argument("--batch-size", type=int)
    v.add_argument("--val-noise", type=float, default=0.1, help="per-step lognormal sigma in the validation")
    v.add_argument("--val-seeds", type=int, default=5)
    s = p.add_argument_group("scaling study")
    s.add_argument("--ranks", type=_ints, default=RANKS)
    s.add_argument("--mixes", default=",".join(MIXES))
    s.add_argument("--base-step-s", type=float, default=0.1, help="seconds per step of a 1x rank")
    s.add_argument("--noise", type=float, default=0.05)
    s.add_argument("--params", type=float, default=25e6)
    s.add_argument("--bytes-per-param", type=float, default=4.0)
    s.add_argument("--bandwidth", type=float, default=10e9, help="bytes/s")
    s.add_argument("--latency", type=float, default=5e-6, help="seconds per hop")
    s.add_argument("--local-period", type=int, default=8, help="H of fixed-period local SGD")
    s.add_argument("--overlap", type=float, default=0.0, help="share of BSP's all-reduce hidden behind backward")
    s.add_argument("--steps-per-rank", type=int, default=1000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-study", action="store_true")
    return p


def _overrides(a: argparse.Namespace) -> dict[str, Any]:
    """The validation inputs given on the command line (``None``: derive from the results)."""
    return {
        "profiles": [x for x in a.profiles.split(",") if x] if a.profiles else None,
        "allreduce_s": a.allreduce_s,
        "ddp_overhead_s": a.ddp_overhead_s,
        "noop_s": a.noop_s,
        "round_overhead_s": a.round_overhead_s,
        "first_step_s": a.first_step_s,
        "epoch_overhead_s": a.epoch_overhead_s,
        "load": a.load,
        "load_time_s": a.load_time_s,
        "batch_size": a.batch_size,
        "noise": a.val_noise,
        "seeds": a.val_seeds,
        "emulator_scales_ddp_comm": a.emulated_ddp_comm,
    }


def _validation(a: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The validation report and its markdown (also printed)."""
    started = time.perf_counter()
    overrides = _overrides(a)
    validation = validate_against(a.validate, overrides)
    validation["sensitivity"] = sensitivity(a.validate, overrides)
    elapsed = time.perf_counter() - started
    validation["seconds"] = elapsed
    text = validation_markdown(validation) + [""]
    text += sensitivity_markdown(validation["sensitivity"])
    text += ["", f"Validation simulated in {elapsed:.1f} s."]
    print("\n".join(text), flush=True)
    return validation, text


def _study_config(a: argparse.Namespace) -> StudyConfig:
    return StudyConfig(
        ranks=tuple(a.ranks),
        mixes=tuple(x for x in a.mixes.split(",") if x),
        step_time_s=a.base_step_s,
        noise=a.noise,
        params=a.params,
        bytes_per_param=a.bytes_per_param,
        bandwidth=a.bandwidth,
        latency=a.latency,
        local_period=a.local_period,
        overlap=a.overlap,
        steps_per_rank=a.steps_per_rank,
        seed=a.seed,
    )


def _study(a: argparse.Namespace, out: Path) -> tuple[dict[str, Any], list[str]]:
    """The scaling study's report and markdown; its plot is written to ``out``."""
    cfg = _study_config(a)
    started = time.perf_counter()
    rows = scaling_study(cfg, progress=lambda line: print(line, flush=True))
    elapsed = time.perf_counter() - started
    lines = scaling_markdown(rows, cfg) + ["", f"Scaling study simulated in {elapsed:.1f} s."]
    plot(rows, out / "simulator.png")
    print(f"scaling study: {elapsed:.1f} s", flush=True)
    return {"config": cfg.__dict__, "seconds": elapsed, "rows": rows}, lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Writes ``simulator.json``, ``simulator.md`` and (with the study) ``simulator.png`` to ``--out``."""
    a = _parser().parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    lines = ["# Cluster simulator (benchmarks/simulator)", ""]
    if a.validate:
        report["validation"], text = _validation(a)
        lines += text + [""]
    if not a.no_study:
        report["scaling"], text = _study(a, out)
        lines += text
    (out / "simulator.json").write_text(json.dumps(report, indent=1, default=_jsonable))
    (out / "simulator.md").write_text("\n".join(lines) + "\n")
    return report


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)
