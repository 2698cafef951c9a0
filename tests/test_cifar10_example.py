"""examples/cifar10_resnet.py: the offline CIFAR-shaped data, the real CIFAR-10 loading path (torchvision's reader
over files in CIFAR-10's own format), clear errors when the data is missing or cannot be downloaded, the ResNet
stems, the configs through LightningCLI, and a 2-rank oscars fit on the offline data."""

from __future__ import annotations

import csv
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import yaml
from subproc import ROOT, as_cli, assert_clean_exit, load_script, run

from lightning_oscars import HeterogeneityEmulator, OscarsStrategy

EXAMPLE = ROOT / "examples" / "cifar10_resnet.py"
CONFIGS = ROOT / "examples" / "configs"
TIMEOUT = 240


@pytest.fixture(scope="module")
def example():
    return load_script(EXAMPLE, "oscars_cifar10_example")


@pytest.fixture(autouse=True)
def _isolated():
    with as_cli(EXAMPLE):
        yield


# ---------------------------------------------------------------- offline data


def test_synthetic_data_has_cifar10_layout(example):
    data = example.SyntheticCIFAR10(500, train=True)
    assert data.data.shape == (500, 32, 32, 3) and data.data.dtype == np.uint8
    assert len(data) == 500 and set(data.targets) == set(range(10))
    image, label = data[0]
    assert image.size == (32, 32) and image.mode == "RGB" and label == data.targets[0]
    tensor, _ = example.SyntheticCIFAR10(4, transform=example.eval_transform())[0]
    assert tensor.shape == (3, 32, 32) and tensor.dtype == torch.float32


def test_synthetic_data_is_seeded(example):
    a, b = example.SyntheticCIFAR10(64, train=True), example.SyntheticCIFAR10(64, train=True)
    assert np.array_equal(a.data, b.data) and a.targets == b.targets
    val = example.SyntheticCIFAR10(64, train=False)
    assert not np.array_equal(a.data, val.data), "train and validation images must differ"
    other_task = example.SyntheticCIFAR10(64, train=True, task_seed=1)
    assert not np.array_equal(a.data, other_task.data)
    with pytest.raises(ValueError, match="size must be >= 1"):
        example.SyntheticCIFAR10(0)


def test_synthetic_classes_are_separable(example):
    # The class is in the image: nearest class-mean (computed on train) labels most validation images, so the
    # fit test's accuracy bar measures training, not luck.
    train, val = example.SyntheticCIFAR10(2000, train=True), example.SyntheticCIFAR10(500, train=False)
    x = train.data.reshape(len(train), -1).astype(np.float64)
    y = np.asarray(train.targets)
    means = np.stack([x[y == c].mean(axis=0) for c in range(10)])
    v = val.data.reshape(len(val), -1).astype(np.float64)
    predicted = ((v[:, None, :] - means[None]) ** 2).sum(axis=2).argmin(axis=1)
    assert (predicted == np.asarray(val.targets)).mean() > 0.5


def test_train_transform_augments_and_eval_transform_does_not(example):
    data = example.SyntheticCIFAR10(8)
    image, _ = data[3]
    train, evaluation = example.train_transform(), example.eval_transform()
    torch.manual_seed(0)
    augmented = [train(image) for _ in range(8)]
    assert any(not torch.equal(augmented[0], other) for other in augmented[1:]), "crop/flip never changed the image"
    assert torch.equal(evaluation(image), evaluation(image))
    # Normalised with CIFAR-10's statistics: pixel p of channel c becomes (p / 255 - mean_c) / std_c.
    expected = (
        torch.from_numpy(data.data[3]).permute(2, 0, 1).float() / 255
        - torch.tensor(example.CIFAR10_MEAN)[:, None, None]
    ) / torch.tensor(example.CIFAR10_STD)[:, None, None]
    torch.testing.assert_close(evaluation(image), expected)


# ---------------------------------------------------------------- the real CIFAR-10 path


def _write_cifar10(root: Path, train_per_batch: int, test_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Files in CIFAR-10's python format (cifar-10-batches-py: five training batches, a test batch, the meta
    file); each image is stored as 3,072 bytes, the red plane, then green, then blue."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written: dict[str, np.ndarray] = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = test_size if name == "test_batch" else train_per_batch
        images = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with (folder / name).open("wb") as f:
            pickle.dump({"data": images.reshape(n, -1), "labels": labels}, f)
        written[name] = images
        written[name + "/labels"] = np.asarray(labels)
    with (folder / "batches.meta").open("wb") as f:
        pickle.dump({"label_names": [f"class{c}" for c in range(10)]}, f)
    return written


