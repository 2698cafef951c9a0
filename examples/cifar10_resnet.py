"""CIFAR-10 with a torchvision ResNet: the setting of the Oscars paper (which trained ResNet-101 on CIFAR-10 with
batch size 128), as a LightningCLI script. The strategy is a command-line option like any other.

    # real CIFAR-10 (downloaded once into --data.root, or read from an existing copy there)
    python examples/cifar10_resnet.py fit --config examples/configs/cifar10.yaml
    python examples/cifar10_resnet.py fit --config examples/configs/cifar10.yaml --data.root=/datasets/cifar10
    # the paper's model (its batch size, 128, is the default)
    python examples/cifar10_resnet.py fit --config examples/configs/cifar10.yaml --model.arch=resnet101
    # offline: CIFAR-shaped images made by this script, nothing downloaded
    python examples/cifar10_resnet.py fit --config examples/configs/cifar10.yaml --data.synthetic=true
    # the same run under ddp, for comparison
    python examples/cifar10_resnet.py fit --config examples/configs/cifar10.yaml --trainer.strategy=ddp

Needs the ``examples`` extra (torchvision). ``--data.root`` is the directory that holds (or will hold)
``cifar-10-batches-py``; with ``--data.download=false`` a missing copy is an error instead of a download.
Validation and test use CIFAR-10's 10,000-image test split, as the paper's accuracy curves do.

What is specific to oscars here: the learning-rate schedule steps per epoch (an epoch is one pass over the data
under every strategy, while the number of Lightning steps per epoch differs between ddp and oscars), and
BatchNorm running statistics are averaged with the weights at every round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

try:
    import torchvision
    from PIL import Image
    from torchvision.transforms import v2 as transforms
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "examples/cifar10_resnet.py needs torchvision: pip install 'lightning-oscars[examples]' "
        "(torchvision must match your torch release, e.g. torch==2.14.1 with torchvision==0.29.1)"
    ) from error

import lightning_oscars  # noqa: F401  (registers strategy="oscars", "oscars_alg1", "local_sgd")

__all__ = ["CIFAR10DataModule", "ResNetClassifier", "SyntheticCIFAR10", "main"]

NUM_CLASSES = 10
# Per-channel mean and standard deviation of the CIFAR-10 training images.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
ARCHITECTURES = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


class SyntheticCIFAR10(Dataset):
    """CIFAR-shaped images made here: ``data`` is ``(n, 32, 32, 3)`` uint8 and ``targets`` a list of labels, as in
    torchvision's ``CIFAR10``, and items are ``(PIL image, label)`` so the same transforms apply.

    Every class has a smooth random colour pattern (the task, fixed by ``task_seed``); an image is its class's
    pattern, randomly shifted by up to 4 pixels, times a random contrast, plus pixel noise. A ResNet-18 gets
    about 70% validation accuracy after 32 steps of batch 32 at lr 0.02 and nearly 100% after 100; random crops
    and flips keep the label.
    """

    def __init__(
        self,
        size: int,
        train: bool = True,
        transform: Any = None,
        task_seed: int = 0,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        task = np.random.default_rng(task_seed)
        # 8x8 colour patterns upsampled to 40x40: smooth structure a convolutional net can pick up.
        coarse = task.uniform(0, 255, size=(NUM_CLASSES, 8, 8, 3))
        patterns = coarse.repeat(5, axis=1).repeat(5, axis=2)
        rng = np.random.default_rng([task_seed, 1 if train else 2])
        self.targets: list[int] = rng.integers(0, NUM_CLASSES, size=size).tolist()
        shifts = rng.integers(0, 9, size=(size, 2))
        contrast = rng.uniform(0.6, 1.0, size=(size, 1, 1, 1))
        crops = np.stack([patterns[c, dy : dy + 32, dx : dx + 32] for c, (dy, dx) in zip(self.targets, shifts)])
        noise = rng.normal(0.0, 20.0, size=crops.shape)
        self.data: np.ndarray = np.clip(crops * contrast + noise, 0, 255).astype(np.uint8)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = Image.fromarray(self.data[index])
        return (self.transform(image) if self.transform is not None else image), self.targets[index]


def train_transform() -> transforms.Compose:
    """The standard CIFAR augmentation: 4-pixel padded random crop and horizontal flip, then normalisation."""
    return transforms.Compose(
        [
            transforms.ToImage(),
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToDtype(torch.float32, scale=True),
            transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
        ]
    )


def eval_transform() -> transforms.Compose:
    return transforms.Compose(
        [
            transforms.ToImage(),
            transforms.ToDtype(torch.float32, scale=True),
            transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
        ]
    )


class CIFAR10DataModule(LightningDataModule):
    """CIFAR-10 through torchvision's ``CIFAR10`` dataset, or offline CIFAR-shaped data.

    Args:
        root: directory that holds (or, with ``download``, will hold) ``cifar-10-batches-py``.
        download: download CIFAR-10 into ``root`` if it is not there (once per node, before training).
        synthetic: use :class:`SyntheticCIFAR10` instead of CIFAR-10: nothing is read or downloaded.
        synthetic_train_size: training images when ``synthetic``.
        synthetic_val_size: validation (and test) images when ``synthetic``.
        batch_size: batch size per rank (the paper used 128).
        num_workers: data-loading worker processes per rank.
    """

    def __init__(
        self,
        root: str = "data",
        download: bool = True,
        synthetic: bool = False,
        synthetic_train_size: int = 10_000,
        synthetic_val_size: int = 2_000,
        batch_size: int = 128,
        num_workers: int = 2,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        self.root = Path(root).expanduser()
        self.download, self.synthetic = download, synthetic
        self.synthetic_train_size, self.synthetic_val_size = synthetic_train_size, synthetic_val_size
        self.batch_size, self.num_workers = batch_size, num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node, before setup on every rank: download here, read there.
        if self.synthetic or not self.download:
            return
        try:
            torchvision.datasets.CIFAR10(str(self.root), train=True, download=True)
            torchvision.datasets.CIFAR10(str(self.root), train=False, download=True)
        except (OSError, RuntimeError) as error:
            raise RuntimeError(
                f"could not download CIFAR-10 into {self.root}: {error}. Without network access, point "
                "--data.root at an existing copy (the directory containing cifar-10-batches-py) or train on "
                "offline data with --data.synthetic=true"
            ) from error

    def _cifar10(self, train: bool) -> Dataset:
        transform = train_transform() if train else eval_transform()
        try:
            return torchvision.datasets.CIFAR10(str(self.root), train=train, transform=transform, download=False)
        except RuntimeError as error:  # torchvision: "Dataset not found or corrupted."
            raise FileNotFoundError(
                f"CIFAR-10 not found (or corrupted) under {self.root}: expected {self.root / 'cifar-10-batches-py'}. "
                "Pass --data.root pointing to the directory that contains it, --data.download=true to fetch it, "
                "or --data.synthetic=true for offline data"
            ) from error

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if self.synthetic:
            self.train_set = SyntheticCIFAR10(self.synthetic_train_size, train=True, transform=train_transform())
            self.val_set = SyntheticCIFAR10(self.synthetic_val_size, train=False, transform=eval_transform())
        else:
            self.train_set, self.val_set = self._cifar10(train=True), self._cifar10(train=False)

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)


def build_resnet(arch: str, num_classes: int = NUM_CLASSES, cifar_stem: bool = True) -> nn.Module:
    """A randomly initialised torchvision ResNet. ``cifar_stem`` swaps the ImageNet stem (7x7 stride-2 convolution
    and max-pool, which shrink a 32x32 image to 8x8 before the first block) for a 3x3 stride-1 convolution."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if cifar_stem:
        net.conv1 = nn.Conv2d(3, net.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    return net


class ResNetClassifier(LightningModule):
    """A torchvision ResNet trained with SGD (momentum, weight decay) and a per-epoch cosine learning rate.

    Args:
        arch: torchvision ResNet variant (the paper used resnet101).
        cifar_stem: 3x3 stride-1 first convolution and no max-pool, the usual choice for 32x32 images;
            ``false`` keeps the ImageNet stem (16x fewer FLOPs, lower accuracy).
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        nesterov: Nesterov momentum.
    """

    def __init__(
        self,
        arch: Literal["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"] = "resnet18",
        cifar_stem: bool = True,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        nesterov: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_resnet(arch, NUM_CLASSES, cifar_stem)
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov
        self.train_acc = MulticlassAccuracy(NUM_CLASSES)
        self.val_acc = MulticlassAccuracy(NUM_CLASSES)
        self.test_acc = MulticlassAccuracy(NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
        )
        epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        # Per epoch, not per step: under oscars the fast ranks take more optimizer steps per epoch than the slow
        # ones, and Lightning's step count is a slot count (see README, "global_step, epochs and max_steps").
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        ResNetClassifier,
        CIFAR10DataModule,
        args=args,
        run=run,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
