"""The dispatcher's gRPC handlers: validate, decide, journal, apply, reply.

All decisions are taken under one lock, turned into `Update` records, journaled and applied
to `DispatcherState`. Soft state (heartbeat times, push threads) lives here and is re-learned
after a restart. Pushing new tasks to workers is best-effort and outside the lock: a worker
that misses a push gets the task in its next heartbeat reply. Every RPC syncs the journal
(group commit, see dispatcher/file_journal.py) after releasing the lock and before replying.

Visitation under DYNAMIC sharding: every element of an epoch is delivered exactly once, even
when workers die, the dispatcher restarts or an idle iteration is collected and recreated,
provided that
  - the pipeline is deterministic per split (the same split yields the same elements in the
    same order on any worker) and every output element comes from exactly one split through
    a synchronous chain: map, filter, flat_map (and take/skip-free element-wise steps);
    shuffle, batch, prefetch, parallel map and interleave read ahead or mix splits, so the
    (split, offset) tag of an element is not exact there and the guarantee falls back to
    tf.data service's at-most-once for the splits a dead worker held;
  - a worker declared dead (silent for worker_timeout_ms, or re-registered with a new uid) is
    really gone: a partitioned worker that still serves elements after its splits were handed
    again may deliver some twice (each client still drops what it already got);
  - every client of the iteration reports within worker_timeout_ms of a requeue (see below).
How: workers tag each element with (split repetition, split index, offset in the split) and
report each split's element count when they finish producing it; clients report the offsets
they received in their heartbeats; a split is settled when all its offsets were received.
When a worker leaves, each split it held and that is not settled goes back to its iteration
(RequeueSplit) with the offsets already delivered; it is handed again, once every client of
the iteration has heartbeated since (so their reports are in), to a live task, whose replica
skips those offsets. Any task takes it, whatever repetition it asks for (under `repeat()` every
live task may have moved past the split's repetition): the reply carries the split's own
repetition and the replica tags the elements with it, so the split keeps its key. If no
unfinished task of the iteration is left on a live worker (now, or when the last one
finishes), one is created on every live worker.
The wait for clients' reports is bounded by worker_timeout_ms after the requeue (and a client
silent that long is not waited for): after that the split is handed with the offsets known.
Trade-off: an element a slow client received from the dead worker and had not reported yet is
produced again; that client drops it (it remembers what it received), but in a job shared by
several clients another one may receive it too. Waiting longer (up to job_gc_timeout_ms, when a
silent client is released) would hold the whole epoch's end for a trainer that may be gone.
GetSplit is idempotent per (task, replica, request id), so a reply lost to a dispatcher crash
does not lose a split.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher.journal import Journal
from torch_dataservice.dispatcher.state import DispatcherState, Iteration, Task
from torch_dataservice.errors import NotReadyError
from torch_dataservice.policies import ShardingPolicy, policy_name
from torch_dataservice.proto import (
    common_pb2,
    dispatcher_pb2,
    dispatcher_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from torch_dataservice.rpc import channel_to, servicer_method

logger = logging.getLogger(__name__)

Update = dispatcher_pb2.Update
MAX_SPLITS_PER_REQUEST = 64  # GetSplit.max_splits is capped: one request holds the lock briefly
DONE = -1  # coordinated reads: a consumer's "removals seen" once it read its last round


def _durable(method: Callable[..., Any]) -> Callable[..., Any]:
    """Sync the journal after the handler released the lock, before the reply leaves."""

    @functools.wraps(method)
    def wrapper(self: DispatcherService, request: Any, context: Any) -> Any:
        response = method(self, request, context)
        self._journal.sync()
        return response

    return wrapper


class DispatcherService(dispatcher_pb2_grpc.DispatcherServiceServicer):
    def __init__(
        self,
        config: DispatcherConfig,
        journal: Journal,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._journal = journal
        self._clock = clock
        self._lock = threading.RLock()
        self._state = DispatcherState()
        for update in journal.replay():
            self._state.apply(update)
        now = clock()
        # Soft state: nothing is collected or declared dead because the dispatcher was down.
        self._worker_seen: dict[str, float] = {a: now for a in self._state.workers}
        self._client_seen: dict[int, float] = {c: now for c in self._state.clients}
        self._iteration_idle_since: dict[int, float] = {
            i: now for i, it in self._state.iterations.items()
            if not it.garbage_collected and not it.client_ids}
        # Exactly-once DYNAMIC: client heartbeats are numbered; a requeued split is handed
        # again only once every client of its iteration heartbeated after it was requeued.
        # After a restart, every requeued split waits for fresh heartbeats.
        self._heartbeats = 0
        self._client_heartbeat: dict[int, int] = {}
        self._requeued_at: dict[int, int] = {
            i: 0 for i, it in self._state.iterations.items() if it.requeued}
        self._requeued_time: dict[int, float] = dict.fromkeys(self._requeued_at, now)
        # Splits settled per iteration, (repetition, index, elements), for the heartbeat
        # replies of its clients (they compact what they remember); `_settled_base` is the
        # position of the first one kept, `_settled_sent` each client's position. Soft state:
        # after a restart clients only miss some compaction.
        self._settled: dict[int, list[tuple[int, int, int]]] = {}
        self._settled_base: dict[int, int] = {}
        self._settled_sent: dict[int, int] = {}
        # Coordinated reads: per iteration, consumer index -> (round it is blocked at on a lost
        # task, removals it knew then). Soft state: blocked consumers report in every heartbeat.
        self._blocked: dict[int, dict[int, tuple[int, int]]] = {}
        # Ephemeral datasets a registration was just answered with: not removed for a
        # job_gc_timeout_ms, so the registrant's job finds them (soft state).
        self._ephemeral_reused: dict[str, float] = {}
        self._pusher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="task-push")

    @property
    def state(self) -> DispatcherState:
        return self._state

    def close(self) -> None:
        self._pusher.shutdown(wait=False, cancel_futures=True)

    def _apply(self, update: Update) -> None:
        self._journal.append(update)  # durable before any reply: see _durable
        self._state.apply(update)
        self._journal.maybe_compact(self._state)

    # ------------------------------------------------------------------ datasets
    @servicer_method
    @_durable
    def GetOrRegisterDataset(self, request, context):
        definition = request.dataset
        with self._lock:
            for dependency in definition.depends_on:
                # A worker fetches these before the pipeline; one missing (e.g. a dispatcher
                # without a journal restarted) is NOT_FOUND, so the client registers it again.
                if dependency not in self._state.datasets:
                    raise LookupError(f"dataset {dependency!r}, which this pipeline refers to, "
                                      "is not registered")
            if request.dataset_id:
                if request.dataset_id not in self._state.datasets:
                    self._apply(Update(register_dataset=dispatcher_pb2.RegisterDataset(
                        dataset_id=request.dataset_id, dataset=definition)))
                return dispatcher_pb2.GetOrRegisterDatasetResponse(dataset_id=request.dataset_id)
            existing = self._state.dataset_by_fingerprint.get(definition.fingerprint)
            if existing is not None:
                if definition.ephemeral:  # it must outlive the job its registrant creates
                    self._ephemeral_reused[existing] = self._clock()
                return dispatcher_pb2.GetOrRegisterDatasetResponse(dataset_id=existing)
            dataset_id = str(self._state.peek_id("dataset"))
            while dataset_id in self._state.datasets:  # a user chose this id explicitly
                dataset_id = str(int(dataset_id) + 1)
            self._apply(Update(register_dataset=dispatcher_pb2.RegisterDataset(
                dataset_id=dataset_id, dataset=definition)))
            return dispatcher_pb2.GetOrRegisterDatasetResponse(dataset_id=dataset_id)

    @servicer_method
    @_durable
    def GetDatasetDef(self, request, context):
        with self._lock:
            dataset = self._state.dataset(request.dataset_id)
            return dispatcher_pb2.GetDatasetDefResponse(dataset=dataset.definition)

    # ------------------------------------------------------------------ jobs and iterations
    @servicer_method
    @_durable
    def GetOrCreateJob(self, request, context):
        config = request.config
        with self._lock:
            dataset = self._state.dataset(config.dataset_id)
            self._validate_job(config, dataset.definition)
            job_id = self._state.job_by_name.get(config.job_name) if config.job_name else None
            if job_id is not None:
                _check_matching_job(self._state.job(job_id).config, config)
                return dispatcher_pb2.GetOrCreateJobResponse(job_id=job_id)
            job_id = self._state.peek_id("job")
            self._apply(Update(create_job=dispatcher_pb2.CreateJob(job_id=job_id, config=config)))
            return dispatcher_pb2.GetOrCreateJobResponse(job_id=job_id)

    def _validate_job(self, config: common_pb2.JobConfig, dataset: common_pb2.DatasetDef) -> None:
        policy = config.sharding_policy
        if policy not in ShardingPolicy.__members__.values():
            raise ValueError(f"unknown sharding policy {policy}")
        policy = ShardingPolicy(policy)
        name = policy.name
        if dataset.shared_object:
            raise ValueError(f"dataset {config.dataset_id} is a shared object for other "
                             "pipelines to refer to, not a pipeline to read")
        if policy == ShardingPolicy.DYNAMIC and not dataset.splittable:
            raise ValueError(
                "sharding policy DYNAMIC needs a splittable source (range, from_items, "
                "list_files or from_dataset); this pipeline's source is not splittable"
            )
        if config.cross_trainer_cache and config.HasField("num_consumers"):
            raise ValueError("cross_trainer_cache cannot be combined with coordinated reads "
                             f"(num_consumers={config.num_consumers})")
        if config.HasField("num_consumers") and config.target_workers == "LOCAL":
            raise ValueError("coordinated reads (num_consumers) read every worker of the job: "
                             "target_workers='LOCAL' is not supported with them")
        if policy.is_static:
            if config.target_workers == "ANY":
                raise ValueError(
                    f"sharding policy {name} requires reading from local workers: use "
                    "target_workers='LOCAL' or 'AUTO' (which means LOCAL for static sharding), "
                    "got target_workers='ANY'")
            if not self._config.worker_addresses:
                raise ValueError(
                    f"sharding policy {name} needs a fixed worker list: start the dispatcher "
                    "with DispatcherConfig(worker_addresses=[...]) / --worker-addresses"
                )
            num_workers = len(self._config.worker_addresses)
            if policy == ShardingPolicy.FILE and not dataset.file_based:
                raise ValueError(
                    "sharding policy FILE needs a list_files source; use DATA or FILE_OR_DATA"
                )
            file_policy = policy in (ShardingPolicy.FILE, ShardingPolicy.FILE_OR_DATA)
            if file_policy and dataset.file_based and dataset.num_files < num_workers:
                raise ValueError(
                    f"sharding policy {name}: the pipeline has fewer files ({dataset.num_files}) "
                    f"than workers ({num_workers})"
                )

    @servicer_method
    @_durable
    def GetOrCreateIteration(self, request, context):
        with self._lock:
            job = self._state.job(request.job_id)
            self._state.dataset(job.config.dataset_id)  # LookupError once an ephemeral is gone
            key = (job.job_id, request.repetition)
            iteration_id = self._state.iteration_by_key.get(key)
            new_tasks: list[Task] = []
            if iteration_id is None or self._state.iterations[iteration_id].garbage_collected:
                iteration_id = self._state.peek_id("iteration")
                self._apply(Update(create_iteration=dispatcher_pb2.CreateIteration(
                    iteration_id=iteration_id, job_id=job.job_id, repetition=request.repetition)))
                for address in sorted(self._state.workers):
                    new_tasks.append(self._create_task(iteration_id, address))
            client_id = self._state.peek_id("client")
            self._apply(Update(acquire_client=dispatcher_pb2.AcquireClient(
                client_id=client_id, iteration_id=iteration_id)))
            self._client_seen[client_id] = self._clock()
            self._iteration_idle_since.pop(iteration_id, None)
            if self._state.iterations[iteration_id].requeued:  # carried over from a collected one
                self._requeued_at.setdefault(iteration_id, self._heartbeats)
                self._requeued_time.setdefault(iteration_id, self._clock())
            task_defs = [(t.worker_address, self._task_def(t)) for t in new_tasks]
        self._push_tasks(task_defs)
        return dispatcher_pb2.GetOrCreateIterationResponse(
            iteration_id=iteration_id, client_id=client_id
        )

    def _create_task(self, iteration_id: int, worker_address: str) -> Task:
        task_id = self._state.peek_id("task")
        self._apply(Update(create_task=dispatcher_pb2.CreateTask(
            task_id=task_id, iteration_id=iteration_id, worker_address=worker_address)))
        return self._state.task(task_id)

    def _task_def(self, task: Task) -> common_pb2.TaskDef:
        iteration = self._state.iteration(task.iteration_id)
        job = self._state.job(iteration.job_id)
        dataset = self._state.dataset(job.config.dataset_id)
        worker = self._state.workers.get(task.worker_address)
        num_workers = len(self._config.worker_addresses or ())
        task_def = common_pb2.TaskDef(
            task_id=task.task_id,
            iteration_id=iteration.iteration_id,
            job_id=job.job_id,
            dataset_id=dataset.dataset_id,
            sharding_policy=job.config.sharding_policy,
            num_workers=num_workers,
            worker_index=worker.index if worker is not None else -1,
            cross_trainer_cache=job.config.cross_trainer_cache,
            compression=dataset.definition.compression,
            num_splits=dataset.definition.num_splits,
        )
        if job.config.HasField("num_consumers"):
            task_def.num_consumers = job.config.num_consumers
        return task_def

    def _push_tasks(self, task_defs: Iterable[tuple[str, common_pb2.TaskDef]]) -> None:
        for address, task_def in task_defs:
            self._pusher.submit(_push_task, address, task_def)

    # ------------------------------------------------------------------ clients
    @servicer_method
    @_durable
    def ClientHeartbeat(self, request, context):
        with self._lock:
            iteration = self._state.iteration_of_client(request.client_id)
            self._client_seen[request.client_id] = self._clock()
            self._record_delivered(iteration, request)
            response = dispatcher_pb2.ClientHeartbeatResponse(
                iteration_finished=self._state.is_finished(iteration)
            )
            self._send_settled(iteration, request.client_id, response)
            if iteration.garbage_collected:
                response.error = f"iteration {iteration.iteration_id} was garbage-collected"
            coordinated = self._coordinated(iteration)
            if coordinated:
                self._note_blocked(iteration, request)
                for removal_round, task_ids in iteration.removals:
                    response.removals.add(round=removal_round, task_ids=task_ids)
            for task in self._state.iteration_tasks(iteration):
                worker = self._state.workers.get(task.worker_address)
                if (task.finished or worker is None) and not coordinated:
                    continue
                info = common_pb2.TaskInfo(
                    task_id=task.task_id,
                    worker_address=task.worker_address,
                    starting_round=task.starting_round,
                    lost=task.lost,
                )
                if worker is not None:
                    info.worker_uid = worker.uid
                    info.worker_index = worker.index
                    info.host_id = worker.host_id
                    info.process_id = worker.process_id
                    info.data_port = worker.data_port
                    info.data_socket = worker.data_socket
                response.tasks.append(info)
            return response

    def _note_blocked(self, iteration: Iteration,
                      request: dispatcher_pb2.ClientHeartbeatRequest) -> None:
        """Coordinated reads losing a worker (tf.data service's MaybeRemoveTask, generalised).

        A consumer whose next round falls on a lost task stops there and reports that round.
        Once every consumer is stopped so (each having seen every removal decided so far), the
        lost tasks leave at R = the highest of those rounds: no consumer read a round >= R, so
        all switch to the smaller task set at the same round; rounds before R that fall on
        the lost tasks are skipped by whoever had not read them (their elements died with the
        worker). The decision is journaled, so a restarted dispatcher repeats it.
        """
        blocked = self._blocked.setdefault(iteration.iteration_id, {})
        if not request.HasField("blocked_round"):
            blocked.pop(request.consumer_index, None)
            return
        # A consumer that read its last round counts as stopped there whatever it has seen.
        seen = DONE if request.consumer_done else request.removals_seen
        blocked[request.consumer_index] = (request.blocked_round, seen)
        num_consumers = self._state.job(iteration.job_id).config.num_consumers
        current = {consumer: round_index for consumer, (round_index, seen) in blocked.items()
                   if seen in (DONE, len(iteration.removals))}
        if set(current) != set(range(num_consumers)):
            return
        removed = {t for _, task_ids in iteration.removals for t in task_ids}
        lost = [t for t in iteration.task_ids if self._state.task(t).lost and t not in removed]
        if not lost:
            return
        removal_round = max(current.values(), default=0)
        if iteration.removals:
            removal_round = max(removal_round, iteration.removals[-1][0])
        logger.info("iteration %d: lost tasks %s leave the round robin at round %d",
                    iteration.iteration_id, lost, removal_round)
        self._apply(Update(remove_round_tasks=dispatcher_pb2.RemoveRoundTasks(
            iteration_id=iteration.iteration_id,
            removal=common_pb2.RemovedTasks(round=removal_round, task_ids=lost))))
        for consumer in [c for c, (_, seen) in blocked.items() if seen != DONE]:
            del blocked[consumer]  # they report again if they stop again

    def _coordinated(self, iteration: Iteration) -> bool:
        """Coordinated reads: the iteration's task set is fixed once it has tasks.

        Every consumer maps round r to the r-th task (mod their number, sorted by id), so all
        must see the same set: new workers get no task in such an iteration, and finished
        tasks stay listed (their workers answer end_of_sequence) for consumers that start late.
        """
        return self._state.job(iteration.job_id).config.HasField("num_consumers")

    def _record_delivered(self, iteration: Iteration, request: Any) -> None:
        """Record the offsets a ClientHeartbeat or ReleaseIterationClient request received."""
        self._heartbeats += 1
        self._client_heartbeat[request.client_id] = self._heartbeats
        requeued = {(s.repetition, s.index) for s in iteration.requeued}
        tracked = [r for r in request.received
                   if (r.split.repetition, r.split.index) in iteration.delivered
                   or (r.split.repetition, r.split.index) in requeued]
        if tracked:
            sizes = {key: iteration.produced[key] for key in (
                (r.split.repetition, r.split.index) for r in tracked)
                if key in iteration.produced}
            self._apply(Update(record_delivered=dispatcher_pb2.RecordDelivered(
                iteration_id=iteration.iteration_id, splits=tracked)))
            self._note_settled(iteration, sizes)

    def _note_settled(self, iteration: Iteration, sizes: dict[tuple[int, int], int]) -> None:
        """Log the splits among `sizes` (key -> elements) that the last update settled."""
        if not iteration.client_ids:
            return  # nobody to tell; a client that joins later starts at the log's end
        log = self._settled.setdefault(iteration.iteration_id, [])
        for key, size in sizes.items():
            if key not in iteration.delivered:
                log.append((*key, size))

    def _send_settled(self, iteration: Iteration, client_id: int,
                      response: dispatcher_pb2.ClientHeartbeatResponse) -> None:
        iteration_id = iteration.iteration_id
        log = self._settled.get(iteration_id)
        if not log:
            return
        base = self._settled_base.get(iteration_id, 0)
        start = self._settled_sent.get(client_id, base) - base
        for repetition, index, size in log[max(0, start):]:
            response.settled.add(split=common_pb2.SplitKey(repetition=repetition, index=index),
                                 num_elements=size)
        self._settled_sent[client_id] = base + len(log)
        # Forget what every client of the iteration was sent.
        done = min(self._settled_sent.get(c, base) for c in iteration.client_ids) - base
        if done > 0:
            del log[:done]
            self._settled_base[iteration_id] = base + done

    @servicer_method
    @_durable
    def ReleaseIterationClient(self, request, context):
        with self._lock:
            if request.client_id in self._state.clients:
                # What it received last is delivered: the splits it held are not read again.
                self._record_delivered(self._state.iteration_of_client(request.client_id),
                                       request)
                self._release_client(request.client_id)
        return dispatcher_pb2.ReleaseIterationClientResponse()

    def _release_client(self, client_id: int) -> None:
        iteration_id = self._state.clients[client_id]
        self._apply(Update(release_client=dispatcher_pb2.ReleaseClient(client_id=client_id)))
        self._client_seen.pop(client_id, None)
        self._client_heartbeat.pop(client_id, None)
        self._settled_sent.pop(client_id, None)
        if not self._state.iterations[iteration_id].client_ids:
            self._settled.pop(iteration_id, None)
            self._settled_base.pop(iteration_id, None)
        if not self._state.iterations[iteration_id].client_ids:
            self._iteration_idle_since[iteration_id] = self._clock()

    # ------------------------------------------------------------------ workers
    @servicer_method
    @_durable
    def WorkerHeartbeat(self, request, context):
        address = request.worker_address
        with self._lock:
            worker = self._state.workers.get(address)
            new_tasks: list[Task] = []
            pushes: list[tuple[str, common_pb2.TaskDef]] = []
            if worker is not None and worker.uid != request.worker_uid:
                logger.info("worker %s restarted; its old tasks are dropped", address)
                pushes = self._remove_worker(address)
                worker = None
            if worker is None:
                index = self._worker_index(address)
                self._apply(Update(register_worker=dispatcher_pb2.RegisterWorker(
                    worker_address=address, worker_uid=request.worker_uid, worker_index=index,
                    host_id=request.host_id, process_id=request.process_id,
                    data_port=request.data_port, data_socket=request.data_socket)))
                logger.info("worker %s registered (index %d)", address, index)
                for iteration in list(self._state.active_iterations()):
                    if iteration.task_ids and self._coordinated(iteration):
                        continue  # its consumers agreed on a fixed task set (see below)
                    new_tasks.append(self._create_task(iteration.iteration_id, address))
            self._worker_seen[address] = self._clock()
            assigned = {t.task_id: t for t in self._state.worker_tasks(address)}
            current = set(request.current_tasks)
            response = dispatcher_pb2.WorkerHeartbeatResponse(
                worker_index=self._state.workers[address].index
            )
            for task_id, task in assigned.items():
                if task_id not in current:
                    response.new_tasks.append(self._task_def(task))
            for task_id in sorted(current - assigned.keys()):
                task = self._state.tasks.get(task_id)
                # A finished task stays on the worker until its iteration is gone, so that
                # late readers get end_of_sequence instead of an unknown-task error.
                if task is None or self._state.iteration(task.iteration_id).garbage_collected:
                    response.tasks_to_delete.append(task_id)
        self._push_tasks(pushes)
        return response

    def _remove_worker(self, address: str) -> list[tuple[str, common_pb2.TaskDef]]:
        """Journal that a worker left; return the new tasks to push to the others.

        Its unsettled DYNAMIC splits go back to their iterations first (see the module
        docstring); an iteration left with requeued splits and no unfinished task on a
        registered worker gets a task on every registered worker, which will take them.
        """
        requeued_in: set[int] = set()
        for task in self._state.worker_tasks(address):
            for repetition, index in sorted(task.splits):
                self._apply(Update(requeue_split=dispatcher_pb2.RequeueSplit(
                    iteration_id=task.iteration_id,
                    split=common_pb2.SplitKey(repetition=repetition, index=index))))
                requeued_in.add(task.iteration_id)
        self._apply(Update(remove_worker=dispatcher_pb2.RemoveWorker(worker_address=address)))
        new_tasks: list[Task] = []
        for iteration_id in sorted(requeued_in):
            self._requeued_at[iteration_id] = self._heartbeats
            self._requeued_time[iteration_id] = self._clock()
            iteration = self._state.iterations[iteration_id]
            logger.info("iteration %d: %d split(s) of worker %s requeued", iteration_id,
                        len(iteration.requeued), address)
            new_tasks += self._ensure_requeue_takers(iteration)
        return [(t.worker_address, self._task_def(t)) for t in new_tasks]

    def _ensure_requeue_takers(self, iteration: Iteration) -> list[Task]:
        """New tasks on every live worker when `iteration` has requeued splits and no
        unfinished task on a live worker to take them (a finished task asks for no split)."""
        if not iteration.requeued or iteration.garbage_collected or any(
                not t.finished and t.worker_address in self._state.workers
                for t in self._state.iteration_tasks(iteration)):
            return []
        return [self._create_task(iteration.iteration_id, address)
                for address in sorted(self._state.workers)]

    def _worker_index(self, address: str) -> int:
        addresses = self._config.worker_addresses
        if not addresses:
            return -1
        if address not in addresses:
            raise ValueError(
                f"worker {address} is not in the dispatcher's fixed worker list {addresses}; "
                "start it with one of those addresses"
            )
        return addresses.index(address)

    @servicer_method
    @_durable
    def WorkerUpdate(self, request, context):
        new_tasks: list[Task] = []
        with self._lock:
            for task_id in request.completed_tasks:
                task = self._state.tasks.get(task_id)
                if task is not None and not task.finished:
                    self._apply(Update(finish_task=dispatcher_pb2.FinishTask(task_id=task_id)))
                    # A split requeued after this task's replicas took their last split waits
                    # for this task to end; then nobody would ask for it.
                    new_tasks += self._ensure_requeue_takers(
                        self._state.iteration(task.iteration_id))
            pushes = [(t.worker_address, self._task_def(t)) for t in new_tasks]
        self._push_tasks(pushes)
        return dispatcher_pb2.WorkerUpdateResponse()

    # ------------------------------------------------------------------ splits
    @servicer_method
    @_durable
    def GetSplit(self, request, context):
        with self._lock:
            iteration = self._state.iteration(request.iteration_id)
            if iteration.garbage_collected:
                return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
            task = self._state.task(request.task_id)
            if task.finished:
                return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
            for finished in request.finished_splits:
                key = (finished.split.repetition, finished.split.index)
                if key in iteration.delivered and key not in iteration.produced:
                    self._apply(Update(split_produced=dispatcher_pb2.SplitProduced(
                        iteration_id=iteration.iteration_id, task_id=task.task_id,
                        split=finished.split, num_elements=finished.elements)))
                    self._note_settled(iteration, {key: finished.elements})
            last = task.last_split.get(request.replica)
            if request.request_id and last is not None and last[0] == request.request_id:
                return _split_response(iteration, last[1])  # a retried request
            granted: list[tuple[int, int]] = []
            for _ in range(min(max(1, request.max_splits), MAX_SPLITS_PER_REQUEST)):
                try:
                    produce = self._next_split(iteration, request.repetition, task)
                except NotReadyError:
                    if granted:
                        break
                    raise
                end = produce is None or produce.split_index < 0
                if end and granted:
                    break  # the next request learns of the end
                if produce is not None:
                    produce.replica, produce.request_id = request.replica, request.request_id
                    self._apply(Update(produce_split=produce))
                if end:
                    return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
                granted.append((produce.repetition, produce.split_index))
            # The same answer a retry of this request gets.
            return _split_response(iteration, tuple(granted))

    def _requeue_ready(self, iteration: Iteration) -> bool:
        """Every client of `iteration` reported what it received since the last requeue, or
        worker_timeout_ms passed since it (see the module docstring for the trade-off).

        A client silent for longer than worker_timeout_ms is not waited for (it may be a
        trainer that died, or one that never heartbeated): it cannot report anything new.
        """
        since = self._requeued_at.get(iteration.iteration_id)
        if since is None:
            return True
        now = self._clock()
        silent_s = self._config.effective_worker_timeout_ms / 1000
        if now - self._requeued_time.get(iteration.iteration_id, now) > silent_s:
            return True
        return all(self._client_heartbeat.get(c, 0) > since
                   or now - self._client_seen.get(c, now) > silent_s
                   for c in iteration.client_ids)

    def _next_split(self, iteration: Iteration, repetition: int,
                    task: Task) -> dispatcher_pb2.ProduceSplit | None:
        """The next split for `task` in `repetition`: a requeued one first (oldest first,
        of any repetition: see the module docstring), then the cursor. At the end of the
        splits: None, or a record with split_index -1 when the cursor moves to `repetition`.

        Raises NotReadyError (UNAVAILABLE: the worker retries) when only requeued splits are
        left and clients have not yet reported what they received of them.
        """
        waiting = False
        if iteration.requeued:
            if self._requeue_ready(iteration):
                split = min(iteration.requeued, key=lambda s: (s.repetition, s.index))
                return dispatcher_pb2.ProduceSplit(
                    iteration_id=iteration.iteration_id, repetition=split.repetition,
                    split_index=split.index, task_id=task.task_id, requeued=True)
            waiting = True
        not_ready = NotReadyError(
            f"iteration {iteration.iteration_id}: splits of a lost worker wait for clients to "
            "report what they received; retry")
        if repetition < iteration.cursor_repetition:
            if waiting:
                raise not_ready
            return None
        index = iteration.cursor_index if repetition == iteration.cursor_repetition else 0
        if index >= self._num_splits(iteration):
            if waiting:
                raise not_ready
            index = -1
        return dispatcher_pb2.ProduceSplit(iteration_id=iteration.iteration_id,
                                           repetition=repetition, task_id=task.task_id,
                                           split_index=index)

    def _num_splits(self, iteration: Iteration) -> int:
        job = self._state.job(iteration.job_id)
        return self._state.dataset(job.config.dataset_id).definition.num_splits

    # ------------------------------------------------------------------ liveness
    def check_liveness(self) -> None:
        """Declare silent workers dead, release silent clients, collect idle iterations."""
        now = self._clock()
        worker_timeout = self._config.effective_worker_timeout_ms / 1000
        gc_timeout = self._config.effective_job_gc_timeout_ms / 1000
        pushes: list[tuple[str, common_pb2.TaskDef]] = []
        with self._lock:
            for address, seen in list(self._worker_seen.items()):
                if now - seen > worker_timeout and address in self._state.workers:
                    logger.warning("worker %s missed heartbeats for %.1fs: removed",
                                   address, now - seen)
                    pushes += self._remove_worker(address)
                    del self._worker_seen[address]
            for client_id, seen in list(self._client_seen.items()):
                if now - seen > gc_timeout and client_id in self._state.clients:
                    logger.info("client %d silent for %.1fs: released", client_id, now - seen)
                    self._release_client(client_id)
            for iteration_id, idle_since in list(self._iteration_idle_since.items()):
                iteration = self._state.iterations.get(iteration_id)
                if iteration is None or iteration.garbage_collected or iteration.client_ids:
                    del self._iteration_idle_since[iteration_id]
                    continue
                if now - idle_since > gc_timeout:
                    logger.info("iteration %d has had no clients for %.1fs: collected",
                                iteration_id, now - idle_since)
                    self._collect(iteration)
                    del self._iteration_idle_since[iteration_id]
        self._journal.sync()
        self._push_tasks(pushes)

    def _collect(self, iteration: Iteration) -> None:
        """Garbage-collect an iteration. Its unsettled DYNAMIC splits are requeued first: the
        split cursor and they pass to the iteration that replaces it (same job and
        repetition), so a trainer resuming from a loader state continues where it stopped."""
        for task in self._state.iteration_tasks(iteration):
            if task.finished:
                continue
            for repetition, index in sorted(task.splits):
                self._apply(Update(requeue_split=dispatcher_pb2.RequeueSplit(
                    iteration_id=iteration.iteration_id,
                    split=common_pb2.SplitKey(repetition=repetition, index=index))))
        self._apply(Update(garbage_collect_iteration=dispatcher_pb2.GarbageCollectIteration(
            iteration_id=iteration.iteration_id)))
        self._blocked.pop(iteration.iteration_id, None)
        self._drop_unread_ephemeral(self._state.job(iteration.job_id).config.dataset_id)

    def _drop_unread_ephemeral(self, dataset_id: str) -> None:
        """Remove an ephemeral dataset (DatasetDef.ephemeral) that no iteration reads any
        more, unless a registration was answered with it lately: its job is on the way."""
        dataset = self._state.datasets.get(dataset_id)
        if dataset is None or not dataset.definition.ephemeral:
            return
        reused = self._ephemeral_reused.get(dataset_id)
        if reused is not None and (self._clock() - reused
                                   < self._config.effective_job_gc_timeout_ms / 1000):
            return
        if any(not other.garbage_collected
               and self._state.job(other.job_id).config.dataset_id == dataset_id
               for other in self._state.iterations.values()):
            return
        self._ephemeral_reused.pop(dataset_id, None)
        logger.info("ephemeral dataset %s is no longer read: removed", dataset_id)
        self._apply(Update(remove_dataset=dispatcher_pb2.RemoveDataset(dataset_id=dataset_id)))

def _split_response(iteration: Iteration,
                    keys: tuple[tuple[int, int], ...]) -> dispatcher_pb2.GetSplitResponse:
    """The answer already given for the splits handed out (a retried GetSplit)."""
    granted = []
    for repetition, index in keys:
        if index < 0:
            break
        offsets = sorted(iteration.delivered.get((repetition, index), ()))
        granted.append(dispatcher_pb2.GetSplitResponse(
            split_index=index, skip=len(offsets), skip_offsets=offsets, repetition=repetition))
    if not granted:
        return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
    first, *following = granted
    first.following.extend(following)
    return first


def _check_matching_job(existing: common_pb2.JobConfig, requested: common_pb2.JobConfig) -> None:
    def describe(config: common_pb2.JobConfig, name: str) -> object:
        if name == "sharding_policy":
            return policy_name(config.sharding_policy)
        if name == "num_consumers":
            return config.num_consumers if config.HasField("num_consumers") else None
        return getattr(config, name)

    for name in ("sharding_policy", "num_consumers", "cross_trainer_cache", "target_workers"):
        old, new = describe(existing, name), describe(requested, name)
        if old != new:
            raise ValueError(
                f"job {existing.job_name!r} already exists with {name}={old!r}; "
                f"got {name}={new!r}"
            )


def _push_task(address: str, task_def: common_pb2.TaskDef) -> None:
    stub = worker_pb2_grpc.WorkerServiceStub(channel_to(address))
    try:
        stub.ProcessTask(worker_pb2.ProcessTaskRequest(task=task_def), timeout=2)
    except grpc.RpcError as error:  # the next heartbeat delivers it
        logger.debug("push of task %d to %s failed: %s", task_def.task_id, address, error)

