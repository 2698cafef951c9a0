"""One fit under ``balance="batch"``: ddp's synchronous steps, each rank's share of the global batch sized to its speed.

:class:`BatchBalanceSession` wires the pure parts (``core/share_loader.py``'s loader, ``core/batch_shares.py``'s
schedule and balancer) and the step's collective (``dist/batch_weighting.py``) to the trainer:

* the training loader becomes a :class:`~lightning_oscars.core.share_loader.ShareLoader` (ddp's global batches in
  ddp's order, this rank's share of each);
* before backward, the loss is scaled by the rank's share (:func:`~lightning_oscars.dist.batch_weighting.share_weight`);
  after the backward that ends an optimizer step (not inside Lightning's gradient accumulation), one all-reduce
  makes the mean gradient, spreads rank 0's buffers and carries each rank's measured step;
* a rank's step is the time of its own work between two such all-reduces, less the time it spent in any other
  collective (``WaitTimer``: Lightning's per-batch SIGTERM broadcast, ``self.log(..., sync_dist=True)`` wait for the
  slowest rank) and with validation, epoch ends and checkpoint writes left out; the balancer re-solves the shares
  from those measures, and a change takes effect a few batches ahead on every rank alike.

Every rank runs the same batches and the same collectives, as under ddp, so Lightning's loops, hooks and
collectives are left as they are: the session installs one callback (removed at its end) and patches nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_oscars.core.batch_shares import BatchKey, ShareBalancer, ShareSchedule, resolve_batch_sizes
from lightning_oscars.core.epoch_order import EpochOrder, training_set_size
from lightning_oscars.core.loader_shape import describe_shape, loader_shape
from lightning_oscars.core.share_loader import ShareLoader, rank_batch_size, saved_position
from lightning_oscars.dist.batch_weighting import StepSync, WaitTimer, share_weight
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.batch_probe import auto_batch_fits
from lightning_oscars.lightning.batch_recovery import BatchRecovery
from lightning_oscars.lightning.every_rank import on_every_rank
from lightning_oscars.lightning.loader_patch import UserBatching

__all__ = ["BatchBalanceSession", "ShareChange", "rank_device_names"]

ShareChange = tuple[int, int, list[int]]  # (epoch, batch, shares from that batch on)


class BatchBalanceSession:
    """One fit under ``balance="batch"`` (see the module docstring).

    Args:
        strategy: the Lightning strategy whose ranks, device, module and collectives the fit uses.
        batch_sizes: the user's per-rank caps (a list by rank, a dict by device name, or ``None``).
        warmup_steps, min_gain, smoothing: the balancer's (``ShareBalancer``).
        step_times: pinned seconds per step of every rank at the user's batch size (no measuring).
        seed: the strategy's shuffle seed (``None``: the sampler's or ``seed_everything``'s).
        restored: the ``"oscars_batch"`` entry of the checkpoint the fit resumes from.
        resumed_from_local_steps: the checkpoint was written under ``balance="steps"`` (its epoch's data was split
            by rounds, not by ddp's batches: only an epoch boundary can be resumed).
        recovery: what the fit saves when a peer is lost, and the point it resumes from (``None``: nothing saved).
    """

    def __init__(
        self,
        strategy: ParallelStrategy,
        *,
        batch_sizes: Sequence[int] | dict[str, int] | str | None,
        warmup_steps: int,
        min_gain: float,
        smoothing: float,
        step_times: Sequence[float] | None = None,
        seed: int | None = None,
        restored: dict[str, Any] | None = None,
        resumed_from_local_steps: bool = False,
        monitor: bool = True,
        recovery: BatchRecovery | None = None,
    ) -> None:
        self.strategy = strategy
        self.batch_sizes = batch_sizes
        self.warmup_steps, self.min_gain, self.smoothing = warmup_steps, min_gain, smoothing
        self.step_times = None if step_times is None else list(step_times)
        self.seed = seed
        self.restored = restored
        self.resumed_from_local_steps = resumed_from_local_steps
        self.monitor = monitor
        self.recovery = recovery
        self._logged: list[int] = []
        self.loader: ShareLoader | None = None
        self.schedule: ShareSchedule | None = None
        self.balancer: ShareBalancer | None = None
        self.caps: list[int] | None = None
        self.changes: list[ShareChange] = []  # every change of the shares in this fit, as agreed
        # Every optimizer step's shares, run-length encoded ([shares, steps] pairs): a long fit keeps a few entries.
        self.step_runs: list[tuple[list[int], int]] = []
        self._trainer: Trainer | None = None
        self._callback: _BatchCallback | None = None
        self._sync: StepSync | None = None
        self._key: BatchKey = (0, 0)
        self._step_first: BatchKey = (0, 0)  # the first batch of the optimizer step not yet taken
        self._shares: list[int] = []
        self._samples = 0  # this rank's samples since the last all-reduce, and in how many batches
        self._batches = 0
        self._blocked = False  # inside Lightning's gradient accumulation: no all-reduce after this backward
        self._last_sync: float | None = None  # when the last all-reduce returned (None: the next step is not measured)
        self._excluded = 0.0
        self._wait_timer: WaitTimer | None = None
        self._error: Exception | None = None
        self.ended = False
        self._user_batching = UserBatching(strategy)

    # ------------------------------------------------------------------ lifecycle

    def begin(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._user_batching.install(trainer)  # a loader that batches itself reaches wrap_dataloader, refused there
        self._callback = _BatchCallback(self)
        trainer.callbacks.insert(0, self._callback)  # type: ignore[attr-defined]
        self._wait_timer = WaitTimer(self.exclude)
        self._wait_timer.__enter__()
        if self.recovery is not None:
            self.recovery.begin()
            if self.recovery.survivor and "rng" in (self.restored or {}):
                internals.restore_rng_states(self.restored["rng"])  # type: ignore[index]

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self._user_batching.remove()
        if self.recovery is not None:
            self.recovery.end()
        if self._wait_timer is not None:
            self._wait_timer.__exit__(None, None, None)
            self._wait_timer = None
        if self._trainer is not None and self._callback is not None:
            mine = id(self._callback)
            self._trainer.callbacks = [cb for cb in self._trainer.callbacks if id(cb) != mine]  # type: ignore[attr-defined]
        self._trainer, self._callback, self._sync = None, None, None
        if self.loader is not None:
            self.loader.close()

    @property
    def steps(self) -> list[list[int]]:
        """Every optimizer step's shares, in order (expanded from :attr:`step_runs`)."""
        return [list(shares) for shares, count in self.step_runs for _ in range(count)]

    def fitting(self, trainer: Trainer | None) -> bool:
        return not self.ended and trainer is not None and trainer is self._trainer

    # ------------------------------------------------------------------ data

    def wrap_dataloader(self, trainer: Trainer, dataloader: object) -> ShareLoader:
        if not isinstance(dataloader, DataLoader):
            raise ValueError(f"balance='batch' needs a torch DataLoader for training, got {type(dataloader).__name__}")
        strategy = self.strategy
        world, rank = strategy.world_size, strategy.global_rank
        # A rank's failure to read its loader is every rank's, before the first collective (every_rank.py).
        order, batch = on_every_rank(
            strategy, "building the training loader", lambda: _read_loader(dataloader, self.seed), agree=_size_of
        )
        total = batch * world
        if self.schedule is None or self.schedule.total != total:
            self._plan(total, world, dataloader)
        assert self.schedule is not None
        loader = ShareLoader(dataloader, rank, world, order, self.schedule)
        loader.before_epoch = lambda: self._start_epoch(trainer)
        self.loader = loader
        return loader

    def _plan(self, total: int, world: int, dataloader: DataLoader) -> None:
        """The caps, the balancer and the first shares (a resumed fit's, when its global batch is the same)."""
        sizes = self.batch_sizes
        if isinstance(sizes, str):  # "auto": on CUDA, a probe of what each rank fits
            self.caps = auto_batch_fits(self.strategy, dataloader)
        else:
            self.caps = resolve_batch_sizes(sizes, world, self._device_names())
        self.balancer = ShareBalancer(
            total, world, self.caps, self.warmup_steps, self.min_gain, self.smoothing, pinned=self.step_times
        )
        first = self.balancer.initial()
        saved = (self.restored or {}).get("shares")
        if saved is not None and len(saved) == world and sum(saved) == total:
            if self.caps is None or all(n <= c for n, c in zip(saved, self.caps)):
                first = [int(n) for n in saved]
        self.schedule = ShareSchedule(first)
        self.changes = [(-1, 0, list(first))]

    def _device_names(self) -> list[str]:
        return rank_device_names(self.strategy, isinstance(self.batch_sizes, dict))

    def _start_epoch(self, trainer: Trainer) -> None:
        """An epoch's first batch is fetched: hand the loader the epoch, its order and where a resume starts."""
        loader = self.loader
        assert loader is not None
        order = None
        if loader.order.shared:  # a custom sampler's draw: rank 0's, for every rank (one collective, on all)
            mine = loader.order.draw(trainer.current_epoch) if self.strategy.global_rank == 0 else None
            order = self.strategy.broadcast(mine, src=0)
        start = internals.resume_position(trainer) or 0
        epoch = trainer.current_epoch
        if 0 < start < len(loader) and self.resumed_from_local_steps:
            self._error = ValueError(
                f"This checkpoint was written mid-epoch (batch {start}) under balance='steps', whose epoch is split by"
                " rounds, not by ddp's global batches: balance='batch' cannot tell which samples are left. Resume it"
                " with balance='steps', or from a checkpoint written at an epoch's end."
            )
        self.resumed_from_local_steps = False
        position = None
        saved = self.restored or {}
        if start > 0 and "world" in saved:  # where the world that wrote the checkpoint stood (any world size)
            position = saved_position(loader.order.num_samples, loader.drop_last, saved, epoch, start)
        was = len(loader)
        loader.start_epoch(epoch, order, start_batch=start, position=position)
        self._step_first = (epoch, start)
        if len(loader) != was or loader.resumed is not None:
            internals.size_training_epoch(trainer, len(loader))  # a resumed epoch laid out anew, or the one after

    # ------------------------------------------------------------------ each step

    def start_batch(self, trainer: Trainer, batch_idx: int) -> None:
        if self._error is not None:
            raise self._error
        assert self.loader is not None
        self._key = (trainer.current_epoch, batch_idx)
        if self._batches == 0:
            self._step_first = self._key
        self._shares = self.loader.shares(*self._key)
        if self.monitor and self._shares != self._logged and sum(self._shares) == self.loader.schedule.total:
            self._logged = list(self._shares)
            metrics = {f"oscars/share_rank{r}": float(n) for r, n in enumerate(self._shares)}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        self._samples += self._shares[self.strategy.global_rank]
        self._batches += 1

    def loss_weight(self) -> float:
        return share_weight(self._shares, self.strategy.global_rank) if self._shares else 1.0

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Lightning's gradient accumulation: the backward inside does not end an optimizer step."""
        blocked, self._blocked = self._blocked, True
        try:
            yield
        finally:
            self._blocked = blocked

    def after_backward(self) -> None:
        """A backward ended: unless it is inside an accumulation, the step's all-reduce."""
        if self._blocked or self.ended:
            return
        module = self.strategy.lightning_module
        if self._sync is None:
            assert module is not None
            self._sync = StepSync(module)
        device = self.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels are this rank's work, not the wait that follows
        now = time.perf_counter()
        world, rank = self.strategy.world_size, self.strategy.global_rank
        measured = 0.0 if self._last_sync is None else max(now - self._last_sync - self._excluded, 0.0)
        control = [0.0] * (2 * world)
        if measured > 0 and self._batches > 0:
            control[rank] = self._samples / self._batches
            control[world + rank] = measured / self._batches
        summed = self._sync.sync(control)
        self._last_sync, self._excluded = time.perf_counter(), 0.0
        self._step_first = (self._key[0], self._key[1] + 1)  # the optimizer update follows, with no collective
        if self.recovery is not None:
            self.recovery.stepped()
        if self.step_runs and self.step_runs[-1][0] == self._shares:
            self.step_runs[-1] = (self.step_runs[-1][0], self.step_runs[-1][1] + 1)
        else:
            self.step_runs.append((list(self._shares), 1))
        self._samples = self._batches = 0
        self._observe([round(n) for n in summed[:world]], summed[world:])

    def _observe(self, samples: list[int], seconds: list[float]) -> None:
        assert self.balancer is not None and self.schedule is not None and self.loader is not None
        proposed = self.balancer.observe(samples, seconds, self.schedule.latest)
        if proposed is None:
            return
        trainer = self._trainer
        per_step = internals.accumulation_at(trainer, trainer.current_epoch) if trainer is not None else 1
        epoch, batch = self.loader.change_key(self._key, per_step)
        self.schedule.change((epoch, batch), proposed)
        self.changes.append((epoch, batch, list(proposed)))

    def report(self) -> None:
        """The end of fit's summary (rank 0): the shares and how they moved."""
        if self.monitor and self.schedule is not None:
            moves = ", ".join(f"{shares} from epoch {e} batch {b}" for e, b, shares in self.changes[1:]) or "none"
            steps = sum(n for _, n in self.step_runs)
            rank_zero_info(
                f"oscars (balance='batch'): {steps} steps over global batches of {self.schedule.total};"
                f" first shares {self.changes[0][2]}, changes: {moves}"
            )

    def pause(self) -> None:
        """Validation, an epoch's end or a checkpoint write: the step running across it is not measured."""
        self._last_sync = None

    def exclude(self, seconds: float) -> None:
        """Time this rank spent inside a collective (waiting for the others) since the last step."""
        self._excluded += seconds

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "balance": "batch",
            "shares": None if self.schedule is None else list(self.schedule.latest),
        }
        if self.loader is not None:  # the epoch's layout, so that another world can tell where a resume stands
            loader = self.loader
            state.update(world=loader.world_size, total=loader.schedule.total, resumed=loader.resumed)
        return state

    def failed(self, error: BaseException) -> None:
        """The fit is ending with ``error``: with recovery, a survivor of a lost peer saves its state."""
        trainer = self._trainer
        if self.recovery is None or trainer is None:
            return
        epoch, batch = self._step_first
        if epoch != trainer.current_epoch:  # the epoch ended with its last step: the next one starts whole
            batch = 0
        self.recovery.failed(error, trainer, self.state_dict(), batch)


