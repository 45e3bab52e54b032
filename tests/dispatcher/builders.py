"""Builders shared by the dispatcher's tests that run no servers: journal Updates, states built
from them, a DispatcherService driven by hand (a settable clock, a context whose abort raises)
and the requests a worker or a reader would send it, and a journal written from a list of
updates."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher import snapshot
from torch_dataservice.dispatcher.file_journal import FileJournal
from torch_dataservice.dispatcher.journal import NullJournal
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.dispatcher.state import DispatcherState
from torch_dataservice.dispatcher.task_push import Push, TaskPusher
from torch_dataservice.proto import common_pb2, dispatcher_pb2

pb = dispatcher_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Context:
    """What a handler's `context.abort(code, details)` does, as an exception to assert on."""

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


class KeptPushes(TaskPusher):
    """Task pushes kept in a list, never sent: the workers of these tests are addresses only
    (a thousand of them, which nothing must try to connect to)."""

    def __init__(self) -> None:
        self.pushes: list[Push] = []

    def push(self, pushes: Iterable[Push]) -> None:
        self.pushes.extend(pushes)

    def close(self) -> None:
        pass


def make_service(clock: Clock, work_dir: Path | None = None,
                 **config: Any) -> DispatcherService:
    """A service with a journal in `work_dir` (fault-tolerant mode), or none."""
    journal = FileJournal(work_dir) if work_dir else NullJournal()
    return DispatcherService(DispatcherConfig(
        fault_tolerant_mode=work_dir is not None, work_dir=str(work_dir) if work_dir else None,
        **config), journal, clock=clock, pusher=KeptPushes())


def write_journal(work_dir: Path, updates: list, compact_every: int,
                  log_share: float = 0.0) -> tuple[DispatcherState, int]:
    """Journal and apply `updates` as the service does, compacting when due (by default
    every `compact_every` records, whatever the snapshot's size); returns the state and how
    many compactions happened (the journal is closed)."""
    journal = FileJournal(work_dir, compact_every=compact_every, log_share=log_share)
    state = DispatcherState()
    compactions = 0
    for update in updates:
        journal.append(update)
        state.apply(update)
        compactions += journal.maybe_compact(state)
    journal.sync()
    journal.close()
    return state, compactions


def client_request(service: DispatcherService, client_id: int) -> Any:
    """A heartbeat as a live reader sends it: fencing every lost task of its iteration (a
    reader fences what the previous reply listed as lost; see dispatcher/splits.py)."""
    from torch_dataservice.dispatcher import splits

    iteration = service.state.iteration_of_client(client_id)
    return dispatcher_pb2.ClientHeartbeatRequest(
        client_id=client_id, fenced_tasks=sorted(splits.lost_tasks(service.state, iteration)))


# ---------------------------------------------------------------------- update builders
Update = dispatcher_pb2.Update
DYNAMIC = 1


def register_dataset(dataset_id: str, fingerprint: str = "", num_splits: int = 3) -> Update:
    definition = common_pb2.DatasetDef(pipeline=b"p", fingerprint=fingerprint, splittable=True,
                                       num_splits=num_splits)
    return Update(register_dataset=dispatcher_pb2.RegisterDataset(
        dataset_id=dataset_id, dataset=definition))


def register_worker(address: str, uid: int = 7, index: int = -1) -> Update:
    return Update(register_worker=dispatcher_pb2.RegisterWorker(
        worker_address=address, worker_uid=uid, worker_index=index, host_id="h",
        process_id="h:1"))


def remove_worker(address: str) -> Update:
    return Update(remove_worker=dispatcher_pb2.RemoveWorker(worker_address=address))


def create_job(job_id: int, name: str, dataset_id: str = "1000", policy: int = DYNAMIC) -> Update:
    config = common_pb2.JobConfig(dataset_id=dataset_id, job_name=name, sharding_policy=policy,
                                  target_workers="AUTO")
    return Update(create_job=dispatcher_pb2.CreateJob(job_id=job_id, config=config))


