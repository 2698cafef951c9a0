"""The fit session's failure side (``fit_failures.py``), driven directly with stand-ins for the strategy, rounds,
scheme, loader and recovery: when a failure stops a rank at once, and when it saves where every survivor stands."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_oscars.lightning.fit_failures import FitFailures

PEER_GONE = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1234")


class Recorded:
    """Records the calls the failure side makes on the scheme, the loader and the recovery."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def abandon(self) -> None:
        self.calls.append(("abandon", None))

    def close_round(self) -> None:
        self.calls.append(("close_round", None))

    def save(self, rounds: Any, scheme: Any, loader: Any, trainer: Any, stopped: bool, averaged: bool) -> Path:
        self.calls.append(("save", (stopped, averaged)))
        return Path("/recovery/step-000000009")


def _failures(recovery: bool, trainer: Any = None) -> tuple[FitFailures, SimpleNamespace, Recorded]:
    rounds = SimpleNamespace(failed=False, num_averagings=3, replica_size=1, rank=0, needs_average=True)
    strategy = SimpleNamespace(world_size=2, global_rank=0, lightning_module=SimpleNamespace(_trainer=trainer))
    recorded = Recorded()
    failures = FitFailures(strategy, rounds, recorded, recorded if recovery else None)  # type: ignore[arg-type]
    return failures, rounds, recorded


def test_without_recovery_a_broken_exchange_stops_this_rank_at_once_naming_it():
    failures, rounds, recorded = _failures(recovery=False)
    with pytest.raises(RuntimeError, match="the ps exchange after a step of round 4 failed on rank 0 of 2"):
        failures.exchange_failed(PEER_GONE, "the ps exchange after a step", recorded)  # type: ignore[arg-type]
    assert rounds.failed and recorded.calls == []


def test_with_recovery_a_broken_exchange_goes_on_alone_to_the_next_meeting_and_saves_there():
    failures, rounds, recorded = _failures(recovery=True)
    failures.exchange_failed(PEER_GONE, "the ps exchange after a step", recorded)  # type: ignore[arg-type]
    # Nothing more is exchanged, the round takes no further step, and the fit is not failed yet: the next meeting
    # must still happen (rounds.failed would skip it), where every survivor stands at one slot.
    assert recorded.calls == [("abandon", None), ("close_round", None)] and not rounds.failed
    assert failures.lost is not None
    with pytest.raises(RuntimeError, match="This rank's state is saved in /recovery/step-000000009") as raised:
        failures.raise_lost(trainer=SimpleNamespace(), loader=recorded)  # type: ignore[arg-type]
    assert raised.value.__cause__ is PEER_GONE and "exchange after a step of round 4" in str(raised.value)
    assert recorded.calls[-1] == ("save", (False, False)) and rounds.failed and failures.lost is None


def test_a_collective_broken_between_steps_saves_and_one_broken_inside_a_step_saves_nothing():
    failures, rounds, recorded = _failures(recovery=True, trainer=SimpleNamespace())
    rounds.needs_average = False  # a validation's metrics, after the averaging before it: nothing trained since
    failures.report(PEER_GONE, loader=None)
    assert recorded.calls == [("save", (False, True))] and rounds.failed
    failures, rounds, recorded = _failures(recovery=True, trainer=SimpleNamespace())
    failures.in_step = True  # a replica's gradient all-reduce: the survivors may stand at different batches
    failures.report(PEER_GONE, loader=None)
    assert recorded.calls == [] and rounds.failed


def test_a_rank_whose_own_code_raised_saves_nothing_and_a_sigterm_saves_a_stop():
    failures, rounds, recorded = _failures(recovery=True, trainer=SimpleNamespace())
    failures.report(ValueError("a bug in training_step"), loader=None)
    assert recorded.calls == [] and rounds.failed
    failures, rounds, recorded = _failures(recovery=True, trainer=SimpleNamespace())
    failures.report(SIGTERMException(), loader=None)
    assert recorded.calls == [("save", (True, False))] and not rounds.failed
