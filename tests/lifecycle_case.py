"""One process group, several Trainers: oscars must leave Lightning as it found it (run by test_lifecycle.py).

``python lifecycle_case.py MODE OUT``. MODE ``oscars_then_ddp``: two fits of one oscars Trainer, validate and test
on it, then a fresh ddp Trainer; ``ddp_only``: the same ddp fit alone. Each rank writes ``rank{r}.json``."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor, Timer
from toy import ToyModule

from lightning_oscars import HeterogeneityEmulator, OscarsStrategy


def user_requeue_handler(signum: int, frame: Any) -> None:  # a user's SIGUSR1 handler, deferred under oscars
    return None


def patched(trainer: L.Trainer, callbacks: list[Any]) -> list[str]:
    """Instance attributes that shadow Lightning's own methods (what a patch leaves behind)."""
    loop = trainer.fit_loop.epoch_loop
    owners = {
        "epoch_loop": (loop, "_broadcast_sigterm_tensor"),
        "automatic": (loop.automatic_optimization, "run"),
        "manual": (loop.manual_optimization, "run"),
        "logger_connector": (trainer._logger_connector, "update_train_step_metrics"),
    }
    owners.update({type(cb).__name__: (cb, "on_train_batch_end") for cb in callbacks})
    return sorted(name for name, (owner, attr) in owners.items() if attr in vars(owner))


def weights(module: torch.nn.Module) -> list[float]:
    return torch.cat([t.detach().float().reshape(-1) for t in module.state_dict().values()]).tolist()


def ddp_fit() -> list[float]:
    L.seed_everything(1, verbose=False)
    module = ToyModule(n=256)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    return weights(module)


def server_fits() -> list[int]:
    """Three short fits of a parameter-server paradigm on one Trainer: the process groups alive after each (the
    default group's registry; a test's look into torch's private state). Each fit makes two groups of its own."""
    from lightning_oscars.lightning.paradigms import SSPStrategy

    module = ToyModule(n=64, step_cost=0.001)
    trainer = L.Trainer(
        strategy=SSPStrategy(staleness=2),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    alive = []
    for max_epochs in (1, 2, 3):
        trainer.fit_loop.max_epochs = max_epochs
        trainer.fit(module)
        alive.append(len(torch.distributed.distributed_c10d._world.pg_map))
    return alive


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    signal.signal(signal.SIGUSR1, user_requeue_handler)
    pristine = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    result: dict[str, Any] = {}
    if mode == "oscars_then_ddp":
        L.seed_everything(0, verbose=False)
        module = ToyModule(n=256, step_cost=0.002)
        extra = [Timer(duration="00:01:00:00", interval="step"), ThroughputMonitor(batch_size_fn=lambda b: len(b[0]))]
        trainer = L.Trainer(
            # Every rank takes its 2 warm-up steps (a time-boxed one may leave the slow rank none on a loaded machine).
            strategy=OscarsStrategy(warmup_steps=2, timed_warmup=False),
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[*extra, HeterogeneityEmulator({1: 3.0})],
        )
        strategy = trainer.strategy
        assert isinstance(strategy, OscarsStrategy)
        fits = []
        for max_epochs in (1, 2):
            trainer.fit_loop.max_epochs = max_epochs
            seen_before = module.seen
            trainer.fit(module)
            fits.append(
                dict(
                    rounds=[r.round for r in strategy.history],
                    seen=module.seen - seen_before,
                    patched=patched(trainer, extra),
                    handlers_restored=all(signal.getsignal(s) is h for s, h in pristine.items()),
                    weights=weights(module),
                    callbacks=[type(cb).__name__ for cb in trainer.callbacks],
                )
            )
        result["fits"] = fits
        result["groups_after_server_fits"] = server_fits()
        result["validate"] = trainer.validate(module, verbose=False)
        result["test"] = trainer.test(module, verbose=False)
        result["eval_weights"] = weights(module)
    result["ddp_weights"] = ddp_fit()
    result["handlers_restored"] = all(signal.getsignal(s) is h for s, h in pristine.items())
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        # Leave together and close the group, as a ddp script should: Lightning's ddp leaves a gloo group to
        # interpreter exit, where gloo's threads can abort the process ("terminate called without an active
        # exception") after training succeeded, with or without oscars (seen once in CI on the ddp_only run).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
