"""One launch of a fit that may lose rank 1, for benchmarks.recovery (run again to restart it).

    python -m benchmarks.recovery_job --out DIR [--devices 2] [--kill-step K] [--mode recovery|checkpoint|none]

On scikit-learn's digits (real data): every step sleeps ``--step-ms`` (rank 1 3x as long), the CNN's compute on top
(``--step-ms 0``: the CPU-bound regime, rank 1 sleeping twice its measured step). ``--kill-step K``: rank 1 SIGKILLs
itself as global step K starts, once per DIR (it writes the time to DIR/killed.json). ``--mode recovery``: the
strategy's own recovery; ``checkpoint``: today's alternative, ``ModelCheckpoint(save_last=True)`` at every epoch end,
``recovery=False``, restarted with ``ckpt_path="last"``; ``none``: an undisturbed run. Under torchrun (one agent per
node) the world is the agents', and the kill takes rank 1's agent with it (a lost node). Every rank appends each real
step's sample count to DIR/steps-<pid>.jsonl; rank 0 of a finished fit writes DIR/result.json (final accuracy, the
validation curve), and every launch's first training step is timed in DIR/started-<pid>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from benchmarks.task import BenchModule  # noqa: E402
from lightning_oscars import OscarsStrategy  # noqa: E402
from lightning_oscars.lightning.paradigms import PARADIGMS  # noqa: E402


class Recorder(L.Callback):
    """Each real step's samples as they are trained; the first step's wall time; rank 1's death at ``kill_step``."""

    def __init__(self, out: Path, kill_step: int | None) -> None:
        self.out, self.kill_step = out, kill_step
        self.record = open(out / f"steps-{os.getpid()}.jsonl", "a")  # noqa: SIM115 - open for the whole fit
        self.started = False

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, *args: Any) -> None:
        if not self.started:
            self.started = True
            (self.out / f"started-{os.getpid()}.json").write_text(json.dumps({"time": time.time()}))
        marker = self.out / "killed.json"
        if trainer.global_rank == 1 and trainer.global_step == self.kill_step and not marker.exists():
            marker.write_text(json.dumps({"time": time.time(), "step": trainer.global_step}))
            if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: the whole node, its agent first
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, *a: Any):
        real = getattr(trainer.strategy, "slot_is_real", True)
        if real:
            self.record.write(json.dumps({"epoch": trainer.current_epoch, "samples": len(batch[0])}) + "\n")
            self.record.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--mode", default="recovery", choices=("recovery", "checkpoint", "none"))
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--step-ms", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="oscars", choices=("oscars", *PARADIGMS))
    a = p.parse_args()
    out = Path(a.out)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    L.seed_everything(a.seed, verbose=False)
    model = BenchModule(task="digits", slowdown="1:3", step_ms=a.step_ms, batch_size=32, lr=0.05)
    callbacks: list[L.Callback] = [Recorder(out, a.kill_step)]
    ckpt_path = None
    if a.mode == "checkpoint":
        callbacks.append(ModelCheckpoint(out / "ckpt", save_last=True, save_on_train_epoch_end=True))
        ckpt_path = "last" if (out / "ckpt" / "last.ckpt").exists() else None
    trainer = L.Trainer(
        strategy=(PARADIGMS[a.strategy][0] if a.strategy in PARADIGMS else OscarsStrategy)(
            recovery=a.mode == "recovery"
        ),
        accelerator="cpu",
        # Under torchrun (one agent per emulated node) the world is the agents'; else Lightning's launcher starts it
        # (and sets WORLD_SIZE for its children: only torchrun's TORCHELASTIC_RUN_ID tells the two apart).
        devices=int(os.environ["LOCAL_WORLD_SIZE"]) if torchrun else a.devices,
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]) if torchrun else 1,
        max_epochs=a.epochs,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=a.mode == "checkpoint",
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        result = {"val_acc": model.val_curve[-1][2], "curve": model.val_curve, "global_step": trainer.global_step}
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
