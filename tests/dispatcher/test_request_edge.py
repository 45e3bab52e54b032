"""Requests are checked at the edge (issue 15.5): a field no well-behaved peer sends is refused
with INVALID_ARGUMENT and never reaches the state; a user's job name cannot collide with the
dispatcher's anonymous jobs. Real servers, driven through their gRPC stubs."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

import torch_dataservice as tds
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from torch_dataservice.rpc import channel_to

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_an_out_of_range_repetition_is_refused_and_the_journal_still_works(
        tmp_path: Path) -> None:
    config = tds.DispatcherConfig(host="127.0.0.1", fault_tolerant_mode=True,
                                  work_dir=str(tmp_path))
    with tds.DispatchServer(config) as dispatcher:
        stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(dispatcher.address))
        with pytest.raises(grpc.RpcError) as info:
            stub.GetSplit(dispatcher_pb2.GetSplitRequest(
                iteration_id=2000, task_id=4000, repetition=2**63 - 1), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "repetition=9223372036854775807" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.ClientHeartbeat(dispatcher_pb2.ClientHeartbeatRequest(
                client_id=3000, received=[dispatcher_pb2.ReceivedSplit(offsets=[-1])]),
                timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "received.offsets=-1" in info.value.details()
        # State changes after the refused requests still work, and survive a restart.
        tds.register_dataset(dispatcher.target, tds.Pipeline.range(5))
    with tds.DispatchServer(config) as restarted:
        assert len(restarted._service.state.datasets) == 1  # noqa: SLF001


@pytest.mark.timeout(60)
def test_a_user_job_name_does_not_collide_with_anonymous_jobs(shared_cluster) -> None:
    stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(shared_cluster.address))
    dataset_id = tds.register_dataset(shared_cluster.target, tds.Pipeline.range(4))
    policy = int(tds.ShardingPolicy.OFF)
    anonymous = stub.GetOrCreateJob(dispatcher_pb2.GetOrCreateJobRequest(
        config=common_pb2.JobConfig(dataset_id=dataset_id, sharding_policy=policy)), timeout=10)
    # What the dispatcher once named its next anonymous job, taken by a user...
    name = f"anonymous_job_{anonymous.job_id + 1}"
    named = stub.GetOrCreateJob(dispatcher_pb2.GetOrCreateJobRequest(
        config=common_pb2.JobConfig(dataset_id=dataset_id, sharding_policy=policy,
                                    job_name=name)), timeout=10)
    # ... does not stop anonymous jobs from being created, nor joins one.
    again = stub.GetOrCreateJob(dispatcher_pb2.GetOrCreateJobRequest(
        config=common_pb2.JobConfig(dataset_id=dataset_id, sharding_policy=policy)), timeout=10)
    assert len({anonymous.job_id, named.job_id, again.job_id}) == 3
    assert sorted(tds.Pipeline.range(4).apply(tds.distribute(
        "parallel_epochs", shared_cluster.target))) == sorted(list(range(4)) * 2)


@pytest.mark.timeout(30)
def test_the_serialized_fast_path_refuses_exactly_what_the_field_walk_refuses() -> None:
    """check_request skips the walk for messages without a long varint: every integer at the
    edges of the range, plain, repeated and nested, still reaches the same verdict."""
    from torch_dataservice.rpc import MAX_REQUEST_INT, check_request

    def refused(message) -> bool:
        try:
            check_request(message)
        except ValueError:
            return True
        return False

    for value in (0, 1, 2**56 - 1, 2**56, MAX_REQUEST_INT - 1):
        assert not refused(dispatcher_pb2.GetSplitRequest(repetition=value))
        assert not refused(dispatcher_pb2.ClientHeartbeatRequest(
            received=[dispatcher_pb2.ReceivedSplit(
                split=common_pb2.SplitKey(index=value), offset_ranges=[0, value])]))
    for value in (-1, -2**31, MAX_REQUEST_INT, 2**63 - 1):
        assert refused(dispatcher_pb2.GetSplitRequest(repetition=value))
        assert refused(dispatcher_pb2.ClientHeartbeatRequest(
            received=[dispatcher_pb2.ReceivedSplit(split=common_pb2.SplitKey(index=value))]))
        assert refused(dispatcher_pb2.ClientHeartbeatRequest(fenced_tasks=[1, value, 2]))
    # Random integers around every power of two agree with the walk alone.
    from torch_dataservice.rpc import _check_fields

    rng = random.Random(27)
    for _ in range(3000):
        value = max(-2**63, min(2**63 - 1, rng.choice((1, -1)) * (
            2**rng.randrange(64) + rng.randrange(-3, 4))))
        message = dispatcher_pb2.ClientHeartbeatRequest(client_id=7, fenced_tasks=[value])
        try:
            _check_fields(message, "")
            walked = False
        except ValueError:
            walked = True
        assert refused(message) == walked, value
    # Strings with many high bytes in a row take the walk, with the same verdict.
    assert not refused(dispatcher_pb2.WorkerHeartbeatRequest(worker_address="é" * 20))
    assert refused(dispatcher_pb2.WorkerHeartbeatRequest(worker_address="é" * 20,
                                                         current_tasks=[-5]))
