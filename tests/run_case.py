"""Runs one named 2-rank scenario through Lightning's own launcher and writes what each rank saw as JSON.

Usage: python tests/run_case.py CASE OUT_DIR. Launched by tests/test_multiprocess.py (with a timeout)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from drop_in_modules import (  # noqa: E402
    EpochMeanModule,
    MonitorState,
    RareMetricModule,
    StepMonitoredModule,
    TwoLoaderModule,
)
from lightning.pytorch.callbacks import (  # noqa: E402
    BatchSizeFinder,
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    OnExceptionCheckpoint,
    StochasticWeightAveraging,
    ThroughputMonitor,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler  # noqa: E402
from toy import ToyModule, blobs  # noqa: E402

import lightning_oscars  # noqa: E402,F401
from lightning_oscars import (  # noqa: E402
    ASPStrategy,
    DASPStrategy,
    DSSPStrategy,
    HeterogeneityEmulator,
    OscarsStrategy,
    ParameterServerStrategy,
    RipplesStrategy,
    SSPStrategy,
)

COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list")


class CollectiveCounter(Callback):
    """Counts torch.distributed collectives issued inside training epochs, validation excluded."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                if self.active:
                    self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_epoch_start(self, *_):
        self.active = True

    def on_train_epoch_end(self, *_):
        self.active = False

    def on_validation_start(self, *_):
        self.active = False

    def on_validation_end(self, trainer, *_):
        self.active = trainer.training or trainer.state.stage == "train"


class SeenAtStep(Callback):
    """Records the samples this rank has trained on after every global step."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.seen[trainer.global_step] = pl_module.seen


class SendSignal(Callback):
    """Sends SIGTERM to this process at a given global step, on one rank (a preemption notice)."""

    def __init__(self, rank: int, step: int, signum: int = signal.SIGTERM) -> None:
        self.rank, self.step, self.signum, self.sent_at = rank, step, signum, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_rank == self.rank and trainer.global_step == self.step and self.sent_at is None:
            self.sent_at = trainer.global_step
            os.kill(os.getpid(), self.signum)


class SeenPerEpoch(Callback):
    """Samples this rank trained on, and validations it ran, in each completed epoch."""

    def __init__(self) -> None:
        self.per_epoch: list[int] = []
        self.validations: list[int] = []
        self.validated_at: list[tuple[int, int]] = []  # (epoch, batches of the epoch done) at every validation
        self.round_ends: list[list[int]] = []  # oscars: the slots where each epoch's planned rounds ended
        self._before = self._validated = 0

    def on_train_epoch_start(self, trainer, pl_module):
        self._before, self._validated = pl_module.seen, 0

    def on_validation_end(self, trainer, pl_module):
        self._validated += not trainer.sanity_checking
        if not trainer.sanity_checking:
            self.validated_at.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready))

    def on_train_epoch_end(self, trainer, pl_module):
        self.per_epoch.append(pl_module.seen - self._before)
        self.validations.append(self._validated)
        plan = getattr(getattr(trainer.strategy, "rounds", None), "plan", None)
        if plan is not None:
            self.round_ends.append([r.end_slot for r in plan.rounds])


class SettledProbe(Callback):
    """Whether the scheme's last averaging had reached the models at every batch end, and a fingerprint of the
    weights at every validation's end (overlapped averaging must leave them equal there)."""

    def __init__(self) -> None:
        self.settled: list[bool] = []
        self.at_validation: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
        self.settled.append(trainer.strategy.scheme.settled)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            weights = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            self.at_validation.append(float((weights * torch.arange(1, len(weights) + 1)).sum()))


