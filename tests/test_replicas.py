"""Replica groups (``replica_size``): the layout's arithmetic and errors, a replica's batch split among its ranks,
what a replica reports at a round's end, the options refused, and (one launch of ``replicas_case.py``, 4 ranks as 2
replicas of 2, the second 3x slower) DDP inside a replica, oscars' rounds across, every sample once, resume across
layouts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry
from replicas_case import FITS, SAMPLES
from subproc import ROOT, assert_clean_exit, clean_env, run
from test_rounds import FakeClock
from torch.utils.data import DataLoader, Dataset

from lightning_oscars import OscarsStrategy
from lightning_oscars.core.control import ControlData
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan, planned_slots
from lightning_oscars.core.policy import SchedulePolicy
from lightning_oscars.core.replicas import ReplicaLayout, replica_batches
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.core.slots import SlotInfo

# ------------------------------------------------------------------ the layout


def test_layout_places_consecutive_ranks_in_replicas():
    layout = ReplicaLayout(8, 4)
    assert layout.replicas == 2
    assert [layout.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.member_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert layout.ranks_of(1) == [4, 5, 6, 7]
    assert ReplicaLayout(3).replicas == 3


@pytest.mark.parametrize(("start", "end"), [(0, 12), (12, 21), (5, 8), (0, 3)])
def test_member_spans_cover_a_batch_once_in_near_equal_parts(start: int, end: int):
    layout = ReplicaLayout(6, 3)
    spans = [layout.member_span(start, end, m) for m in range(3)]
    covered = [i for a, b in spans for i in range(a, b)]
    assert covered == list(range(start, end))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_resolve_reads_nodes_and_names_bad_layouts():
    two_nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    assert ReplicaLayout.resolve("node", 8, two_nodes).replica_size == 4
    assert ReplicaLayout.resolve(2, 8, two_nodes).replicas == 4
    assert ReplicaLayout.resolve(1, 8, two_nodes).replica_size == 1
    with pytest.raises(ValueError, match=r"replica_size=3 does not divide the world of 8 ranks"):
        ReplicaLayout.resolve(3, 8, two_nodes)
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2, 3, 4, 5, 6, 7\] of nodes \[0, 1\].*replica_spans_nodes"):
        ReplicaLayout.resolve(8, 8, two_nodes)
    assert ReplicaLayout.resolve(8, 8, two_nodes, spans_nodes=True).replicas == 1
    with pytest.raises(ValueError, match=r"same number of ranks on every node.*node 0: 2, node 1: 4"):
        ReplicaLayout.resolve("node", 6, [0, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="consecutive global ranks"):
        ReplicaLayout.resolve("node", 4, [0, 1, 0, 1])
    for bad in (0, -2, "nodes", 1.5, True):
        with pytest.raises(ValueError, match="positive integer or 'node'"):
            ReplicaLayout.resolve(bad, 4, [0, 0, 0, 0])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("samples", "drop_last", "expected"),
    [(64, False, 8), (65, False, 8), (66, False, 9), (71, False, 9), (65, True, 8), (7, False, 1)],
)
def test_replica_batches_never_leave_a_rank_without_a_sample(samples: int, drop_last: bool, expected: int):
    assert replica_batches(samples, 4, 2, drop_last) == expected  # replica batches of 2 x 4 samples
    assert replica_batches(samples, 4, 1, drop_last) == (samples // 4 if drop_last else -(-samples // 4))


# ------------------------------------------------------------------ a replica's batch, split among its ranks


class _Indexed(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _trained(samples: int, rank: int, layout: ReplicaLayout, drop_last: bool = False) -> tuple[list[int], list[bool]]:
    """One epoch of ``rank`` in ``layout`` (2 replicas): the samples it trained on, and which slots were real."""
    user = DataLoader(_Indexed(samples), batch_size=4, drop_last=drop_last)
    loader = LoadBalancedLoader(
        user,
        rank=layout.replica_of(rank),
        world_size=layout.replicas,
        shuffle=True,
        seed=5,
        replica_size=layout.replica_size,
        member=layout.member_of(rank),
    )
    steps = (3, 1)
    slots = planned_slots(steps, loader.total_units)
    loader.start_epoch(EpochPlan(layout.replicas, loader.total_units, slots, steps), 0, None)
    trained, real = [], []
    iterator = iter(loader)
    for _ in range(slots):
        batch = next(iterator)
        info = loader.take_slot()
        real.append(info.real)
        if info.real:
            trained.extend(batch.tolist())
            assert info.samples == len(batch) > 0
    return trained, real


@pytest.mark.parametrize(("samples", "drop_last"), [(64, False), (65, False), (70, False), (70, True)])
def test_a_replicas_ranks_step_together_and_train_every_sample_once(samples: int, drop_last: bool):
    layout = ReplicaLayout(4, 2)
    epochs = [_trained(samples, rank, layout, drop_last) for rank in range(4)]
    assert epochs[0][1] == epochs[1][1] and epochs[2][1] == epochs[3][1], "a replica's ranks: the same real slots"
    assert epochs[0][1] != epochs[2][1], "the replicas' shares follow their local steps"
    trained = sorted(i for t, _ in epochs for i in t)
    kept = samples - samples % 8 if drop_last else samples
    assert len(trained) == kept and len(set(trained)) == kept, "every sample (of full replica batches) once"
    share = [len(t) for t, _ in epochs]
    assert abs(share[0] - share[1]) <= 1 and abs(share[2] - share[3]) <= 1, share
    assert share[0] + share[1] > 2 * (share[2] + share[3]), "the replica with 3x the steps trains ~3x the data"


def test_without_replicas_the_loader_splits_as_before():
    plain = _trained(40, 1, ReplicaLayout(2))
    user = DataLoader(_Indexed(40), batch_size=4)
    loader = LoadBalancedLoader(user, rank=1, world_size=2, shuffle=True, seed=5)
    assert loader.num_batches == 10 and plain[0] and len(plain[0]) % 4 == 0


# ------------------------------------------------------------------ what a replica reports


def test_a_replica_is_one_rank_of_the_rounds_reported_by_its_first_rank():
    """2 replicas of 2 ranks: four controllers run a round and sum their control data, as the all-reduce does."""
    laps = {(0, 0): 0.01, (0, 1): 0.5, (1, 0): 0.03, (1, 1): 0.7}  # (replica, member): only members 0 count
    ranks = []
    for (replica, member), seconds in laps.items():
        clock = FakeClock()
        clock.next_lap = seconds
        rounds = RoundController(
            SchedulePolicy(warmup_steps=2), 2, replica, member=member, replica_size=2, clock=clock, now=lambda: 0.0
        )
        rounds.begin_fit()
        rounds.plan_epoch(0, total_units=64, bound=rounds.policy.epoch_slot_bound(64))
        ranks.append(rounds)
    rnd = ranks[0].plan.round_at(0)
    for rounds in ranks:
        real = rnd.real_offsets(rounds.rank)
        for offset in range(rnd.length):
            samples = (4 + rounds.member) if offset in real else 0  # the members' parts of a replica batch differ
            rounds.begin_slot(SlotInfo(offset in real, samples, 0.0))
            rounds.end_slot(offset, 1, ranks[0].plan.total_slots)
    vectors = [r.contribution(global_step=rnd.end_slot).encode(2) for r in ranks]
    summed = ControlData.decode([sum(v) for v in zip(*vectors)], 2)
    assert [r.samples for r in summed.ranks] == [2 * 9, 2 * 9], "a replica's samples are all its ranks'"
    assert [r.step_time for r in summed.ranks] == pytest.approx([0.01, 0.03]), "its step time is its first rank's"
    assert [r.global_step for r in summed.ranks] == [rnd.end_slot] * 2
    outcomes = [
        r.absorb(summed, allreduce_s=0.001, epoch=0, global_step=rnd.end_slot, next_slot=rnd.end_slot) for r in ranks
    ]
    assert all(o == outcomes[0] for o in outcomes), "every rank of every replica reaches the same outcome"
    steps = ranks[0].local_steps
    assert len(steps) == 2 and steps[0] >= 2 * steps[1], "the solver balances the replicas"
    with pytest.raises(ValueError, match=r"member 2\) outside 2 replicas of 2 ranks"):
        RoundController(SchedulePolicy("exact"), 2, 0, member=2, replica_size=2)


def test_a_checkpoints_rounds_of_another_layout_start_fresh():
    saved = RoundController(SchedulePolicy("exact"), 2, 0, replica_size=2)
    saved.begin_fit()
    state = saved.state_dict()
    assert state["replica_size"] == 2
    other = RoundController(SchedulePolicy("exact"), 2, 0)
    other.begin_fit()
    assert other.load_state_dict(state, 8) is None and other.ledger.num_averagings == 0
    older = {k: v for k, v in state.items() if k != "replica_size"}  # a checkpoint of a release without replicas
    assert RoundController(SchedulePolicy("exact"), 2, 0).load_state_dict(older, 8) is None  # no plan saved


# ------------------------------------------------------------------ options


def test_replica_options_are_validated_when_the_strategy_is_built():
    assert OscarsStrategy(replica_size="node").replica_size == "node"
    assert OscarsStrategy(replica_size=2, find_unused_parameters=True)._replica_wrapper_options == {
        "find_unused_parameters": True
    }
    for bad in (0, "nodes", 2.0):
        with pytest.raises(ValueError, match="replica_size must be a positive integer or 'node'"):
            OscarsStrategy(replica_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be combined with deadline_rounds"):
        OscarsStrategy(replica_size=2, deadline_rounds=True)
    with pytest.raises(ValueError, match="process_group is set by the strategy"):
        OscarsStrategy(replica_size=2, process_group=None)
    with pytest.raises(ValueError, match="replica_spans_nodes must be True or False"):
        OscarsStrategy(replica_size=2, replica_spans_nodes="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["ssp", "ripples"])
def test_the_paradigms_refuse_replica_groups(name: str):
    strategy = StrategyRegistry[name]["strategy"]
    with pytest.raises(ValueError, match=f"strategy={name!r} does not take replica_size=2"):
        strategy(replica_size=2)


# ------------------------------------------------------------------ 4 ranks as 2 replicas of 2

TIMEOUT_S = 420


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    out = tmp_path_factory.mktemp("replicas")
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT_S - 20))
    code, log = run([sys.executable, str(ROOT / "tests" / "replicas_case.py"), str(out)], TIMEOUT_S, env)
    assert_clean_exit(code, log, TIMEOUT_S)
    return [json.loads(Path(out / f"rank{rank}.json").read_text()) for rank in range(4)]


FIT_NAMES = [*FITS, "resume_1_then_2"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*FIT_NAMES, "stop_from_rank3"])
def test_a_replicas_ranks_are_one_ddp_model_after_every_step(results: list[dict[str, dict]], name: str):
    ranks = [r[name] for r in results]
    assert [r["replica"] for r in ranks] == [0, 0, 1, 1]
    assert {r["wrapped"] for r in ranks} == {"DistributedDataParallel"}, "each replica trains under torch's DDP"
    for first, second in ((0, 1), (2, 3)):
        assert ranks[first]["after_step"] == ranks[second]["after_step"], "a replica's parameters after every step"
        assert ranks[first]["after_step"], "the replica stepped"
    common = set(ranks[0]["after_step"]) & set(ranks[2]["after_step"])
    assert any(ranks[0]["after_step"][s] != ranks[2]["after_step"][s] for s in common), "replicas train apart"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*FIT_NAMES, "resume_2_then_1"])
def test_replicas_end_on_one_model_with_every_sample_once(results: list[dict[str, dict]], name: str):
    ranks = [r[name] for r in results]
    assert len({r["weights"] for r in ranks}) == 1, "identical weights (and buffers) on every rank after fit"
    assert len({r["global_step"] for r in ranks}) == 1
    for epoch in ranks[0]["trained"]:
        trained = sorted(i for r in ranks for i in r["trained"].get(epoch, []))
        assert trained == list(range(SAMPLES)), f"epoch {epoch}: every sample once across the ranks"
    if name.startswith("frozen"):
        assert all(r["frozen_kept"] for r in ranks)


@pytest.mark.multiprocess
def test_rounds_balance_the_replicas_and_validation_runs_on_one_model(results: list[dict[str, dict]]):
    ranks = [r["mlp"] for r in results]
    history = ranks[0]["local_steps"]
    assert all(len(steps) == 2 for steps in history), "one entry per replica in every record"
    assert all(r["local_steps"] == history for r in ranks), "every rank agreed on the rounds"
    assert any(fast > slow for fast, slow in history[1:]), f"the faster replica takes more local steps: {history}"
    assert [r["validated"] for r in ranks] == [8, 8, 8, 8], "each rank validated its share, every epoch"
    # The second fit of the resume pair ran under replica_size=1 from a replica_size=2 checkpoint: 4 replicas.
    assert all(len(steps) == 4 for steps in results[0]["resume_2_then_1"]["local_steps"])


@pytest.mark.multiprocess
def test_a_stop_asked_by_one_rank_of_a_replica_stops_every_rank_at_one_round_boundary(results: list[dict[str, dict]]):
    ranks = [r["stop_from_rank3"] for r in results]
    assert len({r["global_step"] for r in ranks}) == 1 and len({r["weights"] for r in ranks}) == 1
    assert ranks[0]["trained"].keys() == {"0"}, "stopped in the first of two epochs"
    trained = [i for r in ranks for i in r["trained"]["0"]]
    assert len(trained) == len(set(trained)), "no sample twice"
    full = results[0]["mlp"]["global_step"]  # the same model and layout, 2 epochs, no stop
    assert ranks[0]["global_step"] <= full / 2


@pytest.mark.multiprocess
def test_each_replica_trains_its_own_batch_size(results: list[dict[str, dict]]):
    ranks = [r["replica_sizes"] for r in results]
    for rank, size in zip(ranks, [12, 12, 4, 4]):
        *steps, last = rank["lengths"]
        assert steps and set(steps) == {size}, rank["lengths"]
        # the epoch's last step: fewer where the epoch ran out, one more where the leftover sample (65 = 8 x 8 + 1)
        # joined the last batch
        assert 1 <= last <= size + 1, rank["lengths"]
    assert len(ranks[0]["lengths"]) == len(ranks[1]["lengths"]), "a replica's ranks step together"
    assert len(ranks[2]["lengths"]) == len(ranks[3]["lengths"]), "a replica's ranks step together"
    assert sum(sum(rank["lengths"]) for rank in ranks) == SAMPLES