def create_iteration(iteration_id: int, job_id: int, repetition: int = 0) -> Update:
    return Update(create_iteration=dispatcher_pb2.CreateIteration(
        iteration_id=iteration_id, job_id=job_id, repetition=repetition))


def create_task(task_id: int, iteration_id: int, address: str) -> Update:
    return Update(create_task=dispatcher_pb2.CreateTask(
        task_id=task_id, iteration_id=iteration_id, worker_address=address))


def finish_task(task_id: int) -> Update:
    return Update(finish_task=dispatcher_pb2.FinishTask(task_id=task_id))


def produce_split(iteration_id: int, repetition: int, index: int, task_id: int = 0,
                  requeued: bool = False) -> Update:
    return Update(produce_split=dispatcher_pb2.ProduceSplit(
        iteration_id=iteration_id, repetition=repetition, split_index=index, task_id=task_id,
        requeued=requeued))


def requeue_split(iteration_id: int, repetition: int, index: int,
                  delivered: tuple[int, ...] = ()) -> Update:
    return Update(requeue_split=dispatcher_pb2.RequeueSplit(
        iteration_id=iteration_id, split=common_pb2.SplitKey(repetition=repetition, index=index),
        delivered_offsets=delivered))


def acquire_client(client_id: int, iteration_id: int) -> Update:
    return Update(acquire_client=dispatcher_pb2.AcquireClient(
        client_id=client_id, iteration_id=iteration_id))


def release_client(client_id: int) -> Update:
    return Update(release_client=dispatcher_pb2.ReleaseClient(client_id=client_id))


def garbage_collect(iteration_id: int) -> Update:
    return Update(garbage_collect_iteration=dispatcher_pb2.GarbageCollectIteration(
        iteration_id=iteration_id))


def build(*updates: Update) -> DispatcherState:
    state = DispatcherState()
    for update in updates:
        snapshot.apply(state, update)  # a replayed journal may start with a snapshot record
    return state


def one_iteration() -> list[Update]:
    """A dataset, two workers, a DYNAMIC job, its first iteration with a task on each worker."""
    return [
        register_dataset("1000", fingerprint="fp"),
        register_worker("w0:1"),
        register_worker("w1:1"),
        create_job(5000, "job"),
        create_iteration(2000, 5000),
        create_task(4000, 2000, "w0:1"),
        create_task(4001, 2000, "w1:1"),
        acquire_client(3000, 2000),
    ]


def history() -> list[Update]:
    return [
        *one_iteration(),
        register_dataset("named", fingerprint="other"),
        produce_split(2000, 0, 0, task_id=4000),
        produce_split(2000, 0, 1, task_id=4001),
        requeue_split(2000, 0, 1, delivered=(0,)),
        remove_worker("w1:1"),
        produce_split(2000, 0, 1, task_id=4000, requeued=True),
        produce_split(2000, 0, 2, task_id=4000),
        produce_split(2000, 0, -1, task_id=4000),
        finish_task(4000),
        create_iteration(2001, 5000, repetition=1),
        create_task(4002, 2001, "w0:1"),
        acquire_client(3001, 2001),
        release_client(3000),
        garbage_collect(2000),
        register_worker("w1:1", uid=8),
        create_job(5001, "other-job", dataset_id="named", policy=0),
    ]


# ---------------------------------------------------------------------- a service driven by hand
def replayed(work_dir: Path) -> list[Update]:
    """The journal's records (a request's updates are one `batch` record)."""
    journal = FileJournal(work_dir)
    try:
        return list(journal.replay())
    finally:
        journal.close()


def updates_of(record: Update) -> list[Update]:
    """The updates a journal record holds (a request's several updates are one record)."""
    return list(record.batch.updates) if record.HasField("batch") else [record]


def kinds_of(record: Update) -> list[str | None]:
    return [u.WhichOneof("kind") for u in updates_of(record)]


