"""Liveness and garbage collection: who is gone and what is collected.

Decisions that return `Update`s (or what to act on) and never change the state; three forget
soft-state entries as they decide: `idle_iterations`, `expired_ephemerals`, `unread_ephemeral`.

Workers silent for worker_timeout_ms are removed (their splits requeued); clients silent for
job_gc_timeout_ms are released; iterations without clients for job_gc_timeout_ms are
collected; an ephemeral dataset nobody reads any more, or nobody read in time, is removed.
"""

from __future__ import annotations

from torch_dataservice.dispatcher import splits
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import DispatcherState, Iteration, Worker
from torch_dataservice.proto import dispatcher_pb2

Update = dispatcher_pb2.Update


def silent_workers(state: DispatcherState, soft: SoftState, now: float,
                   timeout_s: float) -> list[str]:
    return [address for address, seen in soft.worker_seen.items()
            if now - seen > timeout_s and address in state.workers]


def silent_clients(state: DispatcherState, soft: SoftState, now: float,
                   timeout_s: float) -> list[int]:
    return [client_id for client_id, seen in soft.client_seen.items()
            if now - seen > timeout_s and client_id in state.clients]


def newly_silent_clients(state: DispatcherState, soft: SoftState, now: float,
                         timeout_s: float) -> list[int]:
    """Clients of exactly-once iterations silent for `timeout_s` (worker_timeout_ms): a
    trainer that died. Not released (a paused trainer may come back), but what they did not
    acknowledge is handed to the others (dispatcher/splits.py requeue_unacknowledged)."""
    return [client_id for client_id, seen in soft.client_seen.items()
            if now - seen > timeout_s and client_id not in soft.silent_clients
            and client_id in state.clients
            and splits.is_exactly_once(state, state.iteration_of_client(client_id))]


def idle_iterations(state: DispatcherState, soft: SoftState, now: float,
                    timeout_s: float) -> list[Iteration]:
    """Iterations idle longer than `timeout_s`; forgets idle times that no longer apply."""
    idle = []
    for iteration_id, since in list(soft.iteration_idle_since.items()):
        iteration = state.iterations.get(iteration_id)
        if iteration is None or iteration.garbage_collected or iteration.client_ids:
            del soft.iteration_idle_since[iteration_id]
        elif now - since > timeout_s:
            idle.append(iteration)
    return idle


def leaves(worker: Worker | None, request: dispatcher_pb2.WorkerHeartbeatRequest) -> bool:
    """A drained worker says it leaves; only its own incarnation (uid) can remove it."""
    return request.leaving and worker is not None and worker.uid == request.worker_uid


def remove_worker(state: DispatcherState, address: str) -> list[Update]:
    """A worker left: its unsettled DYNAMIC splits go back first (dispatcher/splits.py).

    Not those of coordinated reads: their consumers report nothing they received, so no
    split of theirs is ever settled and the lost task would hand back every split it ever
    read, to be read again (by the same executor when a worker declared dead registers
    again). A lost worker's elements are lost with it there (docs/semantics.md)."""
    tasks = [t for t in state.worker_tasks(address)
             if splits.is_exactly_once(state, state.iteration(t.iteration_id))]
    return [*splits.requeue(tasks),
            Update(remove_worker=dispatcher_pb2.RemoveWorker(worker_address=address))]


def collect(state: DispatcherState, iteration: Iteration) -> list[Update]:
    """Garbage-collect an iteration. Its unsettled DYNAMIC splits are requeued first: the
    split cursor and they pass to the iteration that replaces it (same job and repetition),
    so a trainer resuming from a loader state continues where it stopped."""
    unfinished = [t for t in state.iteration_tasks(iteration) if not t.finished]
    return [*splits.requeue(unfinished),
            Update(garbage_collect_iteration=dispatcher_pb2.GarbageCollectIteration(
                iteration_id=iteration.iteration_id))]


def expired_ephemerals(soft: SoftState, now: float, gc_timeout_s: float) -> list[str]:
    """Ephemeral datasets whose registration was answered more than `gc_timeout_s` ago,
    forgotten here: each is looked at once (unread_ephemeral), and one an iteration reads
    goes when that iteration is collected. A registration no job ever read (junk, or a
    registrant that died) does not stay for ever."""
    expired = [d for d, answered in soft.ephemeral_reused.items()
               if now - answered >= gc_timeout_s]
    for dataset_id in expired:
        del soft.ephemeral_reused[dataset_id]
    return expired


def unread_ephemeral(state: DispatcherState, soft: SoftState, dataset_id: str, now: float,
                     gc_timeout_s: float) -> Update | None:
    """Remove an ephemeral dataset (DatasetDef.ephemeral) that no iteration reads any more,
    unless a registration was answered with it lately: its job is on the way. Forgets that
    registration (soft.ephemeral_reused) when it removes the dataset."""
    dataset = state.datasets.get(dataset_id)
    if dataset is None or not dataset.definition.ephemeral:
        return None
    reused = soft.ephemeral_reused.get(dataset_id)
    if reused is not None and now - reused < gc_timeout_s:
        return None
    if any(not other.garbage_collected
           and state.job(other.job_id).config.dataset_id == dataset_id
           for other in state.iterations.values()):
        return None
    soft.ephemeral_reused.pop(dataset_id, None)
    return Update(remove_dataset=dispatcher_pb2.RemoveDataset(dataset_id=dataset_id))
