"""One training run on 2 emulated ranks; rank 0 writes a JSON summary. Used by benchmarks.heterogeneous."""

from __future__ import annotations

import argparse
import json
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402

import lightning_oscars  # noqa: E402,F401
from benchmarks.task import BenchModule  # noqa: E402
from lightning_oscars import HeterogeneityEmulator, OscarsStrategy  # noqa: E402


def parse_profile(text: str) -> dict:
    """'1:3' -> rank 1 constant 3x; '1:1@0,3@10' -> rank 1 at 1x, 3x after 10 s."""
    out: dict = {}
    for part in filter(None, text.split(";")):
        rank, spec = part.split(":")
        steps = [tuple(float(v) for v in s.split("@")[::-1]) if "@" in s else (0.0, float(s)) for s in spec.split(",")]
        out[int(rank)] = steps
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="oscars")
    p.add_argument("--solver", default="exact")
    p.add_argument("--averaging", default="uniform")
    p.add_argument("--slowdown", default="1:3")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    L.seed_everything(0, verbose=False)
    model = BenchModule()
    if a.strategy == "oscars":
        strategy = OscarsStrategy(solver=a.solver, averaging=a.averaging)
    else:
        strategy = a.strategy
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=a.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[HeterogeneityEmulator(parse_profile(a.slowdown))],
    )
    start = time.perf_counter()
    trainer.fit(model)
    wall = time.perf_counter() - start
    if trainer.global_rank == 0:
        s = trainer.strategy
        history = getattr(s, "history", [])
        json.dump(
            {
                "strategy": a.strategy if a.strategy != "oscars" else f"oscars-{a.solver}-{a.averaging}",
                "wall_s": wall,
                "val_acc": model.val_curve[-1][2],
                "val_loss": model.val_curve[-1][1],
                "curve": model.val_curve,
                "samples": a.epochs * model.hparams.n_train,
                "schedule": list(s.schedule.local_steps) if getattr(s, "schedule", None) else None,
                "mean_utilization": sum(h["utilization"] for h in history) / len(history) if history else None,
            },
            open(a.out, "w"),
        )


if __name__ == "__main__":
    main()
