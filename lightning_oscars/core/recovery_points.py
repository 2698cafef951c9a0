"""Surviving a lost rank or node: what the survivors of a failed round save, and where a restarted fit finds it.

When a round's averaging fails (a peer died, or the collective timed out), every surviving rank saves its whole
state (its model with its progress since the last averaging, optimizer and loop state, callbacks, the round state
with the epoch's plan and its order of samples) before it stops, so that a restart (torch's elastic agent, a SLURM
requeue, a shell loop around Lightning's launcher) loses only the lost ranks' share of that round. The restarted fit
finds the newest complete *recovery point* by itself: each rank resumes from one survivor's state, the first thing
the fit does is merge the survivors' models, and the epoch goes on where it stopped (``continuation.py``).

On disk, under the recovery directory (``OscarsStrategy(recovery_dir=...)``, by default
``<default_root_dir>/oscars-recovery``; on a multi-node job it must be a file system every node sees)::

    step-000000123/rank-1.ckpt   the survivor's state: written under a temporary name, then renamed into place
    step-000000123/rank-1.json   its entry, written after the checkpoint: a rank without one did not finish saving

A point is the directory of one failed averaging (the global step is the same on every rank). A half-written state
(no entry, an unreadable entry, an entry that disagrees with the others) is ignored: its rank counts as lost. A point
with no complete entry is skipped for the one before it. Points are removed once a fit has merged a newer one, and
when a fit ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_oscars.core.continuation import Survivor

__all__ = ["RecoveryPoint", "RecoveryStore", "SavedRank", "default_recovery_dir", "model_fingerprint"]

_FORMAT = 1
_POINT_PREFIX = "step-"


def model_fingerprint(model: torch.nn.Module) -> str:
    """The model's class and the names and shapes of its state: a point saved by another model is not resumed."""
    shapes = ";".join(f"{name}:{tuple(t.shape)}" for name, t in model.state_dict().items())
    return f"{type(model).__qualname__}/{hashlib.sha1(shapes.encode()).hexdigest()[:16]}"


def default_recovery_dir(default_root_dir: str | os.PathLike[str]) -> Path:
    return Path(default_root_dir) / "oscars-recovery"


@dataclass(frozen=True)
class SavedRank:
    """One survivor's entry in a recovery point.

    Args:
        rank: its global rank in the failed world.
        replica: its rank as the rounds count them (its replica with replica groups, else ``rank``).
        round_units: the units it trained in the failed round, from the round's start.
        checkpoint: where its state lies.
    """

    rank: int
    replica: int
    round_units: int
    checkpoint: str


