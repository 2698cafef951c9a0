"""The Lightning-facing layer bound to either Lightning namespace, from one source.

Lightning ships the same trainer twice: ``lightning.pytorch`` (with ``lightning.fabric``) in the ``lightning``
distribution, and ``pytorch_lightning`` (with ``lightning_fabric``) standalone, which libraries such as darts build on.
Their classes are distinct, so a strategy subclassing one namespace's ``DDPStrategy`` is no strategy to the other's
Trainer. Lightning itself makes the standalone package from the unified sources by renaming the imports; this module
does the same at import time instead of in a build: ``lightning_oscars.pytorch_lightning`` and its submodules are
this package's ``__init__`` and ``lightning/`` modules compiled from their own files with

* ``lightning.pytorch`` read as ``pytorch_lightning`` and ``lightning.fabric`` as ``lightning_fabric``;
* ``lightning_oscars.lightning`` read as ``lightning_oscars.pytorch_lightning`` (so the twin imports its own layer);

line for line (tracebacks point at the real files). ``core/`` and ``dist/`` import no Lightning and are shared.

The twin is imported, and registers every strategy name in ``pytorch_lightning``'s registry, as soon as
``pytorch_lightning`` is imported (or at once when it already is). A strategy object made from one namespace's class
and handed to the other namespace's Trainer becomes the other namespace's twin when that Trainer first configures it
(:class:`BindsToTrainerNamespace`). This module imports no Lightning itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import re
import sys
import warnings
from abc import ABCMeta
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "TWIN_PACKAGE",
    "BindsToTrainerNamespace",
    "bind",
    "bind_twin_classes",
    "import_twin",
    "rewrite",
    "twin_class",
]

PACKAGE = "lightning_oscars"
TWIN_PACKAGE = "lightning_oscars.pytorch_lightning"
STANDALONE = "pytorch_lightning"
_ROOT = Path(__file__).resolve().parent.parent  # lightning_oscars/
_LAYER = f"{PACKAGE}.lightning"
# Whole dotted names only (not ``lightning_oscars.lightning.x`` read as ``lightning.x``); this module stays itself,
# so that one finder serves both namespaces.
_RENAMES = (
    (re.compile(r"(?<![\w.])lightning_oscars\.lightning(?![\w])(?!\.namespaces\b)"), TWIN_PACKAGE),
    (re.compile(r"(?<![\w.])lightning\.pytorch(?![\w])"), "pytorch_lightning"),
    (re.compile(r"(?<![\w.])lightning\.fabric(?![\w])"), "lightning_fabric"),
)
_NAMESPACE_OF_ROOT = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def rewrite(source: str) -> str:
    """``source`` with its Lightning imports read in the standalone namespace (the line count is unchanged)."""
    for pattern, replacement in _RENAMES:
        source = pattern.sub(replacement, source)
    return source


def _twin_source(name: str) -> Path | None:
    """The file a twin module is compiled from: the package's ``__init__`` for the twin package, ``lightning/x.py``
    for ``lightning_oscars.pytorch_lightning.x``."""
    if name == TWIN_PACKAGE:
        return _ROOT / "__init__.py"
    if name.startswith(TWIN_PACKAGE + ".") and name.count(".") == 2:
        path = _ROOT / "lightning" / f"{name.rsplit('.', 1)[1]}.py"
        return path if path.is_file() else None
    return None


class _TwinLoader(importlib.abc.Loader):
    def __init__(self, path: Path) -> None:
        self.path = path

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = str(self.path)
        code = compile(rewrite(self.path.read_text()), str(self.path), "exec")
        exec(code, module.__dict__)  # noqa: S102 - this package's own source, renamed


class _ThenImportTwin(importlib.abc.Loader):
    """``pytorch_lightning``'s own loader, which imports the twin (registering its strategies) once it has run."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        import_twin()

    def __getattr__(self, name: str) -> Any:  # resources, source, ...: the real loader's
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the twin modules, and notices ``pytorch_lightning``'s import."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == STANDALONE:
            return self._standalone_spec(name, path, target)
        source = _twin_source(name)
        if source is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, _TwinLoader(source), origin=str(source))
        if name == TWIN_PACKAGE:
            spec.submodule_search_locations = []
        spec.has_location = True
        return spec

    def _standalone_spec(self, name: str, path: Any, target: Any) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenImportTwin(spec.loader)
                return spec
        return None


