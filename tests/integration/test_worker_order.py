"""One worker keeps its dataset's order however many executor processes run it.

Its processes take splits in turn and finish them out of order (here: a map that sleeps a
random few milliseconds per element); the worker front releases elements in the order it
handed the splits out, as torch's DataLoader (in_order=True) and tf.data service do.
"""

from __future__ import annotations

import random
import time

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N = 1000


def jitter(x: int) -> int:
    """Sleep 0-3 ms: processes finish their splits out of order."""
    time.sleep(random.random() * 0.003)
    return x


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    from tests.conftest import _make_cluster

    made = _make_cluster(1, num_processes=2)
    yield made
    made.stop()


def test_parallel_epochs_on_two_processes_yield_the_dataset_order(cluster: Cluster) -> None:
    dataset = tds.Pipeline.range(N).map(jitter).apply(
        tds.distribute("parallel_epochs", cluster.target))
    for _ in range(3):
        assert list(dataset) == list(range(N))


def test_distributed_epoch_on_one_worker_yields_the_order_splits_were_handed_out(
        cluster: Cluster) -> None:
    dataset = tds.Pipeline.range(N).map(jitter).apply(
        tds.distribute("distributed_epoch", cluster.target))
    for _ in range(2):
        assert list(dataset) == list(range(N))


def test_order_holds_for_batches_and_a_repeated_pipeline(cluster: Cluster) -> None:
    dataset = tds.Pipeline.range(200).map(jitter).repeat(3).apply(
        tds.distribute("parallel_epochs", cluster.target))
    assert list(dataset) == list(range(200)) * 3
    # A batch per split (a batch spanning splits mixes those its process took, by design).
    batched = tds.Pipeline.range(N).with_split_size(10).map(jitter).batch(10).apply(
        tds.distribute("distributed_epoch", cluster.target))
    assert [int(x) for batch in batched for x in batch] == list(range(N))