def test_real_cifar10_loader_reads_torchvision_format(example, tmp_path, monkeypatch):
    written = _write_cifar10(tmp_path, train_per_batch=6, test_size=10)
    # torchvision checks the real files' MD5 sums; these files are ours, everything else is torchvision's reader.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    data = example.CIFAR10DataModule(root=str(tmp_path), download=False, batch_size=5, num_workers=0)
    data.prepare_data()
    data.setup("fit")
    assert len(data.train_set) == 30 and len(data.val_set) == 10
    assert isinstance(data.train_set, torchvision.datasets.CIFAR10)

    x, y = next(iter(data.val_dataloader()))  # not shuffled, not augmented: the test batch in order
    assert x.shape == (5, 3, 32, 32)
    assert torch.equal(y, torch.as_tensor(written["test_batch/labels"][:5]))
    mean = torch.tensor(example.CIFAR10_MEAN)[:, None, None]
    std = torch.tensor(example.CIFAR10_STD)[:, None, None]
    expected = (torch.from_numpy(written["test_batch"][:5]).float() / 255 - mean) / std
    torch.testing.assert_close(x, expected)  # channel order and scaling as stored

    train_batches = list(data.train_dataloader())
    assert len(train_batches) == 6 and all(b[0].shape == (5, 3, 32, 32) for b in train_batches)
    seen = sorted(torch.cat([b[1] for b in train_batches]).tolist())
    stored = sorted(np.concatenate([written[f"data_batch_{i}/labels"] for i in range(1, 6)]).tolist())
    assert seen == stored, "every training image once per epoch"


def test_missing_cifar10_is_a_clear_error(example, tmp_path):
    data = example.CIFAR10DataModule(root=str(tmp_path / "nowhere"), download=False, num_workers=0)
    data.prepare_data()  # download=False: nothing to do
    with pytest.raises(FileNotFoundError) as error:
        data.setup("fit")
    message = str(error.value)
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py") in message
    assert "--data.root" in message and "--data.synthetic=true" in message


def test_failed_download_is_a_clear_error(example, tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", offline)
    data = example.CIFAR10DataModule(root=str(tmp_path), download=True, num_workers=0)
    with pytest.raises(RuntimeError) as error:
        data.prepare_data()
    message = str(error.value)
    assert "could not download CIFAR-10" in message and "name resolution" in message
    assert "--data.root" in message and "--data.synthetic=true" in message


def test_synthetic_switch_reads_nothing(example, tmp_path):
    data = example.CIFAR10DataModule(
        root=str(tmp_path / "absent"), synthetic=True, synthetic_train_size=40, synthetic_val_size=20, num_workers=0
    )
    data.prepare_data()
    data.setup("fit")
    assert (len(data.train_set), len(data.val_set)) == (40, 20)
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize(("kwargs", "match"), [({"batch_size": 0}, "batch_size"), ({"num_workers": -1}, "num_workers")])
def test_data_module_rejects_bad_settings(example, kwargs, match):
    with pytest.raises(ValueError, match=match):
        example.CIFAR10DataModule(**kwargs)


# ---------------------------------------------------------------- model


def test_cifar_stem_keeps_resolution(example):
    net = example.build_resnet("resnet18", cifar_stem=True)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, torch.nn.Identity)
    imagenet = example.build_resnet("resnet18", cifar_stem=False)
    assert imagenet.conv1.kernel_size == (7, 7) and imagenet.conv1.stride == (2, 2)
    x = torch.randn(2, 3, 32, 32)
    assert net(x).shape == imagenet(x).shape == (2, 10)
    # The stem decides the resolution of the first block: 32x32 with the CIFAR stem, 8x8 with ImageNet's.
    assert net.maxpool(net.relu(net.bn1(net.conv1(x)))).shape[-1] == 32
    assert imagenet.maxpool(imagenet.relu(imagenet.bn1(imagenet.conv1(x)))).shape[-1] == 8


