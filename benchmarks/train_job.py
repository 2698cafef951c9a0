"""One training run on 2 emulated ranks; rank 0 writes a JSON summary. Used by benchmarks.heterogeneous and
benchmarks.demo.

    python -m benchmarks.train_job --strategy oscars --slowdown 1:3 --epochs 4 --out run.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

import lightning_oscars  # noqa: E402,F401
from benchmarks.task import BenchModule  # noqa: E402
from lightning_oscars import OscarsStrategy  # noqa: E402


def summarize(model: BenchModule, history: list[dict], batch_size: int) -> dict:
    """Cluster figures from every rank's own accounting (the same definitions for every strategy)."""
    cluster = model.cluster
    wall = max(r["wall_s"] for r in cluster)
    n = len(cluster)
    busy = [r["busy_s"] for r in cluster]
    samples = sum(r["real_steps"] for r in cluster) * batch_size
    # Ideal: every rank computing all the time at its own solo speed (as at the start of the run).
    ideal = sum(batch_size / (r["solo_step_s"] * r["start_factor"]) for r in cluster)
    return {
        "train_wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "ideal_samples_per_s": ideal,
        "fraction_of_ideal": samples / wall / ideal,
        "utilization": sum(busy) / (n * wall),
        "idle_s": [wall - b for b in busy],
        "real_steps": [int(r["real_steps"]) for r in cluster],
        "solo_step_ms": [1e3 * r["solo_step_s"] for r in cluster],
        "rounds": len(history),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="oscars", help="ddp, local_sgd or oscars")
    p.add_argument("--solver", default="exact")
    p.add_argument("--averaging", default="uniform")
    p.add_argument("--slowdown", default="1:3")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--val-check-interval", type=float, default=0.25)
    p.add_argument("--progress", action="store_true", help="show Lightning's progress bar")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    L.seed_everything(0, verbose=False)
    model = BenchModule(slowdown=a.slowdown)
    strategy = OscarsStrategy(solver=a.solver, averaging=a.averaging) if a.strategy == "oscars" else a.strategy
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=a.epochs,
        val_check_interval=a.val_check_interval,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=a.progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(model)
    wall = time.perf_counter() - start
    if trainer.global_rank == 0:
        s = trainer.strategy
        history = [r.as_dict() for r in getattr(s, "history", [])]
        name = a.strategy if a.strategy != "oscars" else f"oscars-{a.solver}-{a.averaging}"
        result = {
            "strategy": name,
            "slowdown": a.slowdown,
            "epochs": a.epochs,
            "wall_s": wall,
            "val_acc": model.val_curve[-1][2],
            "val_loss": model.val_curve[-1][1],
            "curve": model.val_curve,
            "schedule": list(s.schedule.local_steps) if getattr(s, "schedule", None) else None,
            "step_time_s": history[-1]["step_times"] if history else None,
            "allreduce_s": history[-1]["allreduce_time"] if history else None,
            "cluster": model.cluster,
            "history": history,
            **summarize(model, history, model.hparams.batch_size),
        }
        with open(a.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
