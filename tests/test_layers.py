"""The package's import layers, enforced (drawn in docs/architecture.md).

* core: the round logic, schedule, solver, policy, partition, deadline, warm-up, timing, control data, staleness
  rules, groups, loader, the timeline picture: no Lightning, no torch.distributed (unit-tested directly, driven by
  the simulator);
* dist: what talks over torch.distributed (averaging, schemes, the server, ripples' exchange, failure notes);
  torch-private access only in ``_c10d``;
* lightning: the strategy, its fit session, callbacks and options, the paradigms' strategies, the monitor;
  private Lightning access only in ``adapter`` and its documented neighbour ``epoch_metrics``.

A layer imports only its own and the layers below it; nothing imports the strategy but the strategies built on it;
the package has no import cycle (imports inside functions and under ``TYPE_CHECKING`` included).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_oscars"

CORE = {
    "continuation",
    "control",
    "deadline",
    "deadline_planner",
    "epoch_order",
    "groups",
    "ledger",
    "loader",
    "partition",
    "policy",
    "quotas",
    "recovery_points",
    "replicas",
    "reservations",
    "rounds",
    "schedule",
    "shard",
    "slots",
    "solver",
    "staleness",
    "timeline",
    "timing",
    "warmup",
}
DIST = {
    "_c10d",
    "averaging",
    "faults",
    "local_collectives",
    "local_state",
    "outer",
    "overlap",
    "param_server",
    "ripples",
    "schemes",
    "server_scheme",
}
LIGHTNING = {
    "__init__",
    "adapter",
    "agreement",
    "callbacks",
    "collectives",
    "epoch_metrics",
    "fit_failures",
    "heterogeneity",
    "monitor",
    "paradigms",
    "recovery",
    "session",
    "strategy",
    "strategy_options",
}
LAYER = {**dict.fromkeys(CORE, 0), **dict.fromkeys(DIST, 1), **dict.fromkeys(LIGHTNING, 2)}
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "torchmetrics")
PRIVATE_LIGHTNING = {"adapter", "epoch_metrics"}


def _imports(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """Every import of ``module`` (anywhere in the file): (imported module, names taken from it)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: inside the package
                base = f"lightning_oscars.{base}" if base else "lightning_oscars"
            found.append((base, tuple(alias.name for alias in node.names)))
    return found


def _package_deps(module: str) -> set[str]:
    deps = set()
    for name, names in _imports(module):
        if name == "lightning_oscars":
            deps.update(n for n in names if n in LAYER)
        elif name.startswith("lightning_oscars."):
            deps.add(name.split(".")[1])
    return deps - {module}


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(LAYER), f"put each module in one layer: {sorted(modules ^ set(LAYER))}"


@pytest.mark.parametrize("module", sorted(LAYER))
def test_a_module_imports_only_its_layer_and_those_below(module):
    upward = {dep for dep in _package_deps(module) if LAYER[dep] > LAYER[module]}
    assert not upward, f"{module} (layer {LAYER[module]}) imports {sorted(upward)} from a layer above"
    external = [name for name, _ in _imports(module)]
    if LAYER[module] < 2:
        lightning = [n for n in external if n.split(".")[0] in LIGHTNING_PACKAGES]
        assert not lightning, f"{module} imports Lightning: {lightning}"
    if LAYER[module] == 0:
        distributed = [n for n in external if n == "torch.distributed" or n.startswith("torch.distributed.")]
        assert not distributed, f"{module} is core but imports {distributed}"


@pytest.mark.parametrize("module", sorted(LAYER))
def test_private_access_sits_in_its_one_module(module):
    for name, names in _imports(module):
        if name.split(".")[0] in LIGHTNING_PACKAGES:
            private = [n for n in (*name.split("."), *names) if n.startswith("_") and not n.startswith("__")]
            assert not private or module in PRIVATE_LIGHTNING, f"{module} reaches into Lightning's {private}"
        if name.startswith("torch"):
            private = [n for n in (*name.split("."), *names) if n.startswith("_") and not n.startswith("__")]
            assert not private or module == "_c10d", f"{module} reaches into torch's {private}"


def test_no_import_cycle_and_nothing_imports_the_strategy_back():
    graph = {module: _package_deps(module) for module in LAYER}
    importers = {m for m, deps in graph.items() if "strategy" in deps}
    assert importers <= {"__init__", "paradigms"}, f"only the strategies built on it may import it: {importers}"
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_core_imports_with_lightning_made_unimportable():
    script = textwrap.dedent(
        f"""
        import importlib, importlib.abc, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {LIGHTNING_PACKAGES!r}:
                    raise ImportError(f"{{name}} is not importable in this test")
                return None

        sys.meta_path.insert(0, Refuse())
        for module in {sorted(CORE)!r}:
            importlib.import_module("lightning_oscars." + module)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {LIGHTNING_PACKAGES!r})
        assert not loaded, loaded
        print("ok")
        """
    )
    # Not through lightning_oscars/__init__.py (the public API imports the strategy): each core module alone.
    done = subprocess.run(
        [sys.executable, "-c", script.replace('importlib.import_module("lightning_oscars." + module)', _LOAD)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# Loads lightning_oscars as a bare namespace (its __init__ not run), then the core module from it.
_LOAD = (
    "import types; pkg = sys.modules.setdefault('lightning_oscars', types.ModuleType('lightning_oscars'));"
    f" pkg.__path__ = [{str(PACKAGE)!r}]; importlib.import_module('lightning_oscars.' + module)"
)


# Modules allowed past 400 lines, and why (the list must shrink, never grow: a listed module under the limit fails).
OVER_400_LINES = {
    "adapter": "every private Lightning access in one module: split, it would be two",
}


@pytest.mark.parametrize("module", sorted(LAYER))
def test_modules_and_functions_stay_small(module):
    text = (PACKAGE / f"{module}.py").read_text()
    lines = len(text.splitlines())
    if module in OVER_400_LINES:
        assert lines > 400, f"{module} is {lines} lines now: take it off OVER_400_LINES"
    else:
        assert lines <= 400, f"{module} is {lines} lines (at most 400)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert length <= 60, f"{module}.{node.name} is {length} lines (at most 60)"