def test_unknown_architecture_is_rejected(example):
    with pytest.raises(ValueError, match="resnet18, resnet34"):
        example.build_resnet("vgg16")


# ---------------------------------------------------------------- LightningCLI


def _cli(example, config: str, tmp_path: Path, *overrides: str):
    args = ["--config", str(CONFIGS / config), "--trainer.devices=1", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    return example.main(args=[*args, *overrides], run=False)


def test_cifar10_config(example, tmp_path):
    cli = _cli(example, "cifar10.yaml", tmp_path)
    assert type(cli.trainer.strategy) is OscarsStrategy
    assert (cli.datamodule.root, cli.datamodule.download, cli.datamodule.synthetic) == (Path("data"), True, False)
    assert cli.datamodule.batch_size == 128
    assert cli.model.hparams.arch == "resnet18" and cli.model.net.conv1.kernel_size == (3, 3)


def test_cifar10_config_overrides(example, tmp_path):
    cli = _cli(
        example,
        "cifar10.yaml",
        tmp_path,
        "--model.arch=resnet50",
        f"--data.root={tmp_path / 'cifar'}",
        "--data.synthetic=true",
        "--trainer.strategy=ddp",
    )
    assert not isinstance(cli.trainer.strategy, OscarsStrategy)
    assert cli.datamodule.root == tmp_path / "cifar" and cli.datamodule.synthetic
    assert type(cli.model.net.layer1[0]).__name__ == "Bottleneck"
    with pytest.raises(SystemExit):  # not one of the architectures
        _cli(example, "cifar10.yaml", tmp_path, "--model.arch=vgg16")


def test_synthetic_cpu_config(example, tmp_path):
    cli = _cli(example, "cifar10_synthetic_cpu.yaml", tmp_path)
    assert type(cli.trainer.strategy) is OscarsStrategy and cli.datamodule.synthetic
    emulators = [cb for cb in cli.trainer.callbacks if isinstance(cb, HeterogeneityEmulator)]
    assert len(emulators) == 1 and emulators[0].factor_for(1, 0.0) == 3.0


def test_print_config_shows_model_and_data_options(example, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example.main(args=["fit", "--config", str(CONFIGS / "cifar10.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"] == "oscars"
    assert {"arch", "cifar_stem", "lr", "momentum", "weight_decay", "nesterov"} <= set(printed["model"])
    assert {"root", "download", "synthetic", "batch_size", "num_workers"} <= set(printed["data"])


# ---------------------------------------------------------------- 2-rank fit


# The example end to end (a ResNet on 2 ranks, 25-55 s on 2 cores): outside the default run (``pytest -m extended``),
# which CI also runs; the strategy under it is covered by the default run's own multi-process tests.
@pytest.mark.extended
@pytest.mark.multiprocess
def test_synthetic_cifar10_trains_on_two_ranks(tmp_path):
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "fit",
        "--config",
        str(CONFIGS / "cifar10_synthetic_cpu.yaml"),
        "--data.synthetic_train_size=1536",
        # One worker process per rank: the balanced loader carries the user's worker settings to its inner loaders.
        "--data.num_workers=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    code, log = run(cmd, timeout=TIMEOUT)
    assert_clean_exit(code, log, TIMEOUT)

    (metrics,) = list(tmp_path.rglob("metrics.csv"))
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    val_acc = [float(r["val_acc"]) for r in rows if r.get("val_acc")]
    assert len(val_acc) == 2 and val_acc[-1] > 0.8, val_acc  # chance is 0.1
    tau_fast = [float(r["oscars/tau/rank0"]) for r in rows if r.get("oscars/tau/rank0")]
    tau_slow = [float(r["oscars/tau/rank1"]) for r in rows if r.get("oscars/tau/rank1")]
    assert tau_fast[-1] > tau_slow[-1], (tau_fast, tau_slow)
    (checkpoint_path,) = list(tmp_path.rglob("*.ckpt"))
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    assert checkpoint["oscars"]["local_steps"][0] > checkpoint["oscars"]["local_steps"][1]
    # BatchNorm statistics are averaged with the weights: the checkpoint's running means are finite and moved.
    running_mean = checkpoint["state_dict"]["net.bn1.running_mean"]
    assert torch.isfinite(running_mean).all() and running_mean.abs().sum() > 0
