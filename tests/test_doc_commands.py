"""Every LightningCLI command line the README, the docs and the examples print parses as printed: the strategy, its
options and the Trainer they build (``run=False``: nothing is trained; the configs train in test_cli.py).

``train.py`` stands for the user's own script, which the docs build as ``examples/cli.py`` does."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from lightning.pytorch.strategies import Strategy
from subproc import ROOT, as_cli, load_script

SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]
SOURCES += sorted((ROOT / "examples" / "configs").glob("*.yaml"))
SCRIPTS = {"train.py": "examples/cli.py", "examples/cli.py": "examples/cli.py"}
SCRIPTS["examples/cifar10_resnet.py"] = "examples/cifar10_resnet.py"
PRINTED = re.compile(r"python (?P<script>\S+\.py) fit(?P<args>(?: [^#`\"'()]*)?)")


def printed_commands() -> list[tuple[str, str, list[str]]]:
    """``(where, script, args)`` for every ``python SCRIPT fit ...`` line (continuation lines joined)."""
    found = []
    for path in SOURCES:
        lines = path.read_text().splitlines()
        number = 0
        while number < len(lines):
            first, line = number + 1, lines[number]
            while line.endswith("\\") and number + 1 < len(lines):  # a shell line continued with a backslash
                number += 1
                line = line[:-1] + " " + lines[number].strip()
            number += 1
            for match in PRINTED.finditer(line):
                if match["script"] in SCRIPTS:
                    args = shlex.split(match["args"])  # up to a comment, a quote or a parenthesis: prose
                    found.append((f"{path.relative_to(ROOT)}:{first}", match["script"], args))
    return found


COMMANDS = printed_commands()


def test_the_docs_print_the_commands_this_test_parses():
    # The README's replica line and the launching guide's strategy options are among them.
    where = {w.split(":")[0] for w, _, _ in COMMANDS}
    assert {"README.md", "docs/launching.md", "docs/replica-groups.md", "examples/cli.py"} <= where
    assert any("--trainer.strategy.init_args.replica_size=node" in args for _, _, args in COMMANDS)


@pytest.mark.parametrize(("where", "script", "args"), COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_a_printed_command_line_parses_and_builds_its_strategy(where, script, args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in the commands: configs are given from the repository root
    args = [str(ROOT / a) if a.endswith((".yaml", ".yml")) else a for a in args]
    path = ROOT / SCRIPTS[script]
    module = load_script(path, f"printed_{path.stem}")
    # Built here on the CPU, one device (the printed GPU and multi-node settings parse, then are overridden).
    here = ["--trainer.logger=false", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1"]
    with as_cli(path):
        if "--print_config" in args:
            with pytest.raises(SystemExit) as printed:  # prints the whole config and exits
                module.main([*args, *here], run=False)
            assert printed.value.code == 0
            return
        cli = module.main([*args, *here], run=False)  # run=False: no subcommand
    strategy = cli.trainer.strategy
    assert isinstance(strategy, Strategy)
    for arg in args:  # every strategy option printed reached the strategy
        option = re.fullmatch(r"--trainer\.strategy\.init_args\.(\w+)=(\S+)", arg)
        if option:
            value = getattr(strategy, option[1], getattr(strategy, f"_{option[1]}", None))
            # As printed, or as its YAML reads (a list: [48,32] is the list [48, 32]).
            assert str(value) == option[2] or value == yaml.safe_load(option[2]), (where, option[1], value)
