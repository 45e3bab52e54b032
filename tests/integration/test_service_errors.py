"""User errors on workers reach the consumer; unreachable services fail fast and clearly."""

from __future__ import annotations

import time

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["parallel_epochs", "distributed_epoch"])
def test_a_user_error_on_a_worker_reaches_the_consumer(shared_cluster: Cluster, mode: str) -> None:
    def divide(x: int) -> float:  # shipped by value: the traceback names it
        if x == 3:
            return x / 0
        return float(x)

    pipeline = tds.Pipeline.range(10).map(divide).apply(
        tds.distribute(mode, shared_cluster.target))
    start = time.monotonic()
    with pytest.raises(tds.RemoteError) as info:
        list(pipeline)
    assert time.monotonic() - start < 20
    error = info.value
    assert "ZeroDivisionError" in str(error) and "division by zero" in str(error)
    assert error.remote_type.endswith("ZeroDivisionError")
    assert "Traceback" in error.remote_traceback and "divide" in error.remote_traceback
    assert "x / 0" in error.remote_traceback  # the remote source line
    assert error.remote_traceback in str(error)
    # The servers are fine afterwards.
    assert sorted(tds.Pipeline.range(8).apply(tds.distribute(mode, shared_cluster.target))) == (
        sorted(list(range(8)) * (2 if mode == "parallel_epochs" else 1)))


@pytest.mark.timeout(60)
def test_elements_before_the_error_are_delivered(shared_cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(10).map(lambda x: x if x < 3 else x // 0).apply(
        tds.distribute("parallel_epochs", shared_cluster.target, max_outstanding_requests=1))
    received = []
    with pytest.raises(tds.RemoteError, match="ZeroDivisionError"):
        for element in pipeline:
            received.append(element)
    # OFF with one worker per task: whatever arrived came before element 3 of some worker.
    assert set(received) <= {0, 1, 2}


@pytest.mark.timeout(60)
def test_an_unpicklable_element_is_a_remote_error(shared_cluster: Cluster) -> None:
    import threading

    pipeline = tds.Pipeline.range(2).map(lambda x: threading.Lock()).apply(
        tds.distribute("distributed_epoch", shared_cluster.target))
    with pytest.raises(tds.RemoteError, match="lock"):
        list(pipeline)


@pytest.mark.timeout(30)
def test_a_dataset_id_that_does_not_exist(shared_cluster: Cluster) -> None:
    with pytest.raises(LookupError, match="no-such-dataset"):
        list(tds.from_dataset_id("parallel_epochs", shared_cluster.target, "no-such-dataset"))
