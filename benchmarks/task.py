"""The benchmarks' learnable task and how they emulate slow ranks.

The task: 10 classes with 4 Gaussian modes each in 32 dimensions (not linearly separable, noisy enough that
accuracy stays informative: a few percent of samples are ambiguous), made by the project, no downloads.
The model: an MLP with BatchNorm, sized so one step costs a few milliseconds on one CPU core.

Two regimes. *CPU-bound* (``step_ms=0``): a step is real compute only, a few milliseconds on one core, where
two ranks on two cores contend and Lightning's per-step work weighs. *GPU-like* (``step_ms`` >= 30): every step
also sleeps ``step_ms`` milliseconds, as a host waits for its GPU; the compute is small beside it, so even four
ranks on two cores do not contend and what remains is the strategy's own cost.

Slow ranks: at the start of training every rank times a few pure-compute steps (forward, backward, SGD) on a
copy of the model, with no communication; with the sleep this gives its solo device time ``t`` per step. A rank
emulated ``k`` times slower then sleeps ``(k - 1) * t`` more in every real training step. Unlike sleeping in
proportion to the measured batch time, this does not also slow down ddp's in-step gradient all-reduce, so every
strategy faces the same cluster: one GPU ``k`` times slower on the same network.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import time

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_oscars import SlowdownProfile


def make_dataset(n: int, seed: int, dim: int = 32, classes: int = 10, noise: float = 1.6) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)  # the task itself is fixed; `seed` draws the samples
    centers = torch.randn(classes, 4, dim, generator=g) * 1.5  # 4 modes per class: not linearly separable
    s = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=s)
    mode = torch.randint(0, 4, (n,), generator=s)
    x = centers[y, mode] + torch.randn(n, dim, generator=s) * noise
    return TensorDataset(x, y)


@functools.lru_cache(maxsize=2)
def load_digits_split(test_size: int = 360) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's handwritten digits (1,797 real 8x8 images, shipped with the package: no download), scaled to
    [0, 1], as (train, test): a fixed, class-stratified split of ``test_size`` test images (seed 0)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    test = []
    for label in range(10):  # the same share of every class in the test set
        members = torch.nonzero(y == label).flatten()
        members = members[torch.randperm(len(members), generator=g)]
        test.append(members[: round(test_size * len(members) / len(y))])
    held = torch.cat(test)
    train = torch.ones(len(y), dtype=torch.bool)
    train[held] = False
    return TensorDataset(x[train], y[train]), TensorDataset(x[held], y[held])


def digits_cnn() -> nn.Module:
    """A small CNN for 8x8 digits: two 3x3 convolutions, a max-pool, two linear layers (no buffers)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@functools.lru_cache(maxsize=2)
def load_text_split(train_windows: int = 4096, test_windows: int = 512, length: int = 64) -> tuple[TensorDataset, ...]:
    """Real text without a download: the source files of Python's own standard library, as bytes, cut into windows of
    ``length`` bytes (input) and the same shifted by one (the next byte to predict), as (train, test). The files are
    taken in sorted order; the test windows come from files after the training ones."""
    import sysconfig
    from pathlib import Path

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    need = (train_windows + test_windows) * length + 1
    text = bytearray()
    for path in files:
        text += path.read_bytes()
        if len(text) >= need:
            break
    data = torch.tensor(list(text[:need]), dtype=torch.long)
    windows = data[: (train_windows + test_windows) * length].reshape(-1, length)
    targets = data[1:need].reshape(-1, length)
    return (
        TensorDataset(windows[:train_windows], targets[:train_windows]),
        TensorDataset(windows[train_windows:], targets[train_windows:]),
    )


