"""A drained worker leaving (WorkerHeartbeat.leaving) and reporting without taking
(GetSplit.report_only), and the version check of registrations: the dispatcher alone."""

from __future__ import annotations

import pytest

from tests.dispatcher.builders import (
    Clock,
    Context,
    get_split,
    heartbeat_worker,
    report,
    start_epoch,
    task_of,
    timed_service,
)
from torch_dataservice import version
from torch_dataservice.errors import VersionMismatchError
from torch_dataservice.proto import common_pb2, dispatcher_pb2

pb = dispatcher_pb2


def leave(service, address: str, uid: int = 1) -> None:
    service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(
        worker_address=address, worker_uid=uid, leaving=True), None)


@pytest.mark.timeout(10)
def test_a_leaving_worker_is_removed_and_its_unsettled_splits_requeued() -> None:
    service = timed_service(Clock())
    iteration_id, client = start_epoch(service)
    a = task_of(service, iteration_id, "a:1")
    assert get_split(service, iteration_id, a).split_index == 0
    assert get_split(service, iteration_id, a, finished=(0, 0, 2)).split_index == 1
    report(service, client, 0, [0, 1])  # split 0 settled; split 1 not
    # Draining: it reports what it finished and takes nothing new.
    request = pb.GetSplitRequest(iteration_id=iteration_id, task_id=a, report_only=True)
    request.finished_splits.add(elements=3).split.CopyFrom(common_pb2.SplitKey(index=1))
    assert service.GetSplit(request, None).end_of_splits
    assert service.state.iteration(iteration_id).cursor_index == 2
    leave(service, "a:1", uid=2)  # another incarnation's goodbye removes nothing
    assert "a:1" in service.state.workers
    leave(service, "a:1")
    assert "a:1" not in service.state.workers
    assert [s.index for s in service.state.iteration(iteration_id).requeued] == [1]
    heartbeat_worker(service, "b:1")
    assert "a:1" not in service.state.workers  # a heartbeat of another worker re-adds nothing


@pytest.mark.timeout(10)
def test_registrations_with_another_protocol_or_python_are_refused() -> None:
    service = timed_service(Clock())
    mine = version.current()
    other = common_pb2.BuildInfo(package_version="9.0", protocol_version=mine.protocol + 1,
                                 python_version=mine.python)
    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION") as info:
        service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(
            worker_address="a:1", worker_uid=1, build=other), _PeerContext())
    assert f"protocol {mine.protocol + 1}" in str(info.value)
    assert f"protocol {mine.protocol}," in str(info.value)
    assert "a:1" not in service.state.workers
    other.protocol_version, other.python_version = mine.protocol, "2.7"
    with pytest.raises(VersionMismatchError, match="Python 2.7"):
        from torch_dataservice.dispatcher import validation

        validation.check_version(pb.GetOrCreateJobRequest(build=other), "this client")
    same = version.to_message(mine)
    heartbeat = pb.WorkerHeartbeatRequest(worker_address="a:1", worker_uid=1, build=same)
    service.WorkerHeartbeat(heartbeat, None)
    assert "a:1" in service.state.workers


class _PeerContext(Context):
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = metadata