class FaultyModule(ToyModule):
    """Rank 1 misbehaves at its 5th step: raises, hangs or is killed. A hang lasts until rank 0 has reported (its
    ``rank0.json`` in ``out``; at most 25 s): past the collective timeout, however long rank 0 took to name it."""

    def __init__(self, fault: str, out: Path | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fault = fault
        self.out = out

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.steps_taken == 4:
            if self.fault == "raise":
                raise ValueError("injected failure in training_step")
            if self.fault == "hang":
                until = time.monotonic() + 25
                while time.monotonic() < until and not (self.out and (self.out / "rank0.json").exists()):
                    time.sleep(0.1)
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


class ManualModule(ToyModule):
    def __init__(self, two: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.two = two
        if two:
            self.head = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        out = self(x)
        if self.two:
            out = self.head(out)
        loss = nn.functional.cross_entropy(out, y)
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        self.seen += len(y)
        self.steps_taken += 1
        self.log("train_loss", loss, sync_dist=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # The pattern for manual optimization (docs/lightning-semantics.md): step the LR schedule in a hook that
        # every slot reaches.
        if not self.two:
            self.lr_schedulers().step()

    def configure_optimizers(self):
        if not self.two:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)]
        return [torch.optim.SGD(self.net.parameters(), lr=0.05), torch.optim.SGD(self.head.parameters(), lr=0.05)]


class ClipModule(ToyModule):
    """Records every real step's gradient norm before and after Lightning's clipping."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.grad_norms: list[list[float]] = []  # [before, after] per optimizer step

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        def norm() -> float:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

        before = norm()
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.grad_norms.append([before, norm()])


class PrecisionModule(ToyModule):
    """Records the dtype a linear layer computes in inside every real training step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_dtypes: list[str] = []

    def training_step(self, batch, batch_idx):
        self.step_dtypes.append(str(self.net[0](batch[0]).dtype))
        return super().training_step(batch, batch_idx)


class SchedModule(ToyModule):
    def __init__(self, interval: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.interval = interval

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5 if self.interval == "step" else 1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


class EpochLogModule(ToyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


class IterableBlobs(IterableDataset):
    def __iter__(self):
        yield from blobs(64)


class IterableModule(ToyModule):
    def train_dataloader(self):
        return DataLoader(IterableBlobs(), batch_size=8)


class CountingModule(ToyModule):
    """Counts the optimizer steps that really ran on this rank (the hook fires inside a real step only)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.optimizer_steps = 0
        self.steps_per_epoch: list[int] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        self.optimizer_steps += 1

    def on_train_epoch_end(self) -> None:
        self.steps_per_epoch.append(self.optimizer_steps - sum(self.steps_per_epoch))


class Indexed(Dataset):
    """blobs with each sample's index, so that tests can see which samples were trained."""

    def __init__(self, n: int) -> None:
        self.data = blobs(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, y, i


class IndexedModule(ToyModule):
    """Records the sample indices trained in every epoch; ``sampler``: "weighted" (sample 0 weighs 1000) or None."""

    def __init__(self, sampler: str | None = None, n: int = 100, batch_size: int = 10, **kwargs) -> None:
        super().__init__(n=n, batch_size=batch_size, **kwargs)
        self.sampler = sampler
        self.trained: list[list[int]] = []
        self.trained_steps: list[tuple[int, list[int]]] = []  # (global_step, indices) of every real step

    def on_train_epoch_start(self) -> None:
        self.trained.append([])

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        if not self.trained:  # resumed mid-epoch: Lightning does not run on_train_epoch_start again
            self.trained.append([])
        self.trained[-1].extend(idx.tolist())
        if len(idx):
            self.trained_steps.append((self.trainer.global_step, idx.tolist()))
        return super().training_step((x, y), batch_idx)

    def train_dataloader(self):
        data = Indexed(self.n)
        if self.sampler == "weighted":
            weights = torch.ones(self.n)
            weights[0] = 1000.0
            sampler = WeightedRandomSampler(weights, num_samples=self.n, replacement=True)
            return DataLoader(data, batch_size=self.batch_size, sampler=sampler)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)


class SlowCheckpointIO(TorchCheckpointIO):
    """A checkpoint write that takes 0.15 s (a network file system)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(0.15)
        super().save_checkpoint(checkpoint, path, storage_options)


class ProbeModule(ToyModule):
    """A step-interval StepLR and a sync_dist epoch value logged only at batch_idx % 3 == 1 (never on a rank whose
    real slots are the first of every 3)."""

    def training_step(self, batch, batch_idx):
        if batch_idx % 3 == 1:
            self.log("rare", 1.0, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(batch[0]))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class BatchProbe(Callback):
    """What on_train_batch_end shows on real and no-op slots: (real, samples in the batch, outputs' keys)."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, int, list[str]]] = []
        self.throughput_samples = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        real = getattr(trainer.strategy, "slot_is_real", True)
        self.seen.append((real, int(batch[0].shape[0]), sorted(outputs or {})))

    def on_train_end(self, trainer, pl_module):
        for cb in trainer.callbacks:
            if isinstance(cb, ThroughputMonitor):
                self.throughput_samples = int(cb._samples.get("train", 0))


class UnusedHeadModule(ToyModule):
    """A head only rank 0 uses (rank 1's optimizer never holds state for it), and an int64 buffer beyond float32's
    exact range."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.aux = nn.Linear(4, 4)
        self.register_buffer("big", torch.tensor([16777217, 123456789, -(2**62) - 1], dtype=torch.int64))

    def forward(self, x):
        out = self.net(x)
        return out + 0.1 * self.aux(out) if self.global_rank == 0 else out


class LBFGSModule(ToyModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2, history_size=3)


STEP_SYNCED = ("ripples", "ssp")  # a paradigm of each kind: groups, and the in-job parameter server
LIFECYCLE_PARADIGMS = (*STEP_SYNCED, "overlap")  # and oscars with its averaging overlapped with the next round
STEP_SYNCED_LIFECYCLE = ("midepoch_first", "midepoch_second", "sigterm", "max_time", "time_checkpoint")


def build(case: str, out: Path):
    """Return (module, trainer kwargs, strategy) for a case."""
    module = ToyModule(step_cost=0.004)
    kwargs: dict = dict(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    strategy: object = OscarsStrategy(warmup_steps=2)
    callbacks: list = [HeterogeneityEmulator({1: 3.0})]
    if case == "basic":
        pass
    elif case == "by_name":
        strategy = "oscars"
    elif case == "gossip_fixture":  # a scheme and strategy written outside the package, registered by the fixture
        import gossip_fixture  # noqa: F401 - registers "pair_gossip"

        strategy = "pair_gossip"
    elif case == "alg1_samples":
        strategy = OscarsStrategy(solver="alg1", averaging="samples", average_optimizer_state=True, warmup_steps=2)
    elif case == "local_sgd":
        strategy = "local_sgd"
    elif case == "pinned":
        strategy = OscarsStrategy(local_steps=[3, 1])
    elif case == "max_steps":
        kwargs.update(max_epochs=-1, max_steps=23)
    elif case == "max_time":
        kwargs.update(max_epochs=1000, max_time={"seconds": 4})
    elif case == "val_float":
        kwargs.update(val_check_interval=0.5)
    elif case == "val_int":
        kwargs.update(val_check_interval=7)
    elif case == "check_val_every_n_epoch":
        kwargs.update(max_epochs=4, check_val_every_n_epoch=2)
    elif case == "limit_float":
        kwargs.update(limit_train_batches=0.5)
    elif case == "limit_int":
        kwargs.update(limit_train_batches=9)
    elif case == "accumulate":
        kwargs.update(accumulate_grad_batches=2)
    elif case == "clip":
        module = ClipModule(step_cost=0.004, lr=0.5)  # a large step makes gradients that need clipping
        kwargs.update(gradient_clip_val=0.5)
    elif case == "bf16":
        module = PrecisionModule(step_cost=0.004)
        kwargs.update(precision="bf16-mixed")
    elif case == "sched_step":
        module = SchedModule("step", step_cost=0.004)
    elif case == "sched_epoch":
        module = SchedModule("epoch", step_cost=0.004)
    elif case == "sync_dist_epoch":
        module = EpochLogModule(step_cost=0.004)
    elif case == "checkpoint":
        kwargs.update(enable_checkpointing=True, default_root_dir=str(out))
        callbacks += [
            ModelCheckpoint(dirpath=out / "best", monitor="val_loss", save_top_k=2, save_last=True),
            ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=5, save_top_k=-1),
        ]
    elif case == "early_stopping":
        kwargs.update(max_epochs=30)
        callbacks += [EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)]
    elif case == "loggers":
        kwargs.update(
            logger=[CSVLogger(out / "csv"), TensorBoardLogger(out / "tb")],
            log_every_n_steps=2,
            enable_progress_bar=True,
        )
        callbacks += [LearningRateMonitor(logging_interval="step")]
    elif case == "manual_one":
        module = ManualModule(step_cost=0.004)
    elif case == "manual_two":
        module = ManualModule(two=True, step_cost=0.004)
    elif case == "eval_after_fit":
        pass
    elif case == "rebalance":
        module = ToyModule(step_cost=0.01, n=4096)
        kwargs.update(max_epochs=1)
        callbacks = [HeterogeneityEmulator({1: [(0.0, 1.0), (0.6, 3.0)]})]
    elif case == "resume_first":
        kwargs.update(max_epochs=1, enable_checkpointing=True, default_root_dir=str(out))
        callbacks += [ModelCheckpoint(dirpath=out / "ckpt", save_last=True)]
    elif case == "resume_second":
        kwargs.update(max_epochs=2, enable_checkpointing=True, default_root_dir=str(out))
    elif case == "iterable":
        module = IterableModule()
    elif case in ("sigterm_rank0", "sigterm_rank1"):
        kwargs.update(max_epochs=5, default_root_dir=str(out), enable_checkpointing=True)
        callbacks += [SendSignal(int(case[-1]), step=7), OnExceptionCheckpoint(dirpath=str(out / "preempt"))]
    elif case == "midepoch_first":
        strategy = OscarsStrategy(local_steps=[3, 1])
        kwargs.update(enable_checkpointing=True, default_root_dir=str(out))
        callbacks += [ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=5, save_top_k=-1)]
    elif case == "midepoch_second":
        strategy = OscarsStrategy(local_steps=[3, 1])
        kwargs.update(default_root_dir=str(out))
    elif case == "resume_swapped":  # resume_first's checkpoint, but now rank 0 is the slow one
        kwargs.update(max_epochs=3, default_root_dir=str(out))
        callbacks = [HeterogeneityEmulator({0: 3.0})]
    elif case == "resume_from_env":  # a checkpoint written by another world size
        kwargs.update(max_epochs=3, default_root_dir=str(out))
    elif case in ("deadline", "deadline_midepoch_first", "deadline_midepoch_second"):
        # Deadline rounds on a jittery 1.5x/4.5x cluster, validation twice per epoch (rounds cut mid-way).
        module = IndexedModule(n=480, batch_size=8, step_cost=0.002)
        strategy = OscarsStrategy(warmup_steps=2, deadline_rounds=True)
        callbacks = [HeterogeneityEmulator({0: 1.5, 1: 4.5}, jitter=0.6)]
        kwargs.update(max_epochs=3, val_check_interval=0.5, limit_val_batches=2)
        if case == "deadline_midepoch_first":
            kwargs.update(enable_checkpointing=True, default_root_dir=str(out))
            callbacks += [ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=13, save_top_k=-1)]
        elif case == "deadline_midepoch_second":
            kwargs.update(default_root_dir=str(out))
    elif case in ("timed_warmup", "fixed_warmup"):  # rank 1 3x slower; validation twice per epoch
        module = IndexedModule(n=480, batch_size=8, step_cost=0.004)
        strategy = OscarsStrategy(warmup_steps=2, timed_warmup=case == "timed_warmup")
        kwargs.update(max_epochs=2, val_check_interval=0.5, limit_val_batches=2)
    elif case in ("ps_ssp", "ps_dssp", "ps_asp", "ps_dasp"):  # the parameter-server paradigms; rank 1 3x slower
        module = IndexedModule(n=480, batch_size=8, step_cost=0.004)
        kwargs.update(max_epochs=2, val_check_interval=0.5, limit_val_batches=2)
        if case == "ps_ssp":
            strategy = SSPStrategy(staleness=2, warmup_steps=2)
        elif case == "ps_dssp":
            strategy = DSSPStrategy(s_low=1, s_range=3, warmup_steps=2)
        elif case == "ps_asp":  # with the time-boxed warm-up (off by default on the server)
            strategy = ASPStrategy(warmup_steps=2, timed_warmup=True)
        else:  # 3x slower for the first 2 s, then as fast as rank 0: out of the synchronous group and back
            # (6 epochs: on a loaded CI machine 4 left too little time at 1x for the smoothed speed to rejoin)
            strategy = DASPStrategy(leave=1.3, rejoin=1.15, patience=2, warmup_steps=2)
            callbacks = [HeterogeneityEmulator({1: [(0.0, 3.0), (2.0, 1.0)]})]
            kwargs.update(max_epochs=6)
    elif case in ("ripples_smart", "ripples_random", "ripples_overlap"):
        # ripples with rank 1 3x slower; validation twice per epoch. "overlap": smart groups, exchanged a step late
        module = IndexedModule(n=480, batch_size=8, step_cost=0.004)
        kwargs.update(max_epochs=2, val_check_interval=0.5, limit_val_batches=2)
        generator, overlap = ("smart", True) if case == "ripples_overlap" else (case.split("_")[1], False)
        strategy = RipplesStrategy(
            generator=generator, group_size=2, warmup_steps=2, max_local_steps=16, overlap=overlap
        )
    elif case == "overlap":  # validation twice per epoch: the averaging before it must leave the models equal
        strategy = OscarsStrategy(warmup_steps=2, overlap_averaging=True)
        module = IndexedModule(n=480, batch_size=8, step_cost=0.004)
        kwargs.update(val_check_interval=0.5, limit_val_batches=2)
        callbacks += [SettledProbe()]
    elif case.partition("_")[0] in LIFECYCLE_PARADIGMS and case.partition("_")[2] in STEP_SYNCED_LIFECYCLE:
        # The step-synchronised paradigms under preemption, resume and a time limit; rank 1 3x slower.
        paradigm, _, what = case.partition("_")
        module = IndexedModule(n=480, batch_size=8, step_cost=0.004)
        kwargs.update(max_epochs=3, val_check_interval=0.5, limit_val_batches=2, default_root_dir=str(out))
        if paradigm == "ripples":
            strategy = RipplesStrategy(generator="smart", group_size=2, warmup_steps=2, max_local_steps=16)
        elif paradigm == "overlap":
            strategy = OscarsStrategy(warmup_steps=2, overlap_averaging=True)
        else:
            strategy = SSPStrategy(staleness=2, warmup_steps=2)
        if what == "midepoch_first":
            kwargs.update(enable_checkpointing=True)
            callbacks += [ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=13, save_top_k=-1)]
        elif what == "sigterm":
            kwargs.update(max_epochs=5, enable_checkpointing=True)
            callbacks += [SendSignal(1, step=7), OnExceptionCheckpoint(dirpath=str(out / "preempt"))]
        elif what == "max_time":
            kwargs.update(max_epochs=1000, max_time={"seconds": 4})
        elif what == "time_checkpoint":  # broadcasts at every batch: refused at the start of training
            kwargs.update(enable_checkpointing=True)
            callbacks += [ModelCheckpoint(dirpath=out / "timed", train_time_interval=timedelta(seconds=1))]
    elif case == "warmup_too_long":
        strategy = OscarsStrategy(warmup_steps=8)
        kwargs.update(max_epochs=-1, max_steps=5)
    elif case in ("exact_a", "exact_b", "preempt_first", "preempt_resume"):
        # Deterministic: emulated (pinned) speeds, optimizer state averaged so a checkpoint holds every rank's.
        strategy = OscarsStrategy(step_times=[0.01, 0.03], average_optimizer_state=True)
        kwargs.update(default_root_dir=str(out), enable_checkpointing=case == "preempt_first")
        callbacks = []
        if case == "preempt_first":
            callbacks = [SendSignal(1, step=20), OnExceptionCheckpoint(dirpath=str(out / "preempt"))]
    elif case in ("raise_rank1", "hang_rank1", "kill_rank1"):
        module = FaultyModule(case.split("_")[0], out=out, step_cost=0.004)
        strategy = OscarsStrategy(warmup_steps=2, timeout=timedelta(seconds=8))
        callbacks = []  # no emulator: it would stretch the injected hang by its slowdown factor
    elif case in ("ps_raise_rank1", "ripples_raise_rank1"):  # rank 1 raises at its 5th step; rank 0 waits for it
        module = FaultyModule("raise", step_cost=0.004)
        if case == "ps_raise_rank1":  # on the server
            strategy = SSPStrategy(staleness=1, warmup_steps=2, timeout=timedelta(seconds=8))
        else:  # in a group
            strategy = RipplesStrategy(generator="random", warmup_steps=2, timeout=timedelta(seconds=8))
        callbacks = []
    elif case == "soak":  # both ranks change speed at random every 2-4 s, for SOAK_SECONDS
        import random

        rng = random.Random(7)
        seconds = float(os.environ.get("SOAK_SECONDS", "45"))
        profiles: dict = {0: [], 1: []}
        for rank in (0, 1):
            t = 0.0
            while t < seconds:
                profiles[rank].append((t, rng.choice([1.0, 1.5, 2.0, 3.0, 4.0])))
                t += rng.uniform(2.0, 4.0)
        module = ToyModule(step_cost=0.002, n=2048)
        kwargs.update(max_epochs=10_000, max_time={"seconds": seconds}, limit_val_batches=1, val_check_interval=0.5)
        callbacks = [HeterogeneityEmulator(profiles, jitter=0.2)]
    elif case == "requeue":  # a SLURM-style SIGUSR1 on rank 1 only; its handler writes a checkpoint
        kwargs.update(default_root_dir=str(out), enable_checkpointing=True)
        callbacks += [SendSignal(1, step=7, signum=signal.SIGUSR1)]
    elif case == "accumulation":  # 10 batches in units of 4 (the last unit holds 2), then units of 2
        module = CountingModule(n=160, batch_size=16)
        strategy = OscarsStrategy(local_steps=[2, 1])
        callbacks = [GradientAccumulationScheduler({0: 4, 1: 2})]
    elif case == "weighted_sampler":
        module = IndexedModule("weighted")
        strategy = OscarsStrategy(local_steps=[3, 1])
        callbacks = []
    elif case == "slow_checkpoint_write":
        module = ToyModule(step_cost=0.01, n=2048)
        kwargs.update(max_epochs=1, enable_checkpointing=True, default_root_dir=str(out), plugins=[SlowCheckpointIO()])
        callbacks += [ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=20, save_top_k=-1)]
    elif case == "builtin_callbacks":  # rank 0 is the one with no-op slots (1 of every 3 slots real)
        module = ProbeModule()
        strategy = OscarsStrategy(local_steps=[1, 3])
        kwargs.update(
            max_epochs=2,
            logger=CSVLogger(out / "csv"),
            log_every_n_steps=1,
            enable_checkpointing=True,
            enable_progress_bar=True,  # rank 0's bar reduces the epoch's sync_dist values on its own
        )
        callbacks = [
            EMAWeightAveraging(decay=0.9),
            ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=7, save_top_k=-1),
            LearningRateMonitor(logging_interval="step"),
            ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0)),
            BatchProbe(),
        ]
    elif case == "swa_and_accumulation":
        module = CountingModule(step_cost=0.004)
        kwargs.update(max_epochs=3)
        callbacks += [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1), GradientAccumulationScheduler({2: 2})]
    elif case == "optimizer_state_unused_head":
        module = UnusedHeadModule(step_cost=0.004)
        strategy = OscarsStrategy(warmup_steps=2, average_optimizer_state=True)
    elif case == "optimizer_state_lbfgs":
        module = LBFGSModule(step_cost=0.004)
        strategy = OscarsStrategy(warmup_steps=2, average_optimizer_state=True)
        kwargs.update(max_epochs=1)
    elif case == "fast_dev_run":
        strategy = OscarsStrategy()
        kwargs.update(fast_dev_run=True)
    elif case == "batch_size_finder":
        callbacks += [BatchSizeFinder()]
    elif case == "spawn_then_save":
        strategy = OscarsStrategy(warmup_steps=2, start_method="spawn")
        kwargs.update(max_epochs=1)
        callbacks = []
    elif case == "tiny_dataset":
        module = ToyModule(n=16, batch_size=16)
    elif case == "metric_rare":  # torchmetrics objects, one logged on some batches only
        module = RareMetricModule(step_cost=0.004)
        strategy = OscarsStrategy(local_steps=[4, 1])  # rank 1 trains at batch_idx % 4 == 0 only: never logs it
    elif case == "two_loaders":
        module = TwoLoaderModule()
    elif case == "swa_batchnorm":  # SWA's BatchNorm epoch runs one batch beyond the epoch's plan
        kwargs.update(max_epochs=3)
        callbacks += [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]
    elif case == "monitor_step_value":  # callbacks deciding on a step value logged with sync_dist=True
        module = StepMonitoredModule(step_cost=0.004)
        kwargs.update(max_epochs=3, enable_checkpointing=True, default_root_dir=str(out), val_check_interval=0.5)
        name = "{epoch}-{step}-{train_loss:.5f}"
        callbacks += [
            ModelCheckpoint(dirpath=out / "val", monitor="train_loss", save_top_k=2, filename=name),  # at validation
            ModelCheckpoint(
                dirpath=out / "epoch",
                monitor="train_loss",
                mode="max",
                save_top_k=2,
                filename=name,
                save_on_train_epoch_end=True,
            ),
            ModelCheckpoint(
                dirpath=out / "steps", monitor="train_loss", every_n_train_steps=5, save_top_k=3, filename=name
            ),
            EarlyStopping(monitor="train_loss", patience=2),  # at validation
            EarlyStopping(monitor="train_loss", mode="max", patience=2, check_on_train_epoch_end=True),
            MonitorState(),
        ]
    elif case == "lr_find":  # Tuner(trainer).lr_find(module), then the fit
        kwargs.update(max_epochs=1, default_root_dir=str(out))
    elif case == "epoch_mean":
        module = EpochMeanModule(step_cost=0.004)
    elif case == "limit_quarter":  # 16 batches per rank under ddp: 4 trained, validation after 2 and 4
        kwargs.update(limit_train_batches=0.25, val_check_interval=0.5, limit_val_batches=1)
    else:
        raise SystemExit(f"unknown case {case}")
    return module, kwargs, strategy, callbacks


def flat_weights(module: torch.nn.Module) -> list[float]:
    return torch.cat([t.detach().float().reshape(-1) for t in module.state_dict().values()]).tolist()


def main() -> None:
    """``run_case.py CASE OUT`` or, for a batch of independent cases fitted one after another in the same two
    processes (one launch, one process group), ``run_case.py CASE+CASE+... OUT``: each writes to ``OUT/CASE``."""
    cases, out = sys.argv[1].split("+"), Path(sys.argv[2])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang prints every rank's stack (to the test's log) and exits instead of waiting
        faulthandler.dump_traceback_later(dump_after, exit=True)
    for case in cases:
        target = out / case if len(cases) > 1 else out
        target.mkdir(parents=True, exist_ok=True)
        run_one(case, target)


def run_one(case: str, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    module, kwargs, strategy, callbacks = build(case, out)
    counter = CollectiveCounter()
    seen_at, per_epoch = SeenAtStep(), SeenPerEpoch()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, callbacks=[*callbacks, counter, seen_at, per_epoch], **kwargs
    )
    result: dict = {}
    ckpt = None
    if case in ("resume_second", "resume_swapped"):
        ckpt = str(out / "ckpt" / "last.ckpt")
    elif case == "midepoch_second":
        ckpt = str(out / "steps" / "epoch=0-step=5.ckpt")
    elif case in ("deadline_midepoch_second", *(f"{p}_midepoch_second" for p in LIFECYCLE_PARADIGMS)):
        ckpt = str(out / "steps" / "epoch=0-step=13.ckpt")
    elif case == "resume_from_env":
        ckpt = os.environ["OSCARS_TEST_CKPT"]
    elif case == "preempt_resume":
        ckpt = str(out / "preempt" / "on_exception.ckpt")
    handled_at: list[int] = []
    if case == "requeue":

        def requeue(signum, frame):  # like Lightning's SLURM handler: a checkpoint (collectives) from a handler
            handled_at.append(trainer.global_step)
            trainer.save_checkpoint(out / f"requeue-{trainer.global_step}.ckpt")

        signal.signal(signal.SIGUSR1, requeue)
    started = time.perf_counter()
    try:
        if case == "lr_find":
            from lightning.pytorch.tuner import Tuner

            finder = Tuner(trainer).lr_find(module, num_training=20)
            assert finder is not None
            result["lr_find"] = {"suggestion": finder.suggestion(), "losses": finder.results["loss"], "lr": module.lr}
        trainer.fit(module, ckpt_path=ckpt)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - reported to the test (SIGTERMException is a SystemExit)
        if os.environ.get("OSCARS_TEST_TRACEBACK"):
            import traceback

            traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"
        result["error_after_s"] = time.perf_counter() - started
    if case == "spawn_then_save" and "error" not in result:
        try:
            trainer.save_checkpoint(out / "main.ckpt")
            result["saved"] = (out / "main.ckpt").exists()
        except Exception as error:  # noqa: BLE001 - reported to the test
            result["error"] = f"after fit: {type(error).__name__}: {error}"
    if case == "eval_after_fit" and "error" not in result:
        result["validate"] = trainer.validate(module, verbose=False)
        result["test"] = trainer.test(module, verbose=False)
        preds = trainer.predict(module)
        result["predicted"] = sum(len(p) for p in preds)
    s = trainer.strategy
    result.update(
        rank=trainer.global_rank,
        weights=flat_weights(module),
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        steps_taken=module.steps_taken,
        seen=module.seen,
        collectives=counter.count,
        metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        lr=[g["lr"] for opt in trainer.optimizers for g in opt.param_groups],
        seen_at=seen_at.seen,
        seen_per_epoch=per_epoch.per_epoch,
        validations_per_epoch=per_epoch.validations,
        handled_at=handled_at,
    )
    names = ("optimizer_steps", "steps_per_epoch", "trained", "trained_steps", "rare_sums", "loss_sums")
    for name in (*names, "grad_norms", "step_dtypes"):
        if hasattr(module, name):
            result[name] = getattr(module, name)
    if hasattr(module, "big"):
        result["big"] = module.big.tolist()
    for cb in trainer.callbacks:
        if isinstance(cb, BatchProbe):
            result.update(probe=cb.seen, throughput_samples=cb.throughput_samples)
        if isinstance(cb, MonitorState):
            result["monitor_state"] = cb.state
        if isinstance(cb, SettledProbe):
            result.update(settled=cb.settled, at_validation=cb.at_validation)
    if isinstance(s, OscarsStrategy):
        rounds = s.rounds  # None when the fit was refused before it began
        plan = None if rounds is None else rounds.plan
        result.update(
            history=[r.as_dict() for r in s.history],
            round_costs=[] if rounds is None else rounds.state_dict()["round_costs"],  # the last rounds' fixed costs
            num_averagings=s.num_averagings,
            schedule=list(s.schedule.local_steps) if s.schedule else None,
            # the last epoch's plan: where its rounds ended
            round_ends=[r.end_slot for r in plan.rounds] if plan is not None else None,
            validated_at=per_epoch.validated_at,
            round_ends_per_epoch=per_epoch.round_ends,
        )
    scheme = getattr(s, "scheme", None)
    if isinstance(s, ParameterServerStrategy) and scheme is not None:
        result["ps"] = scheme.report  # type: ignore[attr-defined]
    if hasattr(scheme, "meetings"):
        result["scheme_meetings"] = scheme.meetings  # type: ignore[union-attr]
    if hasattr(scheme, "applied_late"):
        result["applied_late"] = scheme.applied_late  # type: ignore[union-attr]
    if isinstance(s, RipplesStrategy) and scheme is not None:
        result["ripples"] = scheme.report  # type: ignore[attr-defined]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
