"""Ripples' coordinator and clients over a real TCPStore, in one process: the wire protocol and the thread's life."""

from __future__ import annotations

import socket
import sys
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning_oscars.core.groups import GroupBoard
from lightning_oscars.dist.ripples import GroupClient, GroupCoordinator


def _store() -> TCPStore:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


@pytest.fixture
def store() -> TCPStore:
    return _store()


def test_groups_reach_every_member_in_one_order_and_a_round_end_drains_the_buffer(store):
    coordinator = GroupCoordinator(store, "t", GroupBoard(3, group_size=3, generator="random", seed=0))
    clients = [GroupClient(store, "t", rank, timeout_s=10) for rank in range(3)]
    try:
        # Everybody takes part from the start: one division of the three, waiting in every member's buffer.
        assert clients[0].next_group() == (0, 1, 2)
        assert clients[1].next_group() == (0, 1, 2) and clients[2].next_group() == (0, 1, 2)
        assert [c.performed for c in clients] == [1, 1, 1]
        # Worker 2 asks again and gets a new division; the others' copies of it are what they must still perform
        # when they leave the round.
        assert clients[2].next_group() == (0, 1, 2)
        assert clients[0].end_round() == [(0, 1, 2)]
        assert clients[1].end_round() == [(0, 1, 2)]
        assert clients[2].end_round() == []
        assert coordinator.error is None
    finally:
        coordinator.stop()
    assert not coordinator._thread.is_alive()


def test_the_coordinator_shortens_the_switch_interval_while_it_runs_and_restores_it(store):
    before = sys.getswitchinterval()
    coordinator = GroupCoordinator(store, "s", GroupBoard(2))
    assert sys.getswitchinterval() < before  # the group thread gets the GIL promptly from a busy training thread
    coordinator.stop()
    assert sys.getswitchinterval() == before
    assert not coordinator._thread.is_alive()


def test_a_client_gives_up_after_its_timeout_when_no_coordinator_answers(store):
    client = GroupClient(store, "nobody", rank=0, timeout_s=1)
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        client.next_group()