class _BatchCallback(Callback):
    """Tells the session which batch runs, and where the measuring must pause (a checkpoint write pauses it in the
    strategy's ``save_checkpoint``)."""

    def __init__(self, session: BatchBalanceSession) -> None:
        self.session = session

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.session.start_batch(trainer, batch_idx)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.session.report()
        if self.session.recovery is not None:
            self.session.recovery.fit_ended()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.session.failed(exception)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.session.pause()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.session.pause()


def rank_device_names(strategy: ParallelStrategy, needed: bool) -> list[str]:
    """Every rank's device name (``torch.cuda.get_device_name()``, else the device type): one collective, on every
    rank, only when ``needed`` (batch sizes given by device name); ``[]`` otherwise."""
    if not needed:
        return []
    device = strategy.root_device
    mine = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    names: list[Any] = [None] * strategy.world_size
    torch.distributed.all_gather_object(names, mine)
    return [str(n) for n in names]


def _read_loader(dataloader: DataLoader, seed: int | None) -> tuple[EpochOrder, int]:
    """The user's loader's epoch order and batch size per rank (ddp's), or why balance="batch" cannot cut it."""
    shape = loader_shape(dataloader)
    if shape != "samples":
        raise ValueError(
            f"balance='batch' cannot apply to the training DataLoader: it has {describe_shape(shape)}, and ddp's"
            " global batch is cut into shares sample by sample. Use balance='steps' (the default), which trains"
            " the loader's own batches whole, or give the DataLoader a batch_size."
        )
    order = EpochOrder.of(internals.unwrap_sampler(dataloader.sampler), training_set_size(dataloader), seed)
    return order, rank_batch_size(dataloader)


def _size_of(read: tuple[EpochOrder, int]) -> str:
    return f"{read[0].num_samples} samples in batches of {read[1]}"
