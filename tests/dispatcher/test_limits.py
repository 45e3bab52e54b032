"""What one request may make the dispatcher hold (issue 24.7): a dataset definition's size,
the datasets and workers registered at once, and the consumers of a coordinated job; each
refusal names the limit and the flag that raises it. Real servers, in this process."""

from __future__ import annotations

import grpc
import pytest

import torch_dataservice as tds
from tests.conftest import HOST
from torch_dataservice import cli
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from torch_dataservice.rpc import channel_to

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_a_dataset_definition_past_max_dataset_bytes_is_refused_naming_it() -> None:
    config = tds.DispatcherConfig(host=HOST, max_dataset_bytes=4096)
    with tds.DispatchServer(config) as dispatcher:
        tds.register_dataset(dispatcher.target, tds.Pipeline.range(10))
        with pytest.raises(ValueError, match="--max-dataset-bytes") as info:
            tds.register_dataset(dispatcher.target, tds.Pipeline.from_items([b"x" * 8192]))
        assert "4096" in str(info.value)
        # Past what gRPC accepts at all (the limit plus room for the rest of the request).
        with pytest.raises(ValueError, match="--max-dataset-bytes"):
            tds.register_dataset(dispatcher.target,
                                 tds.Pipeline.from_items([b"x" * (2 << 20)]))
        assert len(dispatcher._service.state.datasets) == 1  # noqa: SLF001


@pytest.mark.timeout(60)
def test_datasets_past_max_datasets_are_refused_naming_it() -> None:
    config = tds.DispatcherConfig(host=HOST, max_datasets=2)
    with tds.DispatchServer(config) as dispatcher:
        first = tds.register_dataset(dispatcher.target, tds.Pipeline.range(1))
        tds.register_dataset(dispatcher.target, tds.Pipeline.range(2))
        with pytest.raises(RuntimeError, match="--max-datasets"):
            tds.register_dataset(dispatcher.target, tds.Pipeline.range(3))
        # The same pipeline again is no new dataset.
        assert tds.register_dataset(dispatcher.target, tds.Pipeline.range(1)) == first


@pytest.mark.timeout(60)
def test_workers_past_max_workers_are_refused_naming_it() -> None:
    config = tds.DispatcherConfig(host=HOST, max_workers=1)
    with tds.DispatchServer(config) as dispatcher:
        first = tds.WorkerServer(tds.WorkerConfig(dispatcher.address, host=HOST,
                                                  num_processes=0))
        second = tds.WorkerServer(tds.WorkerConfig(dispatcher.address, host=HOST,
                                                   num_processes=0))
        try:
            assert first.refused is None
            assert second.refused is not None and "--max-workers" in second.refused
        finally:
            second.stop()
            first.stop()


@pytest.mark.timeout(60)
def test_a_job_of_billions_of_consumers_is_refused() -> None:
    """Found by fuzzing: a job with num_consumers=2**31-1 made one heartbeat build a set of
    that size, and the dispatcher was killed for its memory."""
    with tds.DispatchServer(tds.DispatcherConfig(host=HOST)) as dispatcher:
        dataset_id = tds.register_dataset(dispatcher.target, tds.Pipeline.range(4))
        stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(dispatcher.address))
        for config in (common_pb2.JobConfig(dataset_id=dataset_id, job_name="many",
                                            num_consumers=2**31 - 1),
                       common_pb2.JobConfig(dataset_id=dataset_id, target_workers="SOME")):
            with pytest.raises(grpc.RpcError) as info:
                stub.GetOrCreateJob(dispatcher_pb2.GetOrCreateJobRequest(config=config),
                                    timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not dispatcher._service.state.jobs  # noqa: SLF001


@pytest.mark.timeout(10)
def test_the_limits_are_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DATASERVICE_MAX_WORKERS", "7")
    args = cli._parse(["dispatcher", "--max-datasets", "5", "--max-dataset-bytes", "100"])
    assert (args.max_datasets, args.max_dataset_bytes, args.max_workers) == (5, 100, 7)
    assert cli._parse(["worker", "--dispatcher", "h:1", "--data-port-max-connections",
                       "9"]).data_port_max_connections == 9
    with pytest.raises(ValueError, match="max_datasets"):
        tds.DispatcherConfig(max_datasets=0)
