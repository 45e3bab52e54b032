"""The dispatcher's decision when a coordinated job loses a worker, with no servers: lost tasks
leave at one round for every consumer, picked once all are stopped, journaled."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dispatcher.builders import Clock, make_service
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.proto import common_pb2, dispatcher_pb2
from torch_dataservice.rpc import RECONNECT_WITHIN_S

pb = dispatcher_pb2
pytestmark = pytest.mark.timeout(30)


def start_job(service: DispatcherService, workers=("a:1", "b:1", "c:1"),
              consumers: int = 2) -> tuple[int, list[int], list[int]]:
    """A coordinated job on `workers`; returns (iteration, task ids, client ids)."""
    for address in workers:
        service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(worker_address=address, worker_uid=1),
                                None)
    dataset_id = service.GetOrRegisterDataset(pb.GetOrRegisterDatasetRequest(
        dataset=common_pb2.DatasetDef(pipeline=b"p", fingerprint="f")), None).dataset_id
    job = service.GetOrCreateJob(pb.GetOrCreateJobRequest(config=common_pb2.JobConfig(
        dataset_id=dataset_id, job_name="rounds", num_consumers=consumers)), None)
    clients = [service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job.job_id),
                                            None) for _ in range(consumers)]
    iteration_id = clients[0].iteration_id
    tasks = sorted(service.state.iteration(iteration_id).task_ids)
    return iteration_id, tasks, [c.client_id for c in clients]


def beat(service: DispatcherService, client_id: int, consumer: int,
         blocked_round: int | None = None, seen: int = 0,
         done: bool = False) -> pb.ClientHeartbeatResponse:
    request = pb.ClientHeartbeatRequest(client_id=client_id, consumer_index=consumer,
                                        removals_seen=seen, consumer_done=done)
    if blocked_round is not None:
        request.blocked_round = blocked_round
    return service.ClientHeartbeat(request, None)


def lose(service: DispatcherService, clock: Clock, address: str,
         alive: tuple[str, ...]) -> None:
    clock.now += 2.0
    for other in alive:
        service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(worker_address=other, worker_uid=1),
                                None)
    service.check_liveness()
    assert address not in service.state.workers


def test_lost_tasks_leave_at_the_highest_blocked_round_once_all_consumers_stop() -> None:
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000)
    iteration_id, tasks, clients = start_job(service)
    lose(service, clock, "b:1", alive=("a:1", "c:1"))
    reply = beat(service, clients[0], 0)
    assert [t.task_id for t in reply.tasks if t.lost] == [tasks[1]]
    assert not reply.removals
    # Consumer 0 stops at round 7, consumer 1 (behind) is still reading: no decision yet.
    assert not beat(service, clients[0], 0, blocked_round=7).removals
    assert not beat(service, clients[1], 1).removals
    # Consumer 1 stops at round 4: the task leaves at 7, for both.
    reply = beat(service, clients[1], 1, blocked_round=4)
    assert [(r.round, list(r.task_ids)) for r in reply.removals] == [(7, [tasks[1]])]
    assert service.state.iteration(iteration_id).removals == [(7, (tasks[1],))]
    assert [(r.round, list(r.task_ids)) for r in beat(service, clients[0], 0).removals] == [
        (7, [tasks[1]])]


def test_a_report_made_before_the_last_removal_is_not_counted() -> None:
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000)
    iteration_id, tasks, clients = start_job(service)
    lose(service, clock, "b:1", alive=("a:1", "c:1"))
    beat(service, clients[0], 0, blocked_round=5)
    beat(service, clients[1], 1, blocked_round=5)
    assert service.state.iteration(iteration_id).removals == [(5, (tasks[1],))]
    lose(service, clock, "c:1", alive=("a:1",))
    # Consumer 1 has not heard of the first removal yet: its stale report does not count.
    beat(service, clients[0], 0, blocked_round=9, seen=1)
    assert len(beat(service, clients[1], 1, blocked_round=5, seen=0).removals) == 1
    reply = beat(service, clients[1], 1, blocked_round=8, seen=1)
    assert [(r.round, list(r.task_ids)) for r in reply.removals] == [
        (5, [tasks[1]]), (9, [tasks[2]])]


def test_removal_decisions_survive_a_dispatcher_restart(tmp_path: Path) -> None:
    clock = Clock()
    service = make_service(clock, tmp_path, worker_timeout_ms=1000)
    iteration_id, tasks, clients = start_job(service)
    lose(service, clock, "b:1", alive=("a:1", "c:1"))
    beat(service, clients[0], 0, blocked_round=3)
    beat(service, clients[1], 1, blocked_round=6)
    service.close()
    restarted = make_service(Clock(), tmp_path, worker_timeout_ms=1000)
    assert restarted.state.iteration(iteration_id).removals == [(6, (tasks[1],))]
    reply = beat(restarted, clients[0], 0)
    assert [(r.round, list(r.task_ids)) for r in reply.removals] == [(6, [tasks[1]])]


def test_a_consumer_that_read_its_last_round_does_not_hold_the_others() -> None:
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000)
    iteration_id, tasks, clients = start_job(service)
    # Consumer 1 ended at round 9 (it read the lost task's rounds before the worker died).
    beat(service, clients[1], 1, blocked_round=9, done=True)
    service.ReleaseIterationClient(pb.ReleaseIterationClientRequest(client_id=clients[1]), None)
    lose(service, clock, "b:1", alive=("a:1", "c:1"))
    reply = beat(service, clients[0], 0, blocked_round=4)
    assert [(r.round, list(r.task_ids)) for r in reply.removals] == [(9, [tasks[1]])]
    # It keeps counting for a later loss, whatever removals it had seen.
    lose(service, clock, "c:1", alive=("a:1",))
    reply = beat(service, clients[0], 0, blocked_round=9, seen=1)
    assert [(r.round, list(r.task_ids)) for r in reply.removals] == [
        (9, [tasks[1]]), (9, [tasks[2]])]


def test_a_task_that_ended_for_the_fastest_consumer_is_lost_with_its_worker() -> None:
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000)
    _, tasks, clients = start_job(service)
    # The worker served end of sequence to the fastest consumer: its task is finished, yet
    # slower consumers still need the rounds it holds.
    service.WorkerUpdate(pb.WorkerUpdateRequest(worker_address="b:1",
                                                completed_tasks=[tasks[1]]), None)
    assert not [t.task_id for t in beat(service, clients[0], 0).tasks if t.lost]
    lose(service, clock, "b:1", alive=("a:1", "c:1"))
    assert [t.task_id for t in beat(service, clients[0], 0).tasks if t.lost] == [tasks[1]]


def test_a_restarted_dispatcher_gives_live_workers_the_time_to_reconnect(tmp_path: Path) -> None:
    """A worker's channel reaches a restarted dispatcher up to RECONNECT_WITHIN_S late (gRPC's
    reconnect backoff). Declared dead at worker_timeout_ms after the restart, a live worker
    lost its task and joined again with a new one, which read its dataset again from the
    start in the same executor: the fault sequence's elements delivered twice."""
    service = make_service(Clock(), tmp_path, worker_timeout_ms=1000)
    _, tasks, clients = start_job(service)
    service.close()
    clock = Clock()
    restarted = make_service(clock, tmp_path, worker_timeout_ms=1000)
    clock.now = 1.0 + RECONNECT_WITHIN_S - 0.05  # past the timeout, not past a reconnect
    restarted.check_liveness()
    assert sorted(restarted.state.workers) == ["a:1", "b:1", "c:1"]
    for address in ("a:1", "c:1"):  # back; b:1 is gone for good
        restarted.WorkerHeartbeat(pb.WorkerHeartbeatRequest(worker_address=address,
                                                            worker_uid=1), None)
    assert not [t.task_id for t in beat(restarted, clients[0], 0).tasks if t.lost]
    clock.now += 0.1
    restarted.check_liveness()
    assert sorted(restarted.state.workers) == ["a:1", "c:1"]
    assert [t.task_id for t in beat(restarted, clients[0], 0).tasks if t.lost] == [tasks[1]]
