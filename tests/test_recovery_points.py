"""Recovery points on disk (recovery_points.py): what a restart finds, and what it ignores."""

from __future__ import annotations

import json

import torch

from lightning_oscars.core.recovery_points import RecoveryPoint, RecoveryStore, model_fingerprint, read_point


def save(store: RecoveryStore, rank: int, step: int = 7, epoch: int = 0, world: int = 3, units: int = 2) -> None:
    state = {"rank": rank, "weights": torch.full((3,), float(rank))}
    store.save(state, rank=rank, replica=rank, world_size=world, global_step=step, epoch=epoch, round_units=units)


def test_the_newest_point_holds_every_complete_state_in_rank_order(tmp_path):
    store = RecoveryStore(tmp_path)
    save(store, 2, step=7)
    save(store, 0, step=7, units=4)
    save(store, 1, step=3)  # an older failure's point
    point = store.latest()
    assert point is not None and point.global_step == 7 and point.world_size == 3
    assert [s.rank for s in point.saved] == [0, 2] and point.saved[0].round_units == 4
    assert torch.load(point.saved[1].checkpoint)["rank"] == 2
    assert [s.rank for s in point.survivors(2)] == [0, 2]
    # A restart of 3 ranks: two resume from the survivors' states, the third from a copy weighing nothing.
    assert [point.assigned(r).rank for r in range(3)] == [0, 2, 0]
    assert [point.merge_weight(r) for r in range(3)] == [1.0, 1.0, 0.0]
    assert RecoveryPoint.from_json(json.loads(json.dumps(point.to_json()))) == point


def test_a_half_written_state_is_ignored_and_an_empty_point_skipped(tmp_path):
    store = RecoveryStore(tmp_path)
    save(store, 0, step=5)
    save(store, 1, step=9)
    newest = tmp_path / "step-000000009"
    (newest / "rank-1.ckpt").unlink()  # its entry without the state: as if the file system lost it
    (newest / ".rank-2.ckpt.partial").write_bytes(b"half")  # a rank killed while writing: no entry
    (newest / "rank-3.json").write_text("{not json")
    point = store.latest()
    assert point is not None and point.global_step == 5 and [s.rank for s in point.saved] == [0]
    assert store.incomplete(point) == [newest]  # what the restart warns it ignored
    assert store.incomplete(None) == [newest]


def test_a_point_after_an_averaging_says_so_and_a_stop_is_one(tmp_path):
    store = RecoveryStore(tmp_path)
    for rank, step, flags in ((0, 4, {}), (0, 6, {"averaged": True}), (0, 8, {"stopped": True})):
        store.save({}, rank=rank, replica=rank, world_size=2, global_step=step, epoch=0, round_units=0, **flags)
    points = [read_point(d) for d in reversed(store.points())]
    assert [(p.averaged, p.stopped) for p in points if p] == [(False, False), (True, False), (True, True)]


def test_entries_that_disagree_with_the_point_are_left_out(tmp_path):
    store = RecoveryStore(tmp_path)
    save(store, 0, epoch=1)
    save(store, 1, epoch=1)
    save(store, 2, epoch=0)  # could not be: the entry is not this failure's
    point = store.latest()
    assert point is not None and point.epoch == 1 and [s.rank for s in point.saved] == [0, 1]


def test_one_state_per_replica(tmp_path):
    store = RecoveryStore(tmp_path)
    for rank in range(4):
        state = {"rank": rank}
        store.save(state, rank=rank, replica=rank // 2, world_size=2, global_step=1, epoch=0, round_units=1)
    point = store.latest()
    assert point is not None and [(s.rank, s.replica) for s in point.saved] == [(0, 0), (2, 1)]
    # A restart of three replicas of two ranks: each replica resumes from one state, the third from a copy; the merge
    # counts each state once, through its replica's first rank.
    assert [point.assigned(r, replica_size=2).rank for r in range(6)] == [0, 0, 2, 2, 0, 0]
    assert [point.merge_weight(r, replica_size=2) for r in range(6)] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_discarding_removes_points_up_to_a_step(tmp_path):
    store = RecoveryStore(tmp_path)
    for step in (3, 5, 8):
        save(store, 0, step=step)
    store.discard(through_step=5)
    assert [p.name for p in store.points()] == ["step-000000008"]
    store.discard()
    assert store.points() == [] and store.latest() is None
    assert RecoveryStore(tmp_path / "missing").latest() is None


def test_a_point_of_another_model_is_not_this_fits(tmp_path):
    small, large = torch.nn.Linear(2, 3), torch.nn.Linear(2, 4)
    assert model_fingerprint(small) == model_fingerprint(torch.nn.Linear(2, 3)) != model_fingerprint(large)
    store = RecoveryStore(tmp_path)
    store.save(
        {}, rank=0, replica=0, world_size=2, global_step=4, epoch=0, round_units=1, model=model_fingerprint(small)
    )
    assert store.latest(model_fingerprint(large)) is None
    point = store.latest(model_fingerprint(small))
    assert point is not None and point.model == model_fingerprint(small)


def test_a_survivors_random_generators_are_restored_from_a_weights_only_load(tmp_path):
    import io
    import random

    import numpy as np

    from lightning_oscars.core.recovery_points import SavedRank
    from lightning_oscars.lightning import _internals
    from lightning_oscars.lightning.recovery import FitRecovery

    saved = io.BytesIO()
    torch.save({"recovery": {"rng": _internals.rng_states()}}, saved)
    expected = (torch.rand(3).tolist(), np.random.rand(), random.random())
    point = RecoveryPoint(str(tmp_path), 7, 0, 2, (SavedRank(0, 0, 1, "rank-0.ckpt"),))
    for rank, restored in ((0, True), (1, False)):  # rank 1 resumes from a copy of rank 0's state: not its own
        torch.manual_seed(rank + 100), np.random.seed(rank + 100), random.seed(rank + 100)
        saved.seek(0)
        state = torch.load(saved, weights_only=True)  # as Lightning restores a checkpoint
        FitRecovery(RecoveryStore(tmp_path), point, rank).resume(None, None, state, 0, None, None)  # type: ignore[arg-type]
        drawn = (torch.rand(3).tolist(), np.random.rand(), random.random())
        assert (drawn == expected) is restored
