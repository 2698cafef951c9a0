"""LightningCLI entry point for the synthetic task: every Trainer option, including the strategy, from the command
line or YAML.

    python examples/cli.py fit --config examples/configs/oscars.yaml
    python examples/cli.py fit --config examples/configs/ddp.yaml --trainer.strategy=oscars
    python examples/cli.py fit --config examples/configs/oscars_full.yaml --trainer.strategy.init_args.max_spread=4
    python examples/cli.py fit --config examples/configs/oscars_full.yaml --print_config

Importing :mod:`lightning_oscars` registers the strategy names ``oscars``, ``oscars_alg1`` and ``local_sgd``, so
``--trainer.strategy=oscars`` works. A name takes no options: to set them, select the class (in YAML
``class_path: lightning_oscars.OscarsStrategy`` with ``init_args``; on the command line
``--trainer.strategy.class_path=lightning_oscars.OscarsStrategy --trainer.strategy.init_args.max_spread=4``).
Note that ``--trainer.strategy=lightning_oscars.OscarsStrategy`` does not work: the Trainer's ``strategy`` is
``str | Strategy`` and a bare string is looked up as a registry name.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import GaussianMixtureDataModule, MLPClassifier  # noqa: E402

import lightning_oscars  # noqa: E402,F401  (registers strategy="oscars", "oscars_alg1", "local_sgd")


class SyntheticCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The model's input and output sizes follow the data: set them once, under data.
        parser.link_arguments("data.dim", "model.input_dim")
        parser.link_arguments("data.num_classes", "model.num_classes")


def main(args: list[str] | None = None, run: bool = True) -> SyntheticCLI:
    return SyntheticCLI(
        MLPClassifier,
        GaussianMixtureDataModule,
        args=args,
        run=run,
        seed_everything_default=0,
        # Reruns into the same log directory replace the saved config instead of failing.
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