_FINDER = _Finder()


def import_twin() -> ModuleType | None:
    """Import the twin package (its strategies register in ``pytorch_lightning``'s registry). A release of
    ``pytorch_lightning`` this package does not support leaves it unregistered, with a warning, not a failed import."""
    try:
        return importlib.import_module(TWIN_PACKAGE)
    except ImportError as error:
        warnings.warn(f"lightning-oscars' strategies are not registered in pytorch_lightning: {error}", stacklevel=2)
        return None


_ORIGINALS: list[type] = []  # the strategies of lightning.pytorch, as the package registered them


def bind(package: str, strategies: Sequence[type]) -> None:
    """Called by the package's ``__init__`` (``package`` is its ``__name__``) with the strategies it registered. The
    package itself: serve the twin modules, and register the strategies in ``pytorch_lightning`` when it is (or once
    it gets) imported. The twin: pair its strategies with the package's (:func:`bind_twin_classes`)."""
    if package == TWIN_PACKAGE:
        bind_twin_classes(_ORIGINALS, strategies)
        return
    _ORIGINALS[:] = strategies
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    if STANDALONE in sys.modules:
        import_twin()


def _lightning_base(cls: type) -> ABCMeta:
    """The first of Lightning's own classes ``cls`` derives from (``DDPStrategy``); a user's subclass is skipped."""
    for base in cls.__mro__:
        if _namespace_of(base) is not None:
            assert isinstance(base, ABCMeta), base
            return base
    raise TypeError(f"{cls.__name__} derives from no Lightning class")


def bind_twin_classes(originals: Sequence[type], twins: Sequence[type]) -> None:
    """Each strategy class is a (virtual) subclass of the other namespace's base too, so that either Trainer accepts
    its objects: the object then becomes the Trainer's twin (:class:`BindsToTrainerNamespace`)."""
    for original, twin in zip(originals, twins):
        _lightning_base(twin).register(original)
        _lightning_base(original).register(twin)


def _namespace_of(cls: type) -> str | None:
    return _NAMESPACE_OF_ROOT.get(cls.__module__.split(".")[0])


def twin_class(cls: type, namespace: str) -> type:
    """``cls`` (one of this package's strategies) as bound to the Lightning ``namespace`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``); a clear error for a class defined outside this package."""
    module = cls.__module__
    if module.startswith(_LAYER + "."):
        target = module.replace(_LAYER, TWIN_PACKAGE, 1) if namespace == STANDALONE else module
    elif module.startswith(TWIN_PACKAGE + "."):
        target = module if namespace == STANDALONE else module.replace(TWIN_PACKAGE, _LAYER, 1)
    else:
        here, there = _namespace_of(_lightning_base(cls)), namespace
        twin_home = "lightning_oscars.pytorch_lightning" if there == STANDALONE else "lightning_oscars"
        raise TypeError(
            f"{cls.__name__} derives from a strategy bound to {here}, but this Trainer comes from {there}."
            f" Derive it from the strategy in {twin_home} (the same class, bound to {there})."
        )
    found = getattr(importlib.import_module(target), cls.__qualname__)
    assert isinstance(found, type)
    return found


class BindsToTrainerNamespace:
    """A strategy that follows the Trainer configuring it: Lightning sets its ``accelerator`` first; an accelerator of
    the other namespace turns the object into its twin there, built again from the same arguments."""

    _accelerator: Any
    _construction: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        strategy = super().__new__(cls)
        strategy._construction = (args, kwargs)
        return strategy

    @property
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        wanted = _namespace_of(type(accelerator)) if accelerator is not None else None
        if wanted is not None and wanted != _namespace_of(_lightning_base(type(self))):
            self._rebind(twin_class(type(self), wanted))
        self._accelerator = accelerator

    def _rebind(self, twin: type) -> None:
        args, kwargs = self._construction
        self.__dict__.clear()
        self.__class__ = twin
        twin.__init__(self, *args, **kwargs)  # type: ignore[misc]
        self._construction = (args, kwargs)
