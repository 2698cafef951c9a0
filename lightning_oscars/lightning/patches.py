"""The record of what one fit replaced, so that all of it is put back: attributes of Lightning's objects (and of the
user's) and signal handlers. Each patch module installs through a :class:`Patches` and the adapter removes them all."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

Handler = Callable[[int, Any], Any]

__all__ = ["Handler", "MethodPatch", "Patches"]


def _own_method(owner: object, name: str) -> Any:
    """``owner``'s class's own method ``name``, bound to ``owner``."""
    return getattr(type(owner), name).__get__(owner)


class MethodPatch:
    """A fit's replacement of a method of the user's object (the module's ``all_gather``): called as the method; copied
    or pickled as the object's own method. The fit's state does not travel with a copy of the object: a callback that
    pickles the module into a server process (``ServableModuleValidator`` under a spawn start method), or deep-copies
    it (an EMA), gets the module as the user wrote it."""

    def __init__(self, replacement: Callable[..., Any], owner: object, name: str) -> None:
        self.replacement, self.owner, self.name = replacement, owner, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.replacement(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _own_method, (self.owner, self.name)


class Patches:
    """Replacements made, newest last; :meth:`undo` restores them in reverse order."""

    def __init__(self) -> None:
        self._replaced: list[tuple[object, str, bool, Any]] = []  # (owner, name, had its own, the one before)
        self._handlers: list[tuple[int, Handler, Any]] = []  # (signal, ours, the one before)

    def __bool__(self) -> bool:
        return bool(self._replaced)

    def replace(self, owner: object, name: str, value: Any) -> None:
        """Set ``owner.name`` to ``value`` (on the instance) until :meth:`undo`."""
        had_own = name in vars(owner)
        self._replaced.append((owner, name, had_own, vars(owner).get(name)))
        setattr(owner, name, value)

    def set_handler(self, signum: int, handler: Handler) -> None:
        self._handlers.append((signum, handler, signal.getsignal(signum)))
        signal.signal(signum, handler)

    def undo(self, keep: Callable[[object], bool] = lambda owner: False) -> None:
        """Put back every replacement but those of owners ``keep`` names (they stay recorded), and every handler (one
        that someone replaced since stays theirs)."""
        kept: list[tuple[object, str, bool, Any]] = []
        while self._replaced:
            owner, name, had_own, original = self._replaced.pop()
            if keep(owner):
                kept.append((owner, name, had_own, original))
            elif had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._replaced = kept[::-1]
        while self._handlers:
            signum, ours, before = self._handlers.pop()
            if signal.getsignal(signum) is ours:
                signal.signal(signum, before)