class ByteTransformer(nn.Module):
    """A small causal transformer language model over bytes (2 layers, width 64, 4 heads, learned positions): logits
    as ``(batch, 256, length)``, so that ``cross_entropy(model(x), y)`` is the loss in nats per byte."""

    def __init__(self, length: int = 64, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        h = self.blocks(self.embed(x) + self.position[:t], mask=self.causal[:t, :t], is_causal=True)
        return self.head(h).transpose(1, 2)


def parse_profile(text: str) -> dict[int, list[tuple[float, float]]]:
    """``'1:3'``: rank 1 always 3x; ``'1:3@0,1@4;0:1@0,3@4'``: ranks 0 and 1 swap speeds after 4 s."""
    out: dict[int, list[tuple[float, float]]] = {}
    for part in filter(None, text.split(";")):
        rank, spec = part.split(":")
        steps = []
        for item in spec.split(","):
            factor, _, start = item.partition("@")
            steps.append((float(start or 0.0), float(factor)))
        out[int(rank)] = sorted(steps)
    return out


class EmulatedDevice:
    """One rank's emulated accelerator: the sleep each training step adds, and the rank's own accounting.

    :meth:`calibrate` times a few pure-compute steps of a copy of the network (no communication); with the
    regime's sleep this is the rank's solo device time ``t`` per step. A rank ``k`` times slower sleeps
    ``(k - 1) * t`` more in every step; ``jitter`` adds mean-preserving lognormal noise to the whole step (a
    noisy shared node). Shared by the Lightning module and the plain loops of ``benchmarks.peers``.
    """

    def __init__(
        self, rank: int, slowdown: str = "", step_ms: float = 0.0, jitter: float = 0.0, per_sample_ms: float = 0.0
    ) -> None:
        spec = parse_profile(slowdown).get(rank)
        self.profile = SlowdownProfile(spec) if spec else None
        self.sleep_s = step_ms / 1e3
        # A step whose device time grows with its batch, as on a GPU: ``step_ms + per_sample_ms * samples`` of sleep.
        self.per_sample_s = per_sample_ms / 1e3
        self.batch_size = 0  # the batch the calibration timed (its sleep included in solo_step_s)
        self.samples = 0  # samples this rank trained
        self.jitter = jitter
        self.solo_step_s = 0.0  # device time per step (compute + sleep_s), before any emulated slowdown
        self.real_steps = 0
        self.busy_s = 0.0  # emulated device time: sum over steps of factor * solo_step_s
        self._rng = random.Random(1000 + rank)

    def calibrate(
        self, net: nn.Module, batch_size: int, steps: int = 12, sample: tuple[Tensor, Tensor] | None = None
    ) -> None:
        """``sample``: a batch of the task's inputs and labels (by default the Gaussian task's)."""
        net = copy.deepcopy(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        x, y = sample if sample is not None else make_dataset(batch_size, seed=99).tensors
        timings = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            timings.append(time.perf_counter() - start)
        self.batch_size = batch_size
        self.solo_step_s = sorted(timings[2:])[len(timings[2:]) // 2] + self.sleep_s + self.per_sample_s * batch_size

    def factor_at(self, elapsed: float) -> float:
        return 1.0 if self.profile is None else self.profile.factor_at(elapsed)

    def step(self, elapsed: float, samples: int | None = None) -> None:
        """Sleep what a step of ``samples`` samples (default: the calibrated batch) that started ``elapsed`` training
        seconds in adds on this device."""
        factor = self.factor_at(elapsed)
        samples = self.batch_size if samples is None else samples
        # The device time at this batch: the calibrated step's, its per-sample part scaled to this batch.
        solo = self.solo_step_s + self.per_sample_s * (samples - self.batch_size)
        delay = self.sleep_s + self.per_sample_s * samples + (factor - 1.0) * solo
        if self.jitter > 0.0:
            noise = math.exp(self._rng.gauss(0.0, self.jitter) - 0.5 * self.jitter**2)
            delay = max(0.0, delay + (noise - 1.0) * factor * solo)
        if delay > 0.0:
            time.sleep(delay)
        self.real_steps += 1
        self.samples += samples
        self.busy_s += factor * solo


class BenchModule(LightningModule):
    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        batch_size: int = 64,
        n_train: int = 16384,
        hidden: int = 512,
        noise: float = 1.6,
        slowdown: str = "",
        step_ms: float = 0.0,
        jitter: float = 0.0,
        ballast_mb: float = 0.0,
        task: str = "gaussian",
        per_sample_ms: float = 0.0,
    ) -> None:
        super().__init__()
        if task not in ("gaussian", "digits", "text"):
            raise ValueError(f"task must be 'gaussian', 'digits' or 'text', got {task!r}")
        self.save_hyperparameters()
        self.digits = load_digits_split() if task == "digits" else load_text_split() if task == "text" else None
        # A large model's communication without its compute (which the GPU-like regime's sleep stands for): this
        # many MB of float32 parameters that every all-reduce carries (ddp's gradients, every averaging) and that
        # take a zero gradient per step.
        self.ballast = nn.Parameter(torch.zeros(round(ballast_mb * 2**20 / 4))) if ballast_mb > 0 else None
        self.net = self.build_net()
        # (training seconds since the start, validation excluded; val loss; val acc)
        self.val_curve: list[tuple[float, float, float]] = []
        self.device_emulation = EmulatedDevice(0)  # replaced at train start, once the rank is known
        self.cluster: list[dict[str, float]] = []  # every rank's figures, gathered at the end of training
        self._t0 = 0.0
        self._validation_s = 0.0  # validation time, excluded from the training clock
        self._val_start = 0.0

    def train_clock(self) -> float:
        """Seconds of training since the start, validation excluded."""
        return time.perf_counter() - self._t0 - self._validation_s

    def build_net(self) -> nn.Module:
        """A fresh network of the task (the calibration times one when the trained one is sharded: FSDP2 modules
        cannot be copied)."""
        task, hidden = self.hparams.task, self.hparams.hidden
        if task == "digits":
            return digits_cnn()
        if task == "text":
            return ByteTransformer()
        return nn.Sequential(
            nn.Linear(32, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x):
        return self.net(x)

    def on_train_start(self) -> None:
        h = self.hparams
        self.device_emulation = EmulatedDevice(self.global_rank, h.slowdown, h.step_ms, h.jitter, h.per_sample_ms)
        sample = None if self.digits is None else self.digits[0].tensors
        if sample is not None:
            sample = (sample[0][: h.batch_size], sample[1][: h.batch_size])
        sharded = any(isinstance(p, DTensor) for p in self.net.parameters())
        self.device_emulation.calibrate(self.build_net() if sharded else self.net, h.batch_size, sample=sample)
        self._t0 = time.perf_counter()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.ballast is not None:
            loss = loss + 0.0 * self.ballast.sum()
        self.device_emulation.step(self.train_clock(), len(y))
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def on_validation_start(self) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self._validation_s += time.perf_counter() - self._val_start
        m = self.trainer.callback_metrics
        self.val_curve.append((self.train_clock(), float(m["val_loss"]), float(m["val_acc"])))

    def on_train_end(self) -> None:
        wall = self.train_clock()
        d = self.device_emulation
        figures = [d.solo_step_s, d.factor_at(0.0), d.real_steps, d.busy_s, wall, d.samples]
        gathered = self.all_gather(torch.tensor(figures, dtype=torch.float64)).reshape(-1, 6)  # outside a step
        keys = ("solo_step_s", "start_factor", "real_steps", "busy_s", "wall_s", "samples")
        self.cluster = [dict(zip(keys, row.tolist())) for row in gathered]

    def configure_optimizers(self):
        if self.hparams.task == "text":  # the language model trains as transformers do: AdamW
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)

    def train_dataloader(self):
        if self.digits is not None:
            return DataLoader(self.digits[0], batch_size=self.hparams.batch_size, shuffle=True)
        data = make_dataset(self.hparams.n_train, seed=0, noise=self.hparams.noise)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        if self.digits is not None:  # the held-out test images
            return DataLoader(self.digits[1], batch_size=512)
        return DataLoader(make_dataset(4096, seed=1, noise=self.hparams.noise), batch_size=512)
