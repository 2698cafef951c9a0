"""Failure notes and the message a surviving rank raises (no processes: an in-memory store)."""

from datetime import timedelta

from torch.distributed import HashStore

from lightning_oscars.dist.faults import FailureBoard, describe_collective_failure


def test_message_names_the_rank_that_raised():
    text = describe_collective_failure(0, 4, 12, {2: "ValueError: bad batch"}, [0, 1, 3], "Connection closed by peer")
    assert "round 12 failed on rank 0 of 4" in text
    assert "Rank 2 failed: ValueError: bad batch" in text
    assert "did not reach" not in text  # every other rank is accounted for
    assert "Connection closed by peer" in text


def test_message_names_an_exchange_within_a_round():
    text = describe_collective_failure(
        0, 2, 4, {1: "ValueError: x"}, [0], "reset", what="the ripples exchange after a step"
    )
    assert text.startswith("oscars: the ripples exchange after a step of round 4 failed on rank 0 of 2.")
    assert "all-reduce" not in text


def test_message_names_ranks_that_never_arrived():
    text = describe_collective_failure(1, 4, 3, {}, [0, 1], "Timed out")
    assert "Rank(s) 2, 3 did not reach this round" in text


def test_message_when_the_store_died_with_rank_0():
    text = describe_collective_failure(1, 2, 3, {}, [1], "Connection reset", store_reachable=False)
    assert "Rank 0 (which hosts the rendezvous store) is unreachable" in text


def test_board_round_trip_through_a_store():
    store = HashStore()
    store.set_timeout(timedelta(seconds=5))
    failing, survivor = FailureBoard(store, 3), FailureBoard(store, 3)
    failing.report_error(2, RuntimeError("CUDA error: out of memory"))
    survivor.report_reached(1, 7)
    text = survivor.explain(0, 7, ConnectionError("peer closed"), grace=0.0)
    assert "Rank 2 failed: RuntimeError: CUDA error: out of memory" in text
    assert "did not reach" not in text  # rank 1 reached round 7, rank 0 is the writer
    errors, reached = survivor.read(7)
    assert errors == {2: "RuntimeError: CUDA error: out of memory"} and reached == [0, 1]
    # A later round: rank 1 has not reached it.
    assert "Rank(s) 1 did not reach" in survivor.explain(0, 8, TimeoutError("timed out"), grace=0.0)


def test_board_survives_a_broken_store():
    class Broken:
        def set(self, *_):
            raise ConnectionError("store gone")

        check = get = set

    text = FailureBoard(Broken(), 2).explain(1, 5, ConnectionError("reset"), grace=0.0)
    assert "unreachable" in text
