"""A big fleet's bookkeeping with no servers: what one dead worker or one settled split costs
does not grow with the iteration's readers and tasks, and the splits a silent reader missed
are still told to it (and only to it). Costs are the test thread's CPU time (the service runs
in it): the process's would count what other tests left running in this process too. The
garbage collector is off while a cost is measured (as timeit does): a full collection scans
the whole process's heap, other tests' leftovers included, and lands in whichever run it
happens to (0.15 s once in a full suite run)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

import pytest

from tests.dispatcher.builders import (
    Clock,
    client_request,
    heartbeat_worker,
    make_service,
    start_epoch,
    task_of,
)
from torch_dataservice.proto import dispatcher_pb2

pb = dispatcher_pb2


@contextlib.contextmanager
def _measured(costs: list[float]) -> Iterator[None]:
    """Append the CPU seconds this thread spends in the block, collector off, to `costs`."""
    gc.collect()
    gc.disable()
    began = time.thread_time()
    try:
        yield
    finally:
        costs.append(time.thread_time() - began)
        gc.enable()


def _join(service, iteration_id: int, clients: int) -> list[int]:
    job_id = service.state.iteration(iteration_id).job_id
    return [service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job_id),
                                         None).client_id for _ in range(clients)]


def _take(service, iteration_id: int, task_id: int, splits: int) -> list[tuple[int, int]]:
    taken = []
    while len(taken) < splits:
        reply = service.GetSplit(pb.GetSplitRequest(
            iteration_id=iteration_id, task_id=task_id, request_id=len(taken) + 1,
            max_splits=64), None)
        taken += [(s.repetition, s.split_index) for s in (reply, *reply.following)]
    return taken


def _requeue_cpu_s(workers: int, readers: int) -> tuple[float, float]:
    """CPU seconds to declare dead a worker holding 256 splits, and then to hand them to
    another task, with `workers` tasks and `readers` readers on the iteration."""
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000, heartbeat_budget_rps=10**9)
    addresses = [f"worker-{i}:1" for i in range(workers)]
    iteration_id, first = start_epoch(service, workers=addresses, num_splits=10**6)
    client_ids = [first, *_join(service, iteration_id, readers - 1)]
    _take(service, iteration_id, task_of(service, iteration_id, addresses[0]), 256)
    clock.now += 2.0
    for address in addresses[1:]:
        heartbeat_worker(service, address)

    def beat() -> None:  # every reader alive, holding the task list already
        version = service.ClientHeartbeat(pb.ClientHeartbeatRequest(client_id=first),
                                          None).tasks_version
        for client_id in client_ids:  # fencing the lost tasks, as a live reader does
            request = client_request(service, client_id)
            request.known_tasks_version = version
            service.ClientHeartbeat(request, None)

    beat()
    costs: list[float] = []
    with _measured(costs):
        service.check_liveness()
    assert addresses[0] not in service.state.workers
    assert len(service.state.iteration(iteration_id).requeued) == 256
    beat()  # the readers' reports are in: the requeued splits may go
    with _measured(costs):
        handed = _take(service, iteration_id, task_of(service, iteration_id, addresses[1]), 256)
    assert not service.state.iteration(iteration_id).requeued and len(set(handed)) == 256
    service.close()
    requeue, rehand = costs
    return requeue, rehand


@pytest.mark.timeout(120)
def test_a_dead_workers_requeue_costs_the_same_with_4096_readers_and_1000_tasks() -> None:
    small = [min(costs) for costs in zip(*(_requeue_cpu_s(4, 4) for _ in range(3)),
                                         strict=True)]
    # The least of two runs: one may take a collection of the big fleet's heap (0.18 s once).
    big = [min(costs) for costs in zip(*(_requeue_cpu_s(1000, 4096) for _ in range(2)),
                                       strict=True)]
    # Per reader and per task, the requeue cost 256 x 4,096 set insertions and 256 x 1,000
    # removals, and handing each requeued split again asked all 4,096 readers and 1,000 tasks
    # whether it was ready: 10 to 100 times the small fleet's.
    assert big[0] < 5 * small[0] + 0.01, (small, big)
    assert big[1] < 5 * small[1] + 0.01, (small, big)


def _waiting_hand_out_cpu_s(workers: int, readers: int) -> float:
    """CPU seconds to hand out 2,000 splits while a dead worker's splits wait for the last
    reader to report (the others all did)."""
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000, heartbeat_budget_rps=10**9)
    addresses = [f"worker-{i}:1" for i in range(workers)]
    iteration_id, first = start_epoch(service, workers=addresses, num_splits=10**6)
    client_ids = [first, *_join(service, iteration_id, readers - 1)]
    lost = _take(service, iteration_id, task_of(service, iteration_id, addresses[0]), 4)
    clock.now += 2.0
    for address in addresses[1:]:
        heartbeat_worker(service, address)
    for client_id in client_ids:  # every reader alive
        service.ClientHeartbeat(client_request(service, client_id), None)
    service.check_liveness()  # addresses[0] is dead: its splits wait
    for client_id in client_ids[:-1]:  # every reader but the last reports since
        service.ClientHeartbeat(client_request(service, client_id), None)
    costs: list[float] = []
    with _measured(costs):
        _take(service, iteration_id, task_of(service, iteration_id, addresses[1]), 2000)
    cost = costs[0]
    assert len(service.state.iteration(iteration_id).requeued) == len(lost)  # still waiting
    service.ClientHeartbeat(client_request(service, client_ids[-1]), None)
    again = _take(service, iteration_id, task_of(service, iteration_id, addresses[1]), 1)
    assert set(lost) <= set(again) and not service.state.iteration(iteration_id).requeued
    service.close()
    return cost


@pytest.mark.timeout(120)
def test_splits_handed_while_a_requeue_waits_cost_the_same_with_1024_readers() -> None:
    small = min(_waiting_hand_out_cpu_s(4, 4) for _ in range(3))
    big = _waiting_hand_out_cpu_s(1000, 1024)
    # Each split handed asked every task whether it was lost and every reader whether it had
    # reported: 1,024 + 1,000 checks per split, some 20 times the small fleet's cost.
    assert big < 3 * small + 0.01, (small, big)


def test_a_silent_reader_learns_the_splits_requeued_meanwhile_and_a_new_one_does_not() -> None:
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000)
    iteration_id, silent = start_epoch(service, workers=("dies:1", "lives:1"), num_splits=100)
    live = _join(service, iteration_id, 1)[0]
    keys = _take(service, iteration_id, task_of(service, iteration_id, "dies:1"), 3)
    for _ in range(3):  # "dies:1" stops; `live` reports, `silent` does not
        clock.now += 0.5
        heartbeat_worker(service, "lives:1")
        service.ClientHeartbeat(client_request(service, live), None)
        service.check_liveness()
    assert "dies:1" not in service.state.workers
    late = _join(service, iteration_id, 1)[0]  # joined after the requeue
    clock.now += 0.5
    assert service.ClientHeartbeat(client_request(service, late), None).handed_again == []
    reply = service.ClientHeartbeat(client_request(service, silent), None)
    assert reply.declared_silent
    assert sorted((k.repetition, k.index) for k in reply.handed_again) == sorted(keys)
    again = service.ClientHeartbeat(client_request(service, silent), None)  # told once
    assert not again.declared_silent and list(again.handed_again) == []
    service.close()
