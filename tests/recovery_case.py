"""One fit that may lose a rank, for tests/test_recovery.py: run it again (a restart) and it goes on by itself.

Usage: python tests/recovery_case.py OUT_DIR. Through Lightning's launcher (``OSCARS_TEST_DEVICES`` ranks, default 2),
torchrun (``OSCARS_TEST_TORCHRUN=1``) or as srun's tasks (``SLURM_*`` variables: ``recovery_checks.srun``). The
fit trains the indexed blobs for two epochs, rank 1 3x slower, given no ``ckpt_path``: all it resumes from is the
recovery point.

* ``OSCARS_TEST_KILL=STEP`` (or ``+N``: N steps after the step the fit starts from): global rank 1
  (``OSCARS_TEST_KILL_RANK``) kills itself with SIGKILL as global step STEP
  starts, once per OUT_DIR (the marker ``killed-STEP``); with ``OSCARS_TEST_KILL_AGENT=1`` its torchrun agent first
  (a node lost).
* ``OSCARS_TEST_STRATEGY``: a paradigm (``bsp``, ``asp``, ``ssp``, ``dssp``, ``dasp``, ``ripples``) instead of
  ``oscars`` (the replica and deadline knobs are then ignored: a paradigm has neither option).
* ``OSCARS_TEST_REPLICA_SIZE``: ranks per replica (default 1), ``OSCARS_TEST_SHARD=1``: each replica sharded;
  ``OSCARS_TEST_DEADLINE=1``: deadline rounds;
  ``OSCARS_TEST_PRECISION``: the Trainer's ``precision`` (default ``32-true``).
* ``OSCARS_TEST_SIGTERM=STEP``: global rank 1 receives SIGTERM after global step STEP, once per OUT_DIR (a
  preemption notice: every rank stops at the next round boundary).
* ``OSCARS_TEST_KILL_IN``: global rank 1 kills itself (SIGKILL) inside its first ``validation`` batch, its first
  ``checkpoint`` write, or its ``first`` training batch of this run, or (a parameter-server paradigm) half-way
  through its 6th ``push``: its update sent to every server, its replies not received (once per OUT_DIR each).
* ``OSCARS_TEST_DIE_SAVING=1``: global rank 0 dies (SIGKILL) half-way through writing its recovery state.
* ``OSCARS_TEST_MODEL``: ``mlp`` (default), ``batchnorm`` or ``frozen`` (its first layer frozen).
* ``OSCARS_TEST_SLOWDOWN``: how much slower rank 1 is (default 3; 1: equal speeds).
* ``OSCARS_TEST_VALIDATE=1``: validate twice an epoch (metrics logged with ``sync_dist``).
* ``OSCARS_TEST_BATCH_SIZES``: the strategy's ``batch_sizes``, as JSON (e.g. ``[8, 4]``).
* ``OSCARS_TEST_BALANCE=batch``: ``balance="batch"`` (ddp's synchronous steps); ``OSCARS_TEST_ACCUMULATE=N``: the
  Trainer's ``accumulate_grad_batches``.
* ``OSCARS_TEST_CHECKPOINT_EVERY=N``: a ``ModelCheckpoint`` saves every N steps (the fit still gets no ``ckpt_path``),
  keeping the best 2 by ``val_loss`` when validating.

Every rank appends each real step's sample indices to ``OUT_DIR/trained-<pid>.jsonl`` as it trains (a killed rank's
file keeps what it trained), and a rank whose fit ended writes ``OUT_DIR/rank<global_rank>.json``.
"""

from __future__ import annotations

import faulthandler
import hashlib
import io
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from paradigm_models_case import IndexedBlobs, IndexedModule  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_oscars import HeterogeneityEmulator, OscarsStrategy  # noqa: E402
from lightning_oscars.core import recovery_points  # noqa: E402
from lightning_oscars.dist.param_server import ParameterServer  # noqa: E402
from lightning_oscars.lightning.paradigms import PARADIGMS  # noqa: E402