@dataclass(frozen=True)
class RecoveryPoint:
    """The survivors' states of one failed averaging, at ``global_step`` of ``epoch`` in a world of ``world_size``
    ranks (as the rounds count them)."""

    directory: str
    global_step: int
    epoch: int
    world_size: int
    saved: tuple[SavedRank, ...]
    stopped: bool = False  # saved at a coordinated stop (SIGTERM), not a failure: every rank holds the same model
    model: str = ""  # what was trained (``model_fingerprint``): a point of another model is not this fit's
    # Nothing was trained since the last averaging, which every rank took part in (a stop at a round boundary, a
    # failure inside a validation or a checkpoint write): the lost ranks' work up to it is in every model.
    averaged: bool = False

    def assigned(self, rank: int, replica_size: int = 1) -> SavedRank:
        """The state rank ``rank`` of the restarted world (replicas of ``replica_size`` ranks) resumes from: its
        replica's, the survivors' in turn (a world larger than the survivors, a node back, starts its extra replicas
        from copies; the merge gives them no weight)."""
        return self.saved[(rank // replica_size) % len(self.saved)]

    def merge_weight(self, rank: int, replica_size: int = 1) -> float:
        """Rank ``rank``'s weight in the merge of the survivors' models: one per survivor's state, carried by the
        first rank of the replica that resumes from it."""
        return 1.0 if rank % replica_size == 0 and rank // replica_size < len(self.saved) else 0.0

    def survivors(self, ranks: int) -> list[Survivor]:
        """The survivors whose models a restarted world of ``ranks`` ranks merges."""
        return [Survivor(s.replica, s.round_units) for s in self.saved[:ranks]]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "saved": [asdict(s) for s in self.saved]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RecoveryPoint:
        saved = tuple(SavedRank(**s) for s in data["saved"])
        fields = (data["directory"], data["global_step"], data["epoch"], data["world_size"])
        return cls(*fields, saved, data["stopped"], data["model"], data.get("averaged", False))


class RecoveryStore:
    """The recovery points under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def save(
        self,
        checkpoint: dict[str, Any],
        *,
        rank: int,
        replica: int,
        world_size: int,
        global_step: int,
        epoch: int,
        round_units: int,
        stopped: bool = False,
        model: str = "",
        averaged: bool = False,
    ) -> Path:
        """Write one survivor's state and then its entry (each under a temporary name first); returns the point."""
        point = self.root / f"{_POINT_PREFIX}{global_step:09d}"
        point.mkdir(parents=True, exist_ok=True)
        path = point / f"rank-{rank}.ckpt"
        _write_atomically(path, lambda f: torch.save(checkpoint, f))
        entry = {
            "format": _FORMAT,
            "epoch": epoch,
            "world_size": world_size,
            "global_step": global_step,
            "stopped": stopped,
            "averaged": averaged or stopped,
            "model": model,
            **asdict(SavedRank(rank, replica, round_units, str(path))),
        }
        _write_atomically(point / f"rank-{rank}.json", lambda f: f.write(json.dumps(entry).encode()))
        return point

    def points(self) -> list[Path]:
        """Every point's directory, the newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(_POINT_PREFIX)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def latest(self, model: str | None = None) -> RecoveryPoint | None:
        """The newest point with at least one complete state (of ``model``, if given), or ``None``."""
        for directory in self.points():
            point = read_point(directory)
            if point is not None and (model is None or point.model == model):
                return point
        return None

    def incomplete(self, newer_than: RecoveryPoint | None) -> list[Path]:
        """The points newer than ``newer_than`` (all, if ``None``) that hold no complete state: every survivor failed
        while saving, or died before. They are ignored; the caller says so."""
        step = -1 if newer_than is None else newer_than.global_step
        return [d for d in self.points() if (_step_of(d) or -1) > step and read_point(d) is None]

    def discard(self, through_step: int | None = None) -> None:
        """Remove the points up to ``through_step`` (all of them by default)."""
        for directory in self.points():
            step = _step_of(directory)
            if through_step is None or (step is not None and step <= through_step):
                shutil.rmtree(directory, ignore_errors=True)


def read_point(directory: Path) -> RecoveryPoint | None:
    """The complete states in ``directory`` as one point, or ``None`` if none is complete. Entries that disagree
    with the most common (epoch, world) of the point are left out, like an entry whose checkpoint is missing."""
    entries: list[dict[str, Any]] = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if entry.get("format") == _FORMAT and Path(entry.get("checkpoint", "")).is_file():
            entries.append(entry)
    if not entries:
        return None
    keys = [
        (e["epoch"], e["world_size"], e["global_step"], bool(e.get("stopped")), e.get("model", ""), e.get("averaged"))
        for e in entries
    ]
    epoch, world, step, stopped, model, averaged = agreed_key = max(set(keys), key=keys.count)
    averaged = bool(averaged)
    agreed = [e for e, key in zip(entries, keys) if key == agreed_key]
    saved = tuple(
        sorted(
            (SavedRank(e["rank"], e["replica"], e["round_units"], e["checkpoint"]) for e in agreed),
            key=lambda s: s.rank,
        )
    )
    return RecoveryPoint(str(directory), step, epoch, world, _distinct_replicas(saved), stopped, model, averaged)


def _distinct_replicas(saved: Sequence[SavedRank]) -> tuple[SavedRank, ...]:
    """One state per replica (the ranks of a replica hold one model): its first rank's."""
    seen: set[int] = set()
    kept = []
    for s in saved:
        if s.replica not in seen:
            seen.add(s.replica)
            kept.append(s)
    return tuple(kept)


def _step_of(directory: Path) -> int | None:
    try:
        return int(directory.name[len(_POINT_PREFIX) :])
    except ValueError:
        return None


def _write_atomically(path: Path, write: Any) -> None:
    """Write ``path`` under a temporary name, flush it to disk, then rename it into place: a reader sees the whole
    file or none."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
