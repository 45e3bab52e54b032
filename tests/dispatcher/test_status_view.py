"""The cluster status is copied under the dispatcher's lock and built after it is let go
(dispatcher/status.py): at 1,000 workers and 4,096 readers building it took 50-125 ms, which
every request waited through while a metrics scrape held the lock."""

from __future__ import annotations

import threading

import pytest

from tests.dispatcher.builders import Clock, make_service, start_epoch
from torch_dataservice.dispatcher import status
from torch_dataservice.proto import dispatcher_pb2, status_pb2

pb = dispatcher_pb2


def _report(service, clock: Clock, addresses, clients, batches: int) -> None:
    """Every worker and reader heartbeats its totals, a second after the last time."""
    clock.now += 1.0
    for i, address in enumerate(addresses):
        service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(
            worker_address=address, worker_uid=1, load=status_pb2.WorkerLoad(
                elements_sent=10 * batches, elements_produced=10 * batches,
                busy_seconds=0.1 * batches * (i + 1), processes=1)), None)
    for client_id in clients:
        service.ClientHeartbeat(pb.ClientHeartbeatRequest(
            client_id=client_id, load=status_pb2.ClientLoad(
                rank=client_id % 4, batches=batches, wait_seconds=0.01 * batches,
                elements=10 * batches)), None)


def _fleet():
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=60_000, job_gc_timeout_ms=60_000)
    addresses = ("a:1", "b:1", "c:1")
    iteration_id, first = start_epoch(service, workers=addresses, num_splits=100)
    job_id = service.state.iteration(iteration_id).job_id
    clients = [first] + [service.GetOrCreateIteration(
        pb.GetOrCreateIterationRequest(job_id=job_id), None).client_id for _ in range(3)]
    _report(service, clock, addresses, clients, 10)
    _report(service, clock, addresses, clients, 30)
    return clock, service, addresses, clients, job_id


@pytest.mark.timeout(30)
def test_the_status_is_what_the_dispatcher_held_when_its_inputs_were_copied() -> None:
    clock, service, addresses, clients, job_id = _fleet()
    before = service.cluster_status()
    assert before.iterations[0].optimal_workers > 0 and before.clients[0].batches_per_s > 0
    view = status.gather(service.state, service._soft, service._observe, clock.now)  # noqa: SLF001

    # Everything moves on before the reply is built: new totals, a new reader, a worker gone.
    _report(service, clock, addresses, clients, 90)
    service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job_id), None)
    service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(worker_address="d:1", worker_uid=1),
                            None)
    after = service.cluster_status()
    assert after != before  # the changes show in a status gathered now

    built = status.build(view, worker_timeout_s=60.0)
    built.load.CopyFrom(before.load)  # filled by the service from its cadence, apart
    assert built == before


@pytest.mark.timeout(30)
def test_the_reply_is_built_after_the_lock_is_let_go(monkeypatch) -> None:
    _, service, *_ = _fleet()
    lock = service._lock  # noqa: SLF001 - what every request waits for

    def free_elsewhere() -> bool:
        """Whether another thread could take the dispatcher's lock now."""
        took: list[bool] = []

        def take() -> None:
            took.append(lock.acquire(timeout=0))
            if took[0]:
                lock.release()

        thread = threading.Thread(target=take)
        thread.start()
        thread.join(timeout=10)
        return took == [True]

    seen: dict[str, bool] = {}
    gather, build = status.gather, status.build

    def gathering(*args):
        seen["gather"] = free_elsewhere()
        return gather(*args)

    def building(*args):
        seen["build"] = free_elsewhere()
        return build(*args)

    monkeypatch.setattr(status, "gather", gathering)
    monkeypatch.setattr(status, "build", building)
    reply = service.cluster_status()
    assert len(reply.workers) == 3 and len(reply.clients) == 4
    assert seen == {"gather": False, "build": True}