class RecordedModule(IndexedModule):
    """Writes the samples of every real step to a file as it goes."""

    def __init__(self, model: str, out: Path) -> None:
        super().__init__(model)
        self.record = open(out / f"trained-{os.getpid()}.jsonl", "a")  # noqa: SIM115 - open for the whole fit

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        line = {"epoch": self.current_epoch, "step": self.global_step, "indices": batch[2].tolist()}
        line["rank"] = self.global_rank
        self.record.write(json.dumps(line) + "\n")
        self.record.flush()
        return loss


class ValidatedModule(RecordedModule):
    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(16), batch_size=4)


class KillIn(L.Callback):
    """Global rank 1 dies (SIGKILL) in its first validation batch, checkpoint write or training batch of the run."""

    def __init__(self, where: str, out: Path) -> None:
        self.where, self.marker = where, out / f"killed-in-{where}"

    def _die_in(self, where: str, trainer: L.Trainer) -> None:
        if where == self.where and trainer.global_rank == 1 and not self.marker.exists():
            self.marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._die_in("validation", trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        self._die_in("checkpoint", trainer)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._die_in("first", trainer)


def die_pushing(out: Path, push: int = 6) -> None:
    """Global rank 1 dies (SIGKILL) in its ``push``-th round trip to the parameter server, once its update reached
    every server and before its replies: the servers then hold a reply for a dead worker."""
    original, pushes, marker = ParameterServer._own_grant, [0], out / "killed-in-push"

    def own_grant(server: ParameterServer, sends: list[Any], receives: list[Any]) -> Any:
        pushes[0] += 1
        if server.rank == 1 and pushes[0] == push and not marker.exists():
            for _, work, _ in sends:
                work.wait()
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(server, sends, receives)

    ParameterServer._own_grant = own_grant  # type: ignore[method-assign]


def die_while_saving() -> None:
    """Global rank 0's recovery state is cut off half-way: the process is killed while writing it."""
    original = recovery_points._write_atomically

    def write_half(path: Path, write: Any) -> None:
        if path.suffix != ".ckpt" or int(os.environ.get("RANK", "0")) != 0:
            return original(path, write)
        buffer = io.BytesIO()
        write(buffer)
        with open(path.with_name(f".{path.name}.partial"), "wb") as f:
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    recovery_points._write_atomically = write_half


class KillAt(L.Callback):
    """Global rank ``rank`` dies (SIGKILL, no cleanup) when ``step`` starts, once per output directory; ``"+N"``: N
    steps after the step the fit starts from (a restart resumes wherever the last failure saved)."""

    def __init__(self, step: str, out: Path, rank: int = 1) -> None:
        self.relative, self.step = step.startswith("+"), int(step.lstrip("+"))
        self.marker, self.rank = out / f"killed-{step}", rank

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.relative:
            self.step += trainer.global_step
            self.relative = False

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text("")
            if os.environ.get("OSCARS_TEST_KILL_AGENT") == "1":  # the whole node: torchrun's agent, then the rank
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class StartingWeights(L.Callback):
    """What each rank's model holds when the fit starts (after the restore and the strategy's setup, before the
    first collective, which merges a restart's survivors)."""

    def __init__(self) -> None:
        self.digest = ""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = [t.to_local() if isinstance(t, DTensor) else t for t in pl_module.state_dict().values()]
        flat = torch.cat([t.detach().float().reshape(-1) for t in local]).numpy().tobytes()
        self.digest = hashlib.sha1(flat).hexdigest()


class SigtermAfter(L.Callback):
    """Global rank 1 receives SIGTERM after ``step``, once per output directory."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.marker = step, out / f"sigterm-{step}"

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text("")
            os.kill(os.getpid(), signal.SIGTERM)


def whole(tensor: Tensor) -> Tensor:
    """A sharded parameter gathered inside its replica (every rank of it calls this alike), or the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> None:
    out = Path(sys.argv[1])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang prints this rank's stacks and exits instead of waiting forever
        faulthandler.dump_traceback_later(dump_after, exit=True)
    L.seed_everything(0, verbose=False)
    env = os.environ
    validate = env.get("OSCARS_TEST_VALIDATE") == "1"
    module = (ValidatedModule if validate else RecordedModule)(env.get("OSCARS_TEST_MODEL", "mlp"), out)
    starting = StartingWeights()
    callbacks: list[L.Callback] = [HeterogeneityEmulator({1: float(env.get("OSCARS_TEST_SLOWDOWN", "3"))}), starting]
    if "OSCARS_TEST_KILL" in env:
        callbacks.append(KillAt(env["OSCARS_TEST_KILL"], out, int(env.get("OSCARS_TEST_KILL_RANK", "1"))))
    if env.get("OSCARS_TEST_KILL_IN") == "push":
        die_pushing(out)
    elif "OSCARS_TEST_KILL_IN" in env:
        callbacks.append(KillIn(env["OSCARS_TEST_KILL_IN"], out))
    if "OSCARS_TEST_SIGTERM" in env:
        callbacks.append(SigtermAfter(int(env["OSCARS_TEST_SIGTERM"]), out))
    if env.get("OSCARS_TEST_DIE_SAVING") == "1":
        die_while_saving()
    every = int(env.get("OSCARS_TEST_CHECKPOINT_EVERY", "0"))
    if every:
        kept = {"monitor": "val_loss", "save_top_k": 2} if validate else {"save_top_k": -1}
        callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=every, **kept))
    torchrun = os.environ.get("OSCARS_TEST_TORCHRUN") == "1"
    devices, nodes = int(env.get("OSCARS_TEST_DEVICES", "2")), 1
    if torchrun:
        devices, nodes = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"])
    elif "SLURM_NTASKS" in env:  # started as srun starts its tasks: Lightning's SLURMEnvironment
        devices, nodes = int(env["SLURM_NTASKS_PER_NODE"]), int(env["SLURM_NNODES"])
    # Short enough that a hang fails fast; OSCARS_TEST_TIMEOUT_S lengthens it for a crowded launch (the rendezvous
    # waits this long for rank 0's store).
    timeout = timedelta(seconds=float(env.get("OSCARS_TEST_TIMEOUT_S", "30")))
    paradigm = env.get("OSCARS_TEST_STRATEGY")
    if paradigm:
        # A timeout no test run reaches: a survivor waiting for the dead rank (a staleness bound, a group) must see
        # the loss by itself, as it does when the peer's connection closes.
        strategy: OscarsStrategy = PARADIGMS[paradigm][0](timeout=timedelta(seconds=600))
    else:
        strategy = OscarsStrategy(
            timeout=timeout,
            replica_size=int(env.get("OSCARS_TEST_REPLICA_SIZE", "1")),
            shard_replicas=env.get("OSCARS_TEST_SHARD") == "1",
            deadline_rounds=env.get("OSCARS_TEST_DEADLINE") == "1",
            balance=env.get("OSCARS_TEST_BALANCE", "steps"),
            batch_sizes=json.loads(env["OSCARS_TEST_BATCH_SIZES"]) if "OSCARS_TEST_BATCH_SIZES" in env else None,
        )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        max_epochs=2,
        accumulate_grad_batches=int(env.get("OSCARS_TEST_ACCUMULATE", "1")),
        precision=env.get("OSCARS_TEST_PRECISION", "32-true"),
        callbacks=callbacks,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=every > 0,
        val_check_interval=0.5 if validate else None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "weights": torch.cat([whole(t).detach().float().reshape(-1) for t in module.state_dict().values()]).tolist(),
        "averagings": len(strategy.history),
        "deadline_rounds": strategy.rounds is not None and strategy.rounds.pacer is not None,
        "starting_weights": starting.digest,
        "recovery_left": sorted(p.name for p in (out / "oscars-recovery").glob("*")),
        "checkpoint_callback": trainer.checkpoint_callback.state_dict() if every else None,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=lambda t: t.tolist()))


if __name__ == "__main__":
    main()