def replayed_updates(work_dir: Path) -> list[Update]:
    """Every update the journal holds, in order, batches opened."""
    return [u for record in replayed(work_dir) for u in updates_of(record)]


def register_epoch(service: DispatcherService) -> tuple[int, int]:
    dataset = common_pb2.DatasetDef(pipeline=b"p", splittable=True, num_splits=4,
                                    fingerprint="fp")
    dataset_id = service.GetOrRegisterDataset(
        dispatcher_pb2.GetOrRegisterDatasetRequest(dataset=dataset), None).dataset_id
    service.WorkerHeartbeat(dispatcher_pb2.WorkerHeartbeatRequest(
        worker_address="w:1", worker_uid=7), None)
    job = service.GetOrCreateJob(dispatcher_pb2.GetOrCreateJobRequest(
        config=common_pb2.JobConfig(dataset_id=dataset_id, job_name="j", sharding_policy=1)),
        None)
    iteration = service.GetOrCreateIteration(dispatcher_pb2.GetOrCreateIterationRequest(
        job_id=job.job_id), None)
    (task,) = service.state.iteration(iteration.iteration_id).task_ids
    return iteration.iteration_id, task


def timed_service(clock: Clock, work_dir: Path | None = None, job_gc_timeout_ms: int = 100_000
                  ) -> DispatcherService:
    """A service whose workers time out after a second of `clock` without a heartbeat."""
    return make_service(clock, work_dir, worker_timeout_ms=1000,
                        job_gc_timeout_ms=job_gc_timeout_ms)


def heartbeat_worker(service: DispatcherService, address: str, uid: int = 1,
                     tasks: tuple[int, ...] = ()) -> pb.WorkerHeartbeatResponse:
    return service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(
        worker_address=address, worker_uid=uid, current_tasks=tasks), None)


def start_epoch(service: DispatcherService, workers=("a:1", "b:1"), num_splits: int = 4,
                job_name: str = "j") -> tuple[int, int]:
    """A DYNAMIC job over `num_splits` splits (dataset "1000"), one iteration, one client;
    returns (iteration, client)."""
    for address in workers:
        heartbeat_worker(service, address)
    dataset = common_pb2.DatasetDef(pipeline=b"p", splittable=True, num_splits=num_splits,
                                    fingerprint="f")
    dataset_id = service.GetOrRegisterDataset(
        pb.GetOrRegisterDatasetRequest(dataset=dataset), None).dataset_id
    job = service.GetOrCreateJob(pb.GetOrCreateJobRequest(config=common_pb2.JobConfig(
        dataset_id=dataset_id, job_name=job_name, sharding_policy=1)), None)
    reply = service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job.job_id), None)
    return reply.iteration_id, reply.client_id


def task_of(service: DispatcherService, iteration_id: int, address: str) -> int:
    return next(t.task_id for t in service.state.iteration_tasks(
        service.state.iteration(iteration_id)) if t.worker_address == address and not t.finished)


def get_split(service: DispatcherService, iteration_id: int, task_id: int,
              finished: tuple[int, int, int] | None = None) -> pb.GetSplitResponse:
    request = pb.GetSplitRequest(iteration_id=iteration_id, task_id=task_id)
    if finished is not None:
        reported = request.finished_splits.add(elements=finished[2])
        reported.split.repetition, reported.split.index = finished[:2]
    return service.GetSplit(request, None)


def report(service: DispatcherService, client_id: int, split: int, offsets) -> None:
    request = client_request(service, client_id)
    request.received.add(split=common_pb2.SplitKey(repetition=0, index=split), offsets=offsets)
    service.ClientHeartbeat(request, None)


def get_split_aborting(service: DispatcherService, iteration_id: int, task_id: int) -> None:
    """GetSplit with a context whose abort raises (RuntimeError naming the status code)."""
    service.GetSplit(pb.GetSplitRequest(iteration_id=iteration_id, task_id=task_id), Context())
