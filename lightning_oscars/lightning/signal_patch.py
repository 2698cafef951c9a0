"""Signals under oscars: SIGTERM and the requeue signal act at the round boundary, where every rank acts together.

Lightning's own handlers act wherever each rank happens to be: its requeue handler saves a checkpoint (collectives)
inside the handler, which with ranks at different local steps would pair unrelated collectives. Here the first SIGTERM
is noted (and travels in the round's all-reduce); a second means now. Under Lightning's own launcher, rank 0's watch
of the other processes kills every rank within 5 s of one dying; it is deferred so that the survivors can save.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer

from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.patches import Handler, Patches

__all__ = ["DeferredSignals"]


class DeferredSignals:
    """SIGTERM and requeue handlers for one fit, and the deferred kill of Lightning's process watch."""

    def __init__(self) -> None:
        self._requeue: tuple[int, Handler] | None = None

    def install(
        self, trainer: Trainer, patches: Patches, on_sigterm: Callable[[], None], on_requeue: Callable[[], None]
    ) -> None:
        original = internals.original_sigterm_handler(trainer)
        received: list[int] = []

        def sigterm(signum: int, frame: Any) -> None:
            if received:
                # A second SIGTERM means now, not at the round boundary, which a rank blocked in a collective
                # would never reach: the default action (the process ends, as it would without oscars).
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            received.append(signum)
            on_sigterm()
            if callable(original) and original not in (signal.SIG_IGN, signal.SIG_DFL):
                original(signum, frame)

        patches.set_handler(signal.SIGTERM, sigterm)
        signum = internals.requeue_signal(trainer)
        handler = signal.getsignal(signum)
        if callable(handler) and handler not in (signal.SIG_IGN, signal.SIG_DFL):
            self._requeue = (signum, handler)
            patches.set_handler(signum, lambda received, frame: on_requeue())

    def forget(self) -> None:
        self._requeue = None

    def run_requeue_handler(self) -> None:
        """Run the deferred requeue handler (every rank, at the same batch)."""
        if self._requeue is not None:
            signum, handler = self._requeue
            handler(signum, None)

    @staticmethod
    def defer_process_watch(patches: Patches, grace_s: float) -> None:
        """Rank 0's kill of every rank when one dies waits ``grace_s`` (a survivor's own failed collective ends it
        sooner), so that the survivors live to save their state for a restart (``recovery.py``)."""
        for (owner, name), kill in internals.child_process_kills():

            def terminate_after_grace(kill: Callable[[], None] = kill) -> None:
                time.sleep(grace_s)
                kill()

            patches.replace(owner, name, terminate_after_grace)
