"""Naming the rank that failed when a round's all-reduce breaks.

A collective that fails (a peer closed its connection, or the collective timeout expired) tells a rank only
that *something* went wrong. To name the culprit without any per-round cost, ranks leave notes in the
rendezvous key-value store only on the failure path: a rank whose own code raised writes its error; every
rank whose all-reduce broke writes which round it reached. A survivor reads the notes after a short grace
period: ranks that reported an error, or that never reached the round, are the failed ones.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_oscars.dist._c10d import default_store_or_none
from lightning_oscars.core.rounds import RoundController

__all__ = ["FailureBoard", "broke_a_collective", "describe_collective_failure", "name_the_failure"]

_PREFIX = "oscars/fault"
# How gloo and NCCL word a collective whose peer is gone, where they raise a plain RuntimeError.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "nccl", "gloo")


def broke_a_collective(error: BaseException) -> bool:
    """Whether ``error`` is a collective that broke (a peer died, or hung past the timeout), as torch.distributed and
    its backends raise it, rather than an error of this rank's own code."""
    if isinstance(error, torch.distributed.DistError):
        return True
    return isinstance(error, RuntimeError) and any(words in str(error).lower() for words in _PEER_GONE)


def describe_collective_failure(
    rank: int,
    world_size: int,
    round_index: int,
    errors: Mapping[int, str],
    reached: Sequence[int],
    cause: str,
    store_reachable: bool = True,
    what: str = "the averaging all-reduce",
) -> str:
    """The message a surviving rank raises (pure; unit-tested).

    Args:
        rank: the rank raising the message.
        world_size: number of ranks.
        round_index: the round whose all-reduce failed.
        errors: rank -> error text, for ranks whose own code raised.
        reached: ranks known to have reached this round's all-reduce.
        cause: the collective's own error text.
        store_reachable: whether the notes could be read at all (the store lives in rank 0's process).
        what: the exchange that failed (a round's all-reduce, or a paradigm's exchange after a step within it).
    """
    lines = [f"oscars: {what} of round {round_index} failed on rank {rank} of {world_size}."]
    if errors:
        for failed, text in sorted(errors.items()):
            lines.append(f"Rank {failed} failed: {text}")
    missing = sorted(set(range(world_size)) - set(reached) - set(errors))
    if not store_reachable:
        lines.append("Rank 0 (which hosts the rendezvous store) is unreachable: it most likely died or was killed.")
    elif missing:
        names = ", ".join(str(r) for r in missing)
        lines.append(f"Rank(s) {names} did not reach this round: dead, killed or hung (see their logs).")
    lines.append(f"Collective error: {cause}")
    lines.append("Every rank stops; resume from the last checkpoint (see OscarsStrategy(timeout=...)).")
    return "\n".join(lines)


class FailureBoard:
    """Failure notes in the rendezvous store (a ``torch.distributed.Store``), written only when things break."""

    def __init__(self, store: Any, world_size: int) -> None:
        self.store = store
        self.world_size = world_size

    @classmethod
    def from_default_group(cls, world_size: int) -> FailureBoard | None:
        store = default_store_or_none()
        return None if store is None else cls(store, world_size)

    def report_error(self, rank: int, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"[:2000]
        self._set(f"{_PREFIX}/error/{rank}", text)

    def errors(self) -> dict[int, str]:
        """Errors any rank reported so far ({} when the store is unreachable)."""
        found: dict[int, str] = {}
        try:
            for rank in range(self.world_size):
                key = f"{_PREFIX}/error/{rank}"
                if self.store.check([key]):
                    found[rank] = self.store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store died with rank 0: the caller's own error will say so
            pass
        return found

    def report_reached(self, rank: int, round_index: int) -> None:
        self._set(f"{_PREFIX}/reached/{round_index}/{rank}", "1")

    def read(self, round_index: int) -> tuple[dict[int, str], list[int]]:
        """Errors reported by any rank, and the ranks that reached ``round_index``; raises if unreachable."""
        errors: dict[int, str] = {}
        reached: list[int] = []
        for rank in range(self.world_size):
            key = f"{_PREFIX}/error/{rank}"
            if self.store.check([key]):
                errors[rank] = self.store.get(key).decode(errors="replace")
            if self.store.check([f"{_PREFIX}/reached/{round_index}/{rank}"]):
                reached.append(rank)
        return errors, reached

    def explain(
        self,
        rank: int,
        round_index: int,
        cause: BaseException,
        grace: float = 1.0,
        what: str = "the averaging all-reduce",
    ) -> str:
        """Leave this rank's note, give the other survivors ``grace`` seconds to leave theirs, then describe."""
        try:
            self.report_reached(rank, round_index)
            time.sleep(grace)
            errors, reached = self.read(round_index)
            reachable = True
        except Exception:  # noqa: BLE001 - the store died with rank 0
            errors, reached, reachable = {}, [rank], False
        return describe_collective_failure(
            rank, self.world_size, round_index, errors, reached, f"{type(cause).__name__}: {cause}", reachable, what
        )

    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except Exception:  # noqa: BLE001 - best effort: the store may be gone
            pass


def name_the_failure(
    rounds: RoundController, world_size: int, rank: int, error: BaseException, round_index: int, what: str
) -> str:
    """What a survivor of a broken collective (``what``, in round ``round_index``) says: the failed ranks named from
    the notes in the rendezvous store when it is reachable, and, with replica groups, where they sit."""
    board = FailureBoard.from_default_group(world_size)
    if board is not None:
        message = board.explain(rank, round_index, error, what=what)
    else:
        cause = f"{type(error).__name__}: {error}"
        message = describe_collective_failure(rank, world_size, round_index, {}, [rank], cause, what=what)
    k = rounds.replica_size  # with replica groups: where the ranks named sit
    return message + (f" (rank r is in replica r // {k}; this one in replica {rounds.rank})" if k > 1 else "")
