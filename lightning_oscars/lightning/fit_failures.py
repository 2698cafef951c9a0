"""How one fit fails: the failure named, the survivor's state saved, and a round whose exchange broke finished alone.

:class:`FitFailures` is the fit session's failure side (``session.py`` calls it; ``faults.py`` names the failed rank,
``recovery.py`` saves the state). A collective that breaks where every rank runs it at the same slot (a round's
averaging; between steps, a validation's metrics or a checkpoint's barrier) saves this survivor's state there. An
exchange that breaks *inside* a round (a paradigm's push or group after a step) leaves the survivors at different
slots: with recovery, this rank then exchanges nothing more, trains no further in the round, and fails at the next
meeting, the slot where every survivor fails (:meth:`FitFailures.exchange_failed`, :meth:`FitFailures.raise_lost`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_oscars.core.rounds import RoundController
from lightning_oscars.dist.faults import FailureBoard, broke_a_collective, name_the_failure
from lightning_oscars.dist.schemes import SyncScheme
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.recovery import FitRecovery

if TYPE_CHECKING:
    from lightning_oscars.core.loader import LoadBalancedLoader

__all__ = ["FitFailures"]


class FitFailures:
    """One fit's failures (see the module docstring).

    Args:
        strategy: the fit's strategy (ranks, module).
        rounds: the fit's round controller (``failed`` is set here).
        scheme: the fit's synchronisation scheme (abandoned when an exchange inside a round breaks).
        recovery: what the fit saves for a restart (``None``: nothing, and every failure stops at once).
    """

    def __init__(
        self, strategy: ParallelStrategy, rounds: RoundController, scheme: SyncScheme, recovery: FitRecovery | None
    ) -> None:
        self.strategy = strategy
        self.rounds = rounds
        self.scheme = scheme
        self.recovery = recovery
        # Inside a training step (its hooks included): a collective breaking there (a replica's gradient all-reduce, a
        # collective of the user's) may leave the survivors at different slots, so it saves no recovery point.
        self.in_step = False
        # An exchange inside the round broke (with recovery): the error and what broke, until the next meeting.
        self.lost: tuple[BaseException, str] | None = None

    def named(self, error: BaseException, what: str = "the averaging all-reduce") -> str:
        """The fit failed on a collective: stop meeting the others; the message naming the failed rank."""
        self.rounds.failed = True
        s = self.strategy
        return name_the_failure(self.rounds, s.world_size, s.global_rank, error, self.rounds.num_averagings + 1, what)

    def save(
        self, trainer: Trainer, loader: LoadBalancedLoader | None, stopped: bool = False, averaged: bool = False
    ) -> str:
        """This survivor's state for a restart (``recovery.py``); what to add to the failure's message."""
        recovery = self.recovery
        try:
            saved = recovery.save(self.rounds, self.scheme, loader, trainer, stopped, averaged) if recovery else None
        except Exception as error:  # noqa: BLE001 - the failure being reported matters more than this one
            return f"\nSaving this rank's state for a restart failed too: {type(error).__name__}: {error}"
        return "" if saved is None else f"\nThis rank's state is saved in {saved}: a restarted fit resumes from it."

    def exchange_failed(self, error: Exception, what: str, loader: LoadBalancedLoader | None) -> None:
        """An exchange inside a round broke. Without recovery every rank stops now. With it, this rank exchanges
        nothing more and takes no further real step in the round: the survivors meet their failure at the next
        meeting (the round's end, or an averaging before a checkpoint or validation), each at the same slot, where
        each saves its state (:meth:`raise_lost`). The other survivors get there as their own exchanges break."""
        if self.recovery is None:
            raise RuntimeError(self.named(error, what)) from error
        self.lost = (error, what)
        self.scheme.abandon()
        if loader is not None:
            loader.close_round()

    def raise_lost(self, trainer: Trainer, loader: LoadBalancedLoader | None) -> NoReturn:
        """The meeting after an exchange broke (:meth:`exchange_failed`): save, and fail."""
        assert self.lost is not None
        (error, what), self.lost = self.lost, None  # failed from here on: saving averages nothing
        raise RuntimeError(self.named(error, what) + self.save(trainer, loader)) from error

    def report(self, error: BaseException, loader: LoadBalancedLoader | None) -> None:
        """This rank's run is ending with ``error``: tell the others who failed, and stop meeting them."""
        trainer = internals.trainer_of(self.strategy.lightning_module)
        if isinstance(error, SIGTERMException) and not self.rounds.failed and trainer is not None:
            self.save(trainer, loader, stopped=True)  # at a round boundary: every rank has the averaged model
        if self.rounds.failed or isinstance(error, SIGTERMException):
            # SIGTERM is a coordinated stop (all ranks, same batch): collectives stay matched.
            return
        averaged = not self.rounds.needs_average  # none trained since the last averaging (one before a validation)
        self.rounds.failed = True
        if not broke_a_collective(error):  # this rank's own error: the others name it when their collectives break
            board = FailureBoard.from_default_group(self.strategy.world_size)
            if board is not None:
                board.report_error(self.strategy.global_rank, error)
        elif trainer is not None and not self.in_step:
            # A peer died in a collective between steps other than the averaging (step values' agreement, validation
            # metrics, a checkpoint's barrier): every rank runs those at the same slot, so every survivor is there.
            note = self.save(trainer, loader, averaged=averaged)
            if note:  # Lightning prints the error itself; where the state went, only this rank knows
                rank = self.strategy.global_rank
                print(f"oscars: rank {rank} lost a peer ({type(error).__name__}).{note}", file=sys.stderr, flush=True)
