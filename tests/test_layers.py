"""The package's layers are its folders, enforced (drawn in docs/architecture.md).

* ``core/``: the round logic (schedule, solver, policy, the epoch's plan, slots, the loader, rounds, the paradigms'
  rules, recovery's bookkeeping, the timeline picture): no Lightning, no torch.distributed (unit-tested directly,
  driven by the simulator);
* ``dist/``: what talks over torch.distributed (averaging, schemes, the server, ripples' exchange, failure notes);
* ``lightning/``: the strategies, one fit's session, its callbacks and patches, recovery's Lightning side, the monitor;
* the package root: the public API (``__init__``) alone.

A folder imports only itself and the folders below it (core <- dist <- lightning <- the root); nothing imports the
strategy but the strategies built on it; there is no import cycle (imports inside functions and under
``TYPE_CHECKING`` included). Private state of Lightning and torch is touched only in the modules named for it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_oscars"
FOLDERS = {"core": 0, "dist": 1, "lightning": 2}
ROOT = 3  # the package's own __init__: the public API
ROOT_MODULES = {"__init__"}
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "torchmetrics")
# Lightning's private state: read and written in these two modules only.
PRIVATE_LIGHTNING = {"lightning._internals", "lightning.epoch_metrics"}


def _module_names() -> list[str]:
    """Every module of the package, dotted from the package (``core.rounds``, ``lightning.__init__``, ``__init__``)."""
    return sorted(".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py"))


MODULES = _module_names()


def _path(module: str) -> Path:
    return PACKAGE.joinpath(*module.split(".")).with_suffix(".py")


def _folder_rank(module: str) -> int:
    return FOLDERS[module.split(".")[0]] if "." in module else ROOT


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_path(module).read_text())


def _imports(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """Every import of ``module`` (anywhere in the file), absolute: (imported module, names taken from it)."""
    package = ["lightning_oscars", *module.split(".")[:-1]]
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((base, tuple(alias.name for alias in node.names)))
    return found


def _package_deps(module: str) -> set[str]:
    """The package's modules that ``module`` imports (``from lightning_oscars.core import rounds`` included)."""
    deps = set()
    for name, names in _imports(module):
        if name != "lightning_oscars" and not name.startswith("lightning_oscars."):
            continue
        base = name.removeprefix("lightning_oscars").lstrip(".")
        for taken in names or ("",):
            candidate = f"{base}.{taken}" if base else taken
            if candidate in MODULES:
                deps.add(candidate)
            elif f"{candidate}.__init__" in MODULES:
                deps.add(f"{candidate}.__init__")
            elif base in MODULES:
                deps.add(base)
            elif f"{base}.__init__" in MODULES or not base:
                deps.add(f"{base}.__init__" if base else "__init__")
    return deps - {module}


def test_every_module_sits_in_a_layer_folder():
    loose = {m for m in MODULES if "." not in m} - ROOT_MODULES
    assert not loose, f"move these into core/, dist/ or lightning/: {sorted(loose)}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(FOLDERS), f"the package's folders are its layers: {sorted(folders ^ set(FOLDERS))}"
    nested = [m for m in MODULES if m.count(".") > 1]
    assert not nested, f"one level of folders: {nested}"
    for folder in FOLDERS:
        assert f"{folder}.__init__" in MODULES and ast.get_docstring(_tree(f"{folder}.__init__")), (
            f"{folder}/__init__.py says what lives there"
        )


@pytest.mark.parametrize("module", MODULES)
def test_a_module_imports_only_its_folder_and_those_below(module):
    upward = {dep for dep in _package_deps(module) if _folder_rank(dep) > _folder_rank(module)}
    assert not upward, f"{module} imports {sorted(upward)} from a folder above it"
    external = [name for name, _ in _imports(module)]
    if _folder_rank(module) < FOLDERS["lightning"]:
        lightning = [n for n in external if n.split(".")[0] in LIGHTNING_PACKAGES]
        assert not lightning, f"{module} imports Lightning: {lightning}"
    if _folder_rank(module) == FOLDERS["core"]:
        distributed = [n for n in external if n == "torch.distributed" or n.startswith("torch.distributed.")]
        assert not distributed, f"{module} is core but imports {distributed}"


def _own_private_attributes(module: str) -> set[str]:
    """The private attributes ``module``'s own classes set on ``self`` (their instances are the module's to touch)."""
    own = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
    return own


def _foreign_private_attributes(module: str) -> list[str]:
    """``x._name`` reads and writes of another object's private state, and ``"_name"`` strings handed to
    ``getattr`` / ``setattr`` / a patch (a private attribute named in a string is still touched)."""
    own, found = _own_private_attributes(module), []
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            is_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not is_self and node.attr not in own:
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_"):
                if not name.value.startswith("__"):
                    found.append(f"{ast.unparse(node.func)}(..., {name.value!r})")
    return found


@pytest.mark.parametrize("module", MODULES)
def test_private_state_is_touched_only_where_named(module):
    """Lightning's private state in ``lightning._internals`` and ``lightning.epoch_metrics``; torch's in modules whose
    own name starts with an underscore (``dist._c10d``, ``core._nn_state``)."""
    for name, names in _imports(module):
        private = [n for n in (*name.split("."), *names) if n.startswith("_") and not n.startswith("__")]
        if name.split(".")[0] in LIGHTNING_PACKAGES:
            assert not private or module in PRIVATE_LIGHTNING, f"{module} reaches into Lightning's {private}"
        if name.split(".")[0] == "torch":
            assert not private or module.split(".")[-1].startswith("_"), f"{module} reaches into torch's {private}"
    if module not in PRIVATE_LIGHTNING and not module.split(".")[-1].startswith("_"):
        foreign = _foreign_private_attributes(module)
        assert not foreign, f"{module} touches private state it does not own: {foreign}"


def test_no_import_cycle_and_nothing_imports_the_strategy_back():
    graph = {module: _package_deps(module) for module in MODULES}
    importers = {m for m, deps in graph.items() if "lightning.strategy" in deps}
    assert importers <= {"__init__", "lightning.paradigms"}, f"only the strategies built on it import it: {importers}"
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
    core = [m for m in MODULES if m.startswith("core.") and not m.endswith("__init__")]
    script = textwrap.dedent(
        f"""
        import importlib, importlib.abc, sys, types

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {LIGHTNING_PACKAGES!r}:
                    raise ImportError(f"{{name}} is not importable in this test")
                return None

        sys.meta_path.insert(0, Refuse())
        # lightning_oscars as a bare namespace (its __init__, the public API, imports the strategy)
        package = sys.modules.setdefault("lightning_oscars", types.ModuleType("lightning_oscars"))
        package.__path__ = [{str(PACKAGE)!r}]
        for module in {core!r}:
            importlib.import_module("lightning_oscars." + module)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {LIGHTNING_PACKAGES!r})
        assert not loaded, loaded
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("module", MODULES)
def test_modules_and_functions_stay_small(module):
    text = _path(module).read_text()
    lines = len(text.splitlines())
    assert lines <= 400, f"{module} is {lines} lines (at most 400)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert length <= 60, f"{module}.{node.name} is {length} lines (at most 60)"


BENCHMARKS = PACKAGE.parent / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.rglob("*.py")), ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_benchmark_modules_and_functions_stay_small(path):
    """The benchmarks and the simulator (which runs the real round logic of ``core``) keep the same limits."""
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.name} is {len(text.splitlines())} lines (at most 400)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert length <= 60, f"{path.name}:{node.name} is {length} lines (at most 60)"
