"""The Lightning layer bound to the standalone ``pytorch_lightning`` namespace (``lightning/namespaces.py``): one
source, compiled with its imports renamed; LightningCLI finds every form of the strategy; an object of one namespace's
class given to the other namespace's Trainer becomes its twin there, with its arguments. (The multi-process fits in both
namespaces are in ``test_loader_shapes_multiprocess.py``.)"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from lightning_oscars.pytorch_lightning import OscarsStrategy as StandaloneOscars
from pytorch_lightning.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lightning_oscars
from lightning_oscars.lightning.namespaces import rewrite, twin_class


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)


def test_the_rewrite_renames_whole_dotted_names_only_and_keeps_lines():
    source = (
        "from lightning.pytorch import Trainer\nimport lightning.fabric.plugins\n"
        "from lightning_oscars.lightning.strategy import X\nfrom lightning_oscars.lightning.namespaces import bind\n"
        "my_lightning.pytorch = 1\n"
    )
    assert rewrite(source).splitlines() == [
        "from pytorch_lightning import Trainer",
        "import lightning_fabric.plugins",
        "from lightning_oscars.pytorch_lightning.strategy import X",
        "from lightning_oscars.lightning.namespaces import bind",  # one finder for both namespaces
        "my_lightning.pytorch = 1",
    ]


@pytest.mark.parametrize(
    "given",
    ["oscars", "lightning_oscars.OscarsStrategy", "lightning_oscars.pytorch_lightning.OscarsStrategy"],
)
def test_lightning_cli_of_pytorch_lightning_builds_every_form_of_the_strategy(given):
    args = [f"--trainer.strategy={given}", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false"]
    if given != "oscars":
        args.append("--trainer.strategy.warmup_steps=3")
    cli = LightningCLI(Linear, run=False, args=args)
    strategy = cli.trainer.strategy
    assert type(strategy) is StandaloneOscars
    assert strategy.warmup_steps == (4 if given == "oscars" else 3)


def test_an_object_of_the_other_namespace_becomes_its_twin_with_its_arguments():
    strategy = lightning_oscars.OscarsStrategy(warmup_steps=2, solver="alg1")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy is strategy and type(strategy) is StandaloneOscars
    assert strategy.warmup_steps == 2 and strategy.solver == "alg1"
    assert twin_class(StandaloneOscars, "lightning.pytorch") is lightning_oscars.OscarsStrategy


def test_a_users_subclass_bound_to_the_other_namespace_is_a_clear_error():
    class Mine(lightning_oscars.OscarsStrategy):
        pass

    with pytest.raises(TypeError, match="Derive it from the strategy in lightning_oscars.pytorch_lightning"):
        pl.Trainer(strategy=Mine(), accelerator="cpu", devices=2, logger=False)


def test_a_users_subclass_in_its_trainers_namespace_stays_itself():
    class Mine(lightning_oscars.OscarsStrategy):
        pass

    import lightning.pytorch as lp

    strategy = Mine(warmup_steps=2)
    trainer = lp.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is Mine and strategy.warmup_steps == 2
