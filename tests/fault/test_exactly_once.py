"""The dispatcher's fault handling with no servers: requeue with delivered offsets, settling,
the wait for clients' reports, job GC that is journaled and keeps the DYNAMIC cursor."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dispatcher.builders import (
    Clock,
    client_request,
    get_split,
    get_split_aborting,
    heartbeat_worker,
    report,
    start_epoch,
    task_of,
    timed_service,
)
from torch_dataservice.proto import dispatcher_pb2

pb = dispatcher_pb2


def test_a_dead_workers_split_is_handed_again_without_what_clients_received() -> None:
    clock = Clock()
    service = timed_service(clock)
    iteration_id, client = start_epoch(service)
    a, b = task_of(service, iteration_id, "a:1"), task_of(service, iteration_id, "b:1")
    assert get_split(service, iteration_id, a).split_index == 0
    assert get_split(service, iteration_id, b).split_index == 1
    report(service, client, 0, [0, 1, 2])
    # Split 1 is settled: b produced 2 elements and both were received.
    report(service, client, 1, [0, 1])
    assert get_split(service, iteration_id, b, finished=(0, 1, 2)).split_index == 2
    assert service.state.task(b).splits == {(0, 2)}
    clock.now = 1.5
    heartbeat_worker(service, "b:1")  # b stays alive, a goes silent
    service.ClientHeartbeat(client_request(service, client), None)
    service.check_liveness()
    assert [s.index for s in service.state.iteration(iteration_id).requeued] == [0]
    # Not handed again until the client reported what it got since the requeue.
    assert get_split(service, iteration_id, b).split_index == 3
    with pytest.raises(Exception, match="UNAVAILABLE|wait for clients"):
        get_split_aborting(service, iteration_id, b)
    report(service, client, 0, [3])  # arrived late from a before it died
    response = get_split(service, iteration_id, b)
    assert (response.split_index, list(response.skip_offsets)) == (0, [0, 1, 2, 3])
    assert get_split(service, iteration_id, b).end_of_splits
    service.close()


def test_a_task_is_created_when_no_live_task_can_take_requeued_splits() -> None:
    clock = Clock()
    service = timed_service(clock)
    iteration_id, client = start_epoch(service)
    a, b = task_of(service, iteration_id, "a:1"), task_of(service, iteration_id, "b:1")
    get_split(service, iteration_id, a)
    service.WorkerUpdate(pb.WorkerUpdateRequest(worker_address="b:1", completed_tasks=[b]),
                         None)
    heartbeat_worker(service, "a:1", uid=2)  # a restarted: its old task's split is requeued
    iteration = service.state.iteration(iteration_id)
    assert not service.state.is_finished(iteration)
    new_on_b = task_of(service, iteration_id, "b:1")
    assert new_on_b != b
    report(service, client, 0, [])
    assert get_split(service, iteration_id, new_on_b).split_index == 0
    service.close()


def test_job_gc_is_journaled_and_keeps_the_split_cursor(tmp_path: Path) -> None:
    clock = Clock()
    service = timed_service(clock, tmp_path, job_gc_timeout_ms=1000)
    iteration_id, client = start_epoch(service, workers=("a:1",))
    a = task_of(service, iteration_id, "a:1")
    assert get_split(service, iteration_id, a).split_index == 0
    assert get_split(service, iteration_id, a, finished=(0, 0, 5)).split_index == 1
    report(service, client, 0, range(5))
    report(service, client, 1, [0, 1])  # split 1 was being read when the trainer vanished
    clock.now = 1.5
    heartbeat_worker(service, "a:1", tasks=(a,))
    service.check_liveness()  # the client is released
    clock.now = 3.0
    heartbeat_worker(service, "a:1", tasks=(a,))
    service.check_liveness()  # the iteration is collected
    assert service.state.iteration(iteration_id).garbage_collected
    reply = heartbeat_worker(service, "a:1", tasks=(a,))
    assert list(reply.tasks_to_delete) == [a]  # and the worker drops the task
    service.close()

    restarted = timed_service(clock, tmp_path, job_gc_timeout_ms=1000)
    assert restarted.state.iteration(iteration_id).garbage_collected  # not resurrected
    job_id = restarted.state.iteration(iteration_id).job_id
    reply = restarted.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job_id), None)
    assert reply.iteration_id != iteration_id
    recreated = restarted.state.iteration(reply.iteration_id)
    assert (recreated.cursor_repetition, recreated.cursor_index) == (0, 2)
    task = task_of(restarted, reply.iteration_id, "a:1")
    report(restarted, reply.client_id, 1, [])
    response = get_split(restarted, reply.iteration_id, task)
    assert (response.split_index, list(response.skip_offsets)) == (1, [0, 1])
    assert get_split(restarted, reply.iteration_id, task).split_index == 2
    restarted.close()
