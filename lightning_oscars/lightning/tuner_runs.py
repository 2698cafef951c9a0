"""A tuner's loop run inside a fit under ``OscarsStrategy`` (``Tuner.lr_find`` runs the fit loop with its own
callbacks): the run trains on every rank at every slot, averaging after every step, and the fit's own session takes
over again at its end. A mixin of ``OscarsStrategy`` (``strategy.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_oscars.core.policy import SchedulePolicy
from lightning_oscars.core.replicas import ReplicaLayout
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.timing import make_clock
from lightning_oscars.dist.schemes import ModelAveraging, SyncScheme
from lightning_oscars.lightning import _internals as internals

if TYPE_CHECKING:
    from lightning_oscars.lightning.session import FitSession

__all__ = ["TunerRuns"]


class TunerRuns(DDPStrategy):
    """See the module docstring. The subclass keeps ``_session``, ``_fit_session`` and ``_layout`` and makes
    sessions (``_make_session``)."""

    _session: FitSession | None
    _fit_session: FitSession | None
    _layout: ReplicaLayout

    def _make_session(self, scheme: SyncScheme, rounds: RoundController, **kwargs: Any) -> FitSession:
        raise NotImplementedError

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = internals.trainer_of(self.lightning_module)
        session = self._session
        if session is None or trainer is None or not session.fitting(trainer) or session.callbacks_in(trainer):
            return
        # A tuner replaced trainer.callbacks for a loop run of its own (Tuner.lr_find keeps only its LR callback, whose
        # per-batch broadcast runs on real steps only, and whose loss curve needs every step real). That run trains on
        # every rank at every slot, averaging after every step (ddp's steps for SGD), and its weights are restored
        # after it; this fit's rounds take the loader back at its end (_end_tuner_run).
        self._fit_session = session
        scheme = ModelAveraging()
        every_step = SchedulePolicy("uniform", max_local_steps=1)
        place = self._layout.place(self.global_rank)
        rounds = RoundController(
            every_step, **place, clock=make_clock(self.root_device), batch_sizes=session.rounds.batch_sizes
        )
        rounds.begin_fit(trainer.max_steps)
        self._session = self._make_session(scheme, rounds, on_training_end=self._end_tuner_run)
        if session.loader is not None:
            self._session.adopt_loader(session.loader)
        self._session.begin(trainer, monitor=False, after_tuner=True)
        self._session.begin_rounds(trainer)

    def _end_tuner_run(self) -> None:
        """A tuner's loop run ended (see :meth:`on_train_start`): this fit's own session takes over again."""
        fit_session, self._fit_session = self._fit_session, None
        if fit_session is None:
            return
        tuner_session, self._session = self._session, fit_session
        loader = None
        if tuner_session is not None:  # the loader goes back to the fit, open: the tuner's session ends without it
            loader, tuner_session.loader = tuner_session.loader, None
            tuner_session.end()
        if loader is not None:
            fit_session.adopt_loader(loader)
