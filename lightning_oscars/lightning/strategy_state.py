"""What a fit under ``OscarsStrategy`` shows of its rounds: the read-only views a user, a callback or a test reads."""

from __future__ import annotations

from lightning_oscars.core.control import RoundRecord
from lightning_oscars.core.replicas import ReplicaLayout
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.solver import Schedule
from lightning_oscars.dist.schemes import SyncScheme
from lightning_oscars.lightning.session import FitSession

__all__ = ["RoundViews"]


class RoundViews:
    """A mixin of ``OscarsStrategy``: its fit sessions (``_session``, ``_last_session``) and layout, as views."""

    _session: FitSession | None
    _last_session: FitSession | None
    _layout: ReplicaLayout

    @property
    def slot_is_real(self) -> bool:
        """Whether the batch in progress is a real local step of this rank (``False`` on a no-op slot, where hooks
        see an empty batch and ``outputs == {}``; see ``docs/lightning-semantics.md``). ``True`` outside a fit."""
        return self._session is None or self._session.rounds.slot.real

    @property
    def rounds(self) -> RoundController | None:
        """The round controller of the current (or last) fit; ``None`` before the first fit with several ranks."""
        session = self._session or self._last_session
        return None if session is None else session.rounds

    @property
    def scheme(self) -> SyncScheme | None:
        """The synchronisation scheme of the current (or last) fit; ``None`` before the first."""
        session = self._session or self._last_session
        return None if session is None else session.scheme

    @property
    def local_steps(self) -> tuple[int, ...]:
        """Every rank's local steps in the current (or last) round; ``()`` before the first fit."""
        return () if self.rounds is None else self.rounds.local_steps

    @property
    def schedule(self) -> Schedule | None:
        return None if self.rounds is None else self.rounds.policy.schedule

    @property
    def history(self) -> list[RoundRecord]:
        """Every averaging of the last fit, as all ranks agreed on it."""
        return [] if self.rounds is None else self.rounds.history

    @property
    def layout(self) -> ReplicaLayout:
        """The run's replica groups (one rank per replica unless ``replica_size`` says otherwise)."""
        return self._layout

    @property
    def num_averagings(self) -> int:
        return 0 if self.rounds is None else self.rounds.num_averagings
