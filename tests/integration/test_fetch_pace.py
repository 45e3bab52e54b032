"""What a reader fetches ahead follows its consumer's pace (client/pace.py), with real servers on
loopback: a slow consumer holds about half a second of its own takes, not four fetches of 512
elements that the other readers of a shared DYNAMIC job can then never have."""

from __future__ import annotations

import time

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster
from tests.integration.test_dynamic_resume import open_reader
from torch_dataservice.client.pace import FETCH_MIN_ELEMENTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

N = 20_000
OUTSTANDING = 4  # the reader's fetch slots (max_outstanding_requests)


def test_a_slow_consumer_holds_little_of_a_shared_epoch(shared_cluster: Cluster) -> None:
    dataset_id = tds.register_dataset(shared_cluster.target, tds.Pipeline.range(N))
    slow = open_reader(shared_cluster.target, dataset_id, "slow-consumer", None, OUTSTANDING)
    try:
        taken = []
        held = []  # received and not yet taken, after each take
        for _ in range(40):  # 20 elements a second for 2 s; the workers produce far faster
            taken.append(next(slow))
            held.append(slow.stats()["elements"] - len(taken))
            time.sleep(0.05)
        assert len(set(taken)) == len(taken)
        # At most a floor-sized batch per slot (512 each before): the epoch stays the others'.
        assert max(held) <= OUTSTANDING * FETCH_MIN_ELEMENTS, held
    finally:
        slow.close()
