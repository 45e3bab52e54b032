"""What a reader remembers of the elements it received (exactly-once DYNAMIC) stays one int per
split: offsets that arrive in order, and the dispatcher's notices of settled splits, compact it."""

from __future__ import annotations

import pytest

import torch_dataservice as tds
from tests.dispatcher.builders import (
    Clock,
    get_split,
    report,
    start_epoch,
    task_of,
    timed_service,
)
from torch_dataservice.client.delivery import SplitReceived as _SplitReceived
from torch_dataservice.client.reader import IterationReader
from torch_dataservice.proto import dispatcher_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def test_split_received_is_compact_and_exact() -> None:
    received = _SplitReceived()
    assert [received.add(o) for o in (0, 1, 3, 1, 2, 3)] == [True, True, True, False, True, False]
    assert (received.below, received.extra) == (4, None)
    assert received.add(7) and received.add(9)
    received.deliver_below(8)  # 0..7 delivered somewhere: 8 is still new, 9 still seen
    assert (received.below, received.extra) == (8, {9})
    assert not received.add(5) and not received.add(9) and received.add(8)
    assert (received.below, received.extra) == (10, None)


def test_heartbeat_replies_name_settled_splits_once_per_client() -> None:
    service = timed_service(Clock())
    iteration_id, client = start_epoch(service)
    other = service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(
        job_id=service.state.iteration(iteration_id).job_id), None).client_id
    a = task_of(service, iteration_id, "a:1")
    get_split(service, iteration_id, a)  # split 0
    report(service, client, 0, [0, 2])
    get_split(service, iteration_id, a, finished=(0, 0, 3))
    report(service, other, 0, [1])  # settles split 0 (3 elements), by the other client
    beat = pb.ClientHeartbeatRequest
    first = service.ClientHeartbeat(beat(client_id=client), None)
    assert [(s.split.index, s.num_elements) for s in first.settled] == [(0, 3)]
    assert not service.ClientHeartbeat(beat(client_id=client), None).settled
    # The other client was told in the reply to the very heartbeat that settled it.
    assert not service.ClientHeartbeat(beat(client_id=other), None).settled
    assert not service._soft.settle_news  # noqa: SLF001 - every client was told
    assert not service._soft.settle_watch[iteration_id]  # noqa: SLF001
    service.close()


def test_a_dynamic_epoch_leaves_one_int_per_split(shared_cluster) -> None:
    pipeline = tds.Pipeline.range(5000).with_split_size(50)
    dataset_id = tds.register_dataset(shared_cluster.target, pipeline)
    config = tds.client.api.ReadOptions.build(
        "distributed_epoch", shared_cluster.target, None, None, None, None, None,
        "AUTO").job_config(dataset_id, "")
    reader = IterationReader(shared_cluster.address, config, 0, None, 10)
    assert sorted(int(x) for x in reader) == list(range(5000))
    seen = reader._delivery.seen  # noqa: SLF001
    assert len(seen) == 100
    assert all(r.extra is None and r.below == 50 for r in seen.values())
