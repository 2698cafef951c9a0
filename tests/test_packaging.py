"""The wheel: only the package (with ``py.typed``), a license expression, and an import that needs none of the
examples' or benchmarks' extras."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from subproc import ROOT, clean_env

# The child imports the package from the unpacked wheel, with the repository off its path and its examples and
# benchmarks unimportable. (Installed extras such as torchvision cannot be hidden the same way: torchmetrics and
# Lightning decide from installed metadata that they exist, then import them. That the package never imports
# them is checked on its source instead, below.)
_WITHOUT_EXTRAS = """
import sys

class NotInstalled:
    blocked = ("benchmarks", "examples")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
sys.path = [p for p in sys.path if p not in ("", {root!r})]
sys.path.insert(0, {unpacked!r})
import lightning_oscars
from lightning.pytorch.strategies import StrategyRegistry
assert lightning_oscars.__file__.startswith({unpacked!r}), lightning_oscars.__file__
assert {{"oscars", "oscars_alg1", "local_sgd"}} <= set(StrategyRegistry)
print("imported", lightning_oscars.__version__)
"""


# Building and installing a wheel takes half a minute: outside the default run (``pytest -m extended``), CI runs it.
pytestmark = pytest.mark.extended


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = list(out.glob("lightning_oscars-*.whl"))
    return path


def test_wheel_holds_only_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    package = [n for n in names if not n.startswith("lightning_oscars-")]
    assert package and all(n.startswith("lightning_oscars/") for n in package), package
    assert "lightning_oscars/py.typed" in package
    assert "lightning_oscars/lightning/strategy.py" in package
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert not any("torchvision" in r or "matplotlib" in r for r in core), core


def test_wheel_imports_without_the_extras(wheel, tmp_path):
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    code = _WITHOUT_EXTRAS.format(root=str(ROOT), unpacked=str(unpacked))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=clean_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported" in result.stdout


# Top-level modules the package may import: the standard library and its declared core dependencies.
CORE = {
    "torch",
    "lightning",
    "lightning_utilities",
    "numpy",
    "torchmetrics",
    "jsonargparse",
    "typing_extensions",
    "packaging",
    "lightning_oscars",
}


# The `plot` extra's modules: allowed only inside a function, so that importing the package never needs them.
DRAWN_LAZILY = {"matplotlib"}


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """Each imported top-level module with whether the import sits inside a function (runs only when called)."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def test_package_imports_only_core_dependencies(wheel):
    archive = zipfile.ZipFile(wheel)
    imported: dict[str, set[str]] = {}
    eager: dict[str, set[str]] = {}
    for name in archive.namelist():
        if name.startswith("lightning_oscars/") and name.endswith(".py"):
            for module, in_function in _imports(ast.parse(archive.read(name))):
                imported.setdefault(module, set()).add(name)
                if not in_function:
                    eager.setdefault(module, set()).add(name)
    outside = {
        m: files
        for m, files in imported.items()
        if m not in CORE and m not in DRAWN_LAZILY and m not in sys.stdlib_module_names
    }
    assert not outside, f"the package imports modules that are not core dependencies: {outside}"
    eager_optional = {m: files for m, files in eager.items() if m in DRAWN_LAZILY}
    assert not eager_optional, f"optional modules imported at module level: {eager_optional}"
    assert {"torch", "lightning", "numpy"} <= set(imported)  # the walk saw the real imports
    assert "matplotlib" in imported  # ... including the lazy ones
