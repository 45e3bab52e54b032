"""What a worker's heartbeats say of the splits it holds cached (worker/dispatcher_client.py
HeldReport): the set only when the dispatcher lacks it, as ranges; nothing without a provider;
and a task's first ask of a repetition sends a heartbeat first when the set changed."""

from __future__ import annotations

import threading

import pytest

from torch_dataservice.config import WorkerConfig
from torch_dataservice.proto import dispatcher_pb2
from torch_dataservice.wire.splits import index_ranges, range_indices
from torch_dataservice.worker.dispatcher_client import DispatcherClient, HeldReport

pb = dispatcher_pb2
pytestmark = pytest.mark.timeout(30)


def beat(report: HeldReport, acknowledged: bool = True) -> pb.WorkerHeartbeatRequest:
    request = pb.WorkerHeartbeatRequest()
    report.fill(request)
    if acknowledged:  # the dispatcher stored what was sent (or had it already)
        report.acknowledge(pb.WorkerHeartbeatResponse(held_version=request.held_version))
    return request


def test_the_set_travels_only_when_the_dispatcher_lacks_it() -> None:
    held: dict[str, list[int]] = {}
    report = HeldReport(lambda: held)
    assert beat(report) == pb.WorkerHeartbeatRequest()  # nothing held: nothing sent
    held["7"] = [5, 1, 2, 3, 9]
    first = beat(report)
    assert (first.held_version, first.held_report) == (1, True)
    assert [(h.dataset_id, list(h.ranges)) for h in first.held] == [("7", [1, 4, 5, 6, 9, 10])]
    unchanged = beat(report)
    assert (unchanged.held_version, unchanged.held_report, len(unchanged.held)) == (1, False, 0)
    # A restarted dispatcher has version 0: the set travels again at the next beat.
    report.acknowledge(pb.WorkerHeartbeatResponse(held_version=0))
    again = beat(report, acknowledged=False)
    assert (again.held_version, again.held_report, len(again.held)) == (1, True, 1)
    sent: list[pb.WorkerHeartbeatRequest] = []

    def restarted(request: pb.WorkerHeartbeatRequest) -> pb.WorkerHeartbeatResponse:
        sent.append(pb.WorkerHeartbeatRequest.FromString(request.SerializeToString()))
        return pb.WorkerHeartbeatResponse(held_version=request.held_version
                                          if request.held_report else 0)

    report.acknowledge(pb.WorkerHeartbeatResponse(held_version=1))  # it had it, then
    report.exchange(pb.WorkerHeartbeatRequest(), restarted)  # restarted: resent at once
    assert [(r.held_version, r.held_report) for r in sent] == [(1, False), (1, True)]
    held["7"] = [1]  # evicted: the smaller set, a new version
    assert (beat(report).held_version, report.changed()) == (2, False)


def test_ranges_round_trip_and_bad_input_is_refused() -> None:
    assert range_indices(index_ranges([4, 0, 1, 2, 8, 8]), limit=6) == (0, 1, 2, 4)
    with pytest.raises(ValueError, match="-1"):
        index_ranges([3, -1])
    with pytest.raises(ValueError, match="odd length 3"):
        range_indices([0, 1, 2], limit=5)


def test_a_tasks_first_ask_flushes_a_changed_set_once() -> None:
    held = {"7": [0]}
    client = DispatcherClient(WorkerConfig("127.0.0.1:1"), threading.Event(),
                              cached_splits=lambda: held)
    flushed: list[int] = []

    def flush() -> None:  # what the server's heartbeat does with the reply
        request = pb.WorkerHeartbeatRequest()
        client._held.fill(request)  # noqa: SLF001
        client._held.acknowledge(pb.WorkerHeartbeatResponse(  # noqa: SLF001
            held_version=request.held_version))
        flushed.append(request.held_version)

    client.flush = flush
    client._first_ask(4000, 0)  # noqa: SLF001
    client._first_ask(4000, 0)  # noqa: SLF001 - asked before: no heartbeat
    client._first_ask(4001, 0)  # noqa: SLF001 - unchanged since: none either
    held["7"] = [0, 1]
    client._first_ask(4000, 0)  # noqa: SLF001 - this task asked already
    client._first_ask(4000, 1)  # noqa: SLF001 - its next repetition: the change goes first
    assert flushed == [1, 2]
