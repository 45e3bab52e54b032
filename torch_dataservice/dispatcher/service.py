"""The dispatcher's gRPC handlers: validate, decide, journal, apply, reply.

Every handler takes the one lock, asks the decision modules for `Update`s
(dispatcher/validation.py, splits.py, resume.py, tasks.py, coordinated.py, liveness.py; they
never change the state, but some record or forget soft state as they decide), applies them to
`DispatcherState` as they come (a decision may depend on the one before: a GetSplit's next
split on the cursor its last one moved), journals them together as one record when it
releases the lock (`_changes`), and replies. One record per request, not per update: a
GetSplit that reports finished splits and is handed new ones is encoded and written once.
If that append fails (a full disk), the state is rebuilt from the journal, as a restart would
rebuild it, and the request fails: the state never holds what the journal does not, and
nothing anyone was told is lost. What a restart forgets lives in one
`SoftState` (dispatcher/soft.py). Pushing new tasks to workers is best-effort and outside the
lock: a worker that misses a push gets the task in its next heartbeat reply. Every RPC syncs
the journal (group commit, see dispatcher/file_journal.py) after releasing the lock and before
replying. The exactly-once rules of DYNAMIC sharding are in dispatcher/splits.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher import (
    affinity,
    coordinated,
    liveness,
    recovery,
    resume,
    splits,
    status,
    tasks,
    validation,
)
from torch_dataservice.dispatcher.cadence import Cadence, admitted
from torch_dataservice.dispatcher.effects import Effects
from torch_dataservice.dispatcher.journal import Journal, durable
from torch_dataservice.dispatcher.observe import DispatcherObserver
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import DispatcherState, Iteration, Task, Worker
from torch_dataservice.dispatcher.task_push import Push, TaskPusher
from torch_dataservice.errors import NotReadyError
from torch_dataservice.proto import dispatcher_pb2, dispatcher_pb2_grpc, status_pb2
from torch_dataservice.rpc import servicer_method

logger = logging.getLogger(__name__)

Update = dispatcher_pb2.Update


class DispatcherService(dispatcher_pb2_grpc.DispatcherServiceServicer):
    def __init__(
        self,
        config: DispatcherConfig,
        journal: Journal,
        clock: Callable[[], float] = time.monotonic,
        observer: DispatcherObserver | None = None,
        pusher: TaskPusher | None = None,
    ) -> None:
        self._config = config
        self._observe = observer or DispatcherObserver()  # load figures: status and metrics
        self._journal = journal
        self._clock = clock
        self._num_workers = len(config.worker_addresses or ())  # static sharding's fixed list
        self._worker_timeout_s = config.effective_worker_timeout_ms / 1000
        self._gc_timeout_s = config.effective_job_gc_timeout_ms / 1000
        self._lock = threading.RLock()
        # The updates applied since the outermost `_changes` began: one journal record.
        self._pending: list[Update] | None = None
        self._owner: int | None = None  # the thread whose `_changes` opened `_pending`
        self._cadence = Cadence(config.effective_heartbeat_budget_rps,
                                config.effective_max_pending_rpcs)
        self._views = tasks.ClientViews()  # what every client's reply shares, per change
        self._state = recovery.replay(journal)
        self._soft = SoftState.restored(self._state, clock())
        self._pusher = pusher or TaskPusher()  # tests of the service alone keep pushes
        self._effects = Effects(self._state, self._soft, self._apply, self._observe, clock,
                                self._num_workers, self._gc_timeout_s)
        if journal.recovered_from is not None:  # cut at damage: rewrite it without
            self._apply(*recovery.drop_running(self._state, self._soft, journal.recovered_from))
            journal.compact(self._state)

    @property
    def state(self) -> DispatcherState:
        return self._state

    def close(self) -> None:
        """Stop pushing tasks, then close the journal (its last updates are fsynced)."""
        self._pusher.close()
        self._journal.close()

    @property
    def cadence(self) -> Cadence:
        return self._cadence

    def _worker_timeout(self) -> float:
        """worker_timeout_ms, or longer while the fleet is asked to report less often."""
        return self._cadence.timeout_s("worker", self._worker_timeout_s)

    def _client_timeout(self) -> float:
        """When a silent reader is taken for dead (worker_timeout_ms, or longer: cadence)."""
        return self._cadence.timeout_s("client", self._worker_timeout_s)

    def _apply(self, *updates: Update | None) -> None:
        """Apply `updates` now; they are journaled when the outermost `_changes` ends (one
        made for this call if none is open)."""
        if self._pending is not None and self._owner == threading.get_ident():
            self._apply_pending(updates)  # in this thread's `_changes`: the lock is held
            return
        with self._changes():
            self._apply_pending(updates)

    def _apply_pending(self, updates: tuple[Update | None, ...]) -> None:
        """`_apply` inside `_changes` (a GetSplit applies a few dozen: no lock or context
        manager per update)."""
        pending = self._pending
        assert pending is not None  # _changes opened it
        for update in updates:
            if update is None:
                continue
            self._state.apply(update)
            pending.append(update)
            if self._views.note(update) == "requeue_split":
                requeue = update.requeue_split
                self._soft.note_requeued(self._state.iterations[requeue.iteration_id],
                                         (requeue.split.repetition, requeue.split.index))

    @contextlib.contextmanager
    def _changes(self) -> Iterator[None]:
        """Hold the lock; what is applied meanwhile is appended to the journal as one record
        when the outermost `_changes` ends, even if the handler raised (durable before any
        reply: see journal.durable)."""
        with self._lock:
            if self._pending is not None:  # nested: the outermost one journals
                yield
                return
            self._pending, self._owner = [], threading.get_ident()
            try:
                yield
            finally:
                pending, self._pending, self._owner = self._pending, None, None
                if pending:
                    self._journal_applied(pending)

    def _journal_applied(self, updates: list[Update]) -> None:
        """Append the updates applied under the lock as one record, then compact if due. If
        the append fails, go back to the state the journal holds, and fail the request."""
        record = (updates[0] if len(updates) == 1
                  else Update(batch=dispatcher_pb2.UpdateBatch(updates=updates)))
        try:
            self._journal.append(record)
        except Exception:
            self._rebuild()
            raise
        self._journal.maybe_compact(self._state)

    def _rebuild(self) -> None:
        """Become what the journal holds (a restart's state and soft state): updates were
        applied that the journal does not hold, since its append failed."""
        logger.error("the journal did not take a request's updates: the dispatcher's state "
                     "goes back to what the journal holds, as after a restart")
        dropped = self._soft.dropped_clients
        self._state = recovery.replay(self._journal, reread=True)
        self._soft = SoftState.restored(self._state, self._clock())
        self._soft.dropped_clients = dropped
        self._views = tasks.ClientViews()
        self._effects = Effects(self._state, self._soft, self._apply, self._observe,
                                self._clock, self._num_workers, self._gc_timeout_s)

    # ------------------------------------------------------------------ datasets
    @servicer_method
    @durable
    def GetOrRegisterDataset(self, request, context):
        definition = request.dataset
        with self._changes():
            validation.check_dependencies(self._state, definition)
            dataset_id = request.dataset_id
            if not dataset_id:
                existing = self._state.dataset_by_fingerprint.get(definition.fingerprint)
                if existing is not None:
                    if definition.ephemeral:  # it must outlive the job its registrant creates
                        self._soft.ephemeral_reused[existing] = self._clock()
                    return dispatcher_pb2.GetOrRegisterDatasetResponse(dataset_id=existing)
                dataset_id = self._state.free_dataset_id()
            if dataset_id not in self._state.datasets:
                validation.check_dataset_limits(self._state, definition,
                                                self._config.max_dataset_bytes,
                                                self._config.max_datasets)
                self._apply(Update(register_dataset=dispatcher_pb2.RegisterDataset(
                    dataset_id=dataset_id, dataset=definition)))
                if definition.ephemeral:  # removed if no job reads it in time (liveness)
                    self._soft.ephemeral_reused[dataset_id] = self._clock()
            return dispatcher_pb2.GetOrRegisterDatasetResponse(dataset_id=dataset_id)

    @servicer_method
    @durable
    def GetDatasetDef(self, request, context):
        with self._lock:
            dataset = self._state.dataset(request.dataset_id)
            return dispatcher_pb2.GetDatasetDefResponse(dataset=dataset.definition)

    # ------------------------------------------------------------------ jobs and iterations
    @servicer_method
    @durable
    def GetOrCreateJob(self, request, context):
        config = request.config
        validation.check_version(request, "this client")
        with self._changes():
            dataset = self._state.dataset(config.dataset_id)
            validation.validate_job(config, dataset.definition,
                                    self._config.worker_addresses or ())
            job_id = self._state.job_by_name.get(config.job_name) if config.job_name else None
            if job_id is not None:
                validation.check_matching_job(self._state.job(job_id).config, config)
                return dispatcher_pb2.GetOrCreateJobResponse(job_id=job_id)
            job_id = self._state.peek_id("job")
            self._apply(Update(create_job=dispatcher_pb2.CreateJob(job_id=job_id, config=config)))
            return dispatcher_pb2.GetOrCreateJobResponse(job_id=job_id)

    @admitted
    @servicer_method
    @durable
    def GetOrCreateIteration(self, request, context):
        now = self._clock()
        with self._changes():
            job = self._state.job(request.job_id)
            self._state.dataset(job.config.dataset_id)  # LookupError once an ephemeral is gone
            repetition = request.repetition
            if request.at_least_latest:
                repetition = max(repetition, self._state.latest_repetition(job.job_id))
            iteration_id = self._state.iteration_by_key.get((job.job_id, repetition))
            created: list[Update] = []
            new = iteration_id is None or self._state.iterations[iteration_id].garbage_collected
            if new:
                iteration_id = self._state.peek_id("iteration")
                self._apply(Update(create_iteration=dispatcher_pb2.CreateIteration(
                    iteration_id=iteration_id, job_id=job.job_id, repetition=repetition)))
                created = tasks.for_new_iteration(self._state, iteration_id)
            assert iteration_id is not None  # found, or created just above
            client_id = self._state.peek_id("client")
            self._apply(*created, Update(acquire_client=dispatcher_pb2.AcquireClient(
                client_id=client_id, iteration_id=iteration_id)))
            self._soft.client_seen[client_id] = now
            self._soft.note_joined(client_id, self._state.iterations[iteration_id])
            self._observe.joined(client_id, iteration_id, job, new)
            self._soft.iteration_idle_since.pop(iteration_id, None)
            if self._state.iterations[iteration_id].requeued:  # carried over from a collected one
                self._soft.note_requeue(iteration_id, now, keep=True)
            pushes = self._effects.pushes(created)
        self._pusher.push(pushes)
        return dispatcher_pb2.GetOrCreateIterationResponse(
            iteration_id=iteration_id, client_id=client_id, repetition=repetition,
            created=new, next_heartbeat_ms=self._cadence.client_ms)

    # ------------------------------------------------------------------ clients
    @admitted
    @servicer_method
    @durable
    def ClientHeartbeat(self, request, context):
        with self._changes():
            recovery.check_client(self._state, self._soft, self._journal.recovered_from,
                                  request.client_id)
            iteration = self._state.iteration_of_client(request.client_id)
            if coordinated.is_coordinated(self._state, iteration):
                validation.check_consumer(request, self._state.job(iteration.job_id).config)
            handed_again = self._soft.back_from_silence(
                request.client_id, iteration, self._clock(), self._client_timeout())
            self._record_delivered(iteration, request)
            self._soft.client_fenced[request.client_id] = frozenset(request.fenced_tasks)
            added: list[Update] = []
            if coordinated.is_coordinated(self._state, iteration):
                added = self._coordinate(iteration, request)
            view = self._views.get(self._state, iteration)
            held = view.finished and splits.end_held(
                self._state, self._soft, iteration, self._clock(), self._client_timeout())
            reply = tasks.client_reply(self._state, iteration, view, request.known_tasks_version,
                                       self._soft.take_settled(request.client_id),
                                       self._soft.proposals.get(iteration.iteration_id), held)
            if handed_again is not None:
                reply.declared_silent = True
                for repetition, index in sorted(handed_again):
                    reply.handed_again.add(repetition=repetition, index=index)
            reply.next_heartbeat_ms = self._cadence.client_ms
            pushes = self._effects.pushes(added)
        self._pusher.push(pushes)
        return reply

    def _coordinate(self, iteration: Iteration, request: Any) -> list[Update]:
        """Coordinated reads: joining workers' tasks (returned) and lost tasks' removal."""
        iteration_id = iteration.iteration_id
        added = coordinated.plan_addition(
            self._state, self._soft.rounds.setdefault(iteration_id, {}), self._soft.proposals,
            iteration, request)
        self._apply(*added)
        blocked = self._soft.blocked.setdefault(iteration_id, {})
        self._apply(coordinated.note_blocked(self._state, blocked, iteration, request))
        return added

    def _record_delivered(self, iteration: Iteration, request: Any) -> None:
        """Record the offsets a ClientHeartbeat or ReleaseIterationClient request received."""
        self._soft.note_heartbeat(request.client_id, self._clock())
        self._observe.client(request.client_id, iteration.iteration_id, request.load,
                             self._clock())
        update = splits.delivered(iteration, request.received)
        self._soft.note_reported(iteration, request.client_id,
                                 [(r.split.repetition, r.split.index) for r in request.received])
        if update is not None:
            keys = [(r.split.repetition, r.split.index) for r in update.record_delivered.splits]
            sizes = {key: iteration.produced[key] for key in keys if key in iteration.produced}
            self._apply(update)
            self._soft.note_settled(iteration, sizes)

    @servicer_method
    @durable
    def ReleaseIterationClient(self, request, context):
        with self._changes():
            if request.client_id in self._state.clients:
                # What it received last is delivered: the splits it held are not read again.
                self._record_delivered(self._state.iteration_of_client(request.client_id),
                                       request)
                self._release_client(request.client_id)
        return dispatcher_pb2.ReleaseIterationClientResponse()

    def _release_client(self, client_id: int, why: str = "left") -> None:
        iteration = self._state.iteration_of_client(client_id)
        self._apply(Update(release_client=dispatcher_pb2.ReleaseClient(client_id=client_id)))
        self._soft.forget_client(client_id, iteration, self._clock())
        self._observe.release(client_id, iteration.iteration_id, why)

    # ------------------------------------------------------------------ workers
    @admitted
    @servicer_method
    @durable
    def WorkerHeartbeat(self, request, context):
        address = request.worker_address
        with self._changes():
            worker = self._state.workers.get(address)
            pushes: list[Push] = []
            if liveness.leaves(worker, request):  # drained: hand back what it holds now
                logger.info("worker %s left (drained)", address)
                pushes = self._effects.remove_worker(address)
            elif worker is not None and worker.uid != request.worker_uid and not request.leaving:
                logger.info("worker %s restarted; its old tasks are dropped", address)
                pushes = self._effects.remove_worker(address)
                worker = None
            response = (dispatcher_pb2.WorkerHeartbeatResponse() if request.leaving
                        else self._worker_beats(request, worker))
        self._pusher.push(pushes)  # journaled now: outside `_changes`
        return response

    def _worker_beats(self, request: dispatcher_pb2.WorkerHeartbeatRequest,
                      worker: Worker | None) -> dispatcher_pb2.WorkerHeartbeatResponse:
        """Register a new worker (its tasks too) and answer its heartbeat."""
        address = request.worker_address
        if worker is None:
            validation.check_worker(request)
            validation.check_worker_limit(self._state, self._config.max_workers)
            index = validation.worker_index(address, self._config.worker_addresses or ())
            self._apply(Update(register_worker=dispatcher_pb2.RegisterWorker(
                worker_address=address, worker_uid=request.worker_uid, worker_index=index,
                host_id=request.host_id, process_id=request.process_id,
                data_port=request.data_port, data_socket=request.data_socket)))
            logger.info("worker %s joined (index %d, %d executor process(es))", address,
                        index, request.load.processes)
            self._apply(*tasks.for_new_worker(self._state, address))
        self._soft.worker_seen[address] = self._clock()
        self._observe.worker(address, request.load, self._clock())
        new, delete = tasks.worker_task_changes(self._state, address, request.current_tasks,
                                                self._num_workers)
        return dispatcher_pb2.WorkerHeartbeatResponse(
            worker_index=self._state.workers[address].index, new_tasks=new,
            tasks_to_delete=delete, next_heartbeat_ms=self._cadence.worker_ms,
            held_version=affinity.note_report(self._state, self._soft, address, request))

    @servicer_method
    @durable
    def WorkerUpdate(self, request, context):
        created: list[Update] = []
        pushes: list[Push] = []
        with self._changes():
            for task_id in request.completed_tasks:
                task = self._state.tasks.get(task_id)
                if task is not None and not task.finished:
                    self._apply(Update(finish_task=dispatcher_pb2.FinishTask(task_id=task_id)))
                    # A split requeued after this task's replicas took their last split waits
                    # for this task to end; then nobody would ask for it.
                    iteration = self._state.iteration(task.iteration_id)
                    self._observe.task_finished(self._state, iteration)
                    created += self._effects.ensure_requeue_takers(iteration)
                    pushes += self._effects.requeue_unacknowledged(iteration)
            pushes += self._effects.pushes(created)
        self._pusher.push(pushes)
        return dispatcher_pb2.WorkerUpdateResponse()

    # ------------------------------------------------------------------ splits
    @admitted
    @servicer_method
    @durable
    def GetSplit(self, request, context):
        reply = self._get_split(request)
        reply.split_cover_ms = self._cadence.split_cover_ms
        return reply

    def _get_split(self, request: dispatcher_pb2.GetSplitRequest
                   ) -> dispatcher_pb2.GetSplitResponse:
        with self._changes():
            iteration = self._state.iteration(request.iteration_id)
            if iteration.garbage_collected:
                return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
            task = self._state.task(request.task_id)
            if task.finished:
                return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
            if task.worker_address in self._soft.worker_seen:  # its worker is alive: an
                # overloaded dispatcher drops heartbeats (gRPC's queue) before splits
                self._soft.worker_seen[task.worker_address] = self._clock()
            for update in splits.produced(iteration, task, request.finished_splits):
                self._apply(update)
                key = (update.split_produced.split.repetition, update.split_produced.split.index)
                self._soft.note_settled(iteration, {key: update.split_produced.num_elements})
            if request.report_only:  # a draining worker: see GetSplitRequest.report_only
                return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
            last = task.last_split.get(request.replica)
            if request.request_id and last is not None and last[0] == request.request_id:
                return splits.split_response(iteration, last[1])  # a retried request
            return self._grant_splits(iteration, task, request)

    def _grant_splits(self, iteration: Iteration, task: Task,
                      request: dispatcher_pb2.GetSplitRequest) -> dispatcher_pb2.GetSplitResponse:
        """Hand out up to max_splits splits, one decision and one record each."""
        granted: list[tuple[int, int]] = []
        for _ in range(min(max(1, request.max_splits), splits.MAX_SPLITS_PER_REQUEST)):
            try:
                produce = splits.next_split(self._state, self._soft, iteration,
                                            request.repetition, task, self._clock(),
                                            self._client_timeout())
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
            if end or produce is None:
                return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
            granted.append((produce.repetition, produce.split_index))
        self._observe.splits += len(granted)
        return splits.split_response(iteration, tuple(granted))  # what a retry gets too

    @servicer_method
    def GetSplitSizes(self, request, context):
        with self._lock:
            iteration = self._state.iteration(request.iteration_id)
            return resume.split_sizes(iteration.sizes, request.splits)

    # ------------------------------------------------------------------ status
    @servicer_method
    def GetClusterStatus(self, request, context):
        return self.cluster_status()

    def cluster_status(self) -> status_pb2.GetClusterStatusResponse:
        with self._lock:  # only the inputs: the reply is built after (status.StatusView)
            view = status.gather(self._state, self._soft, self._observe, self._clock())
            worker_timeout_s = self._worker_timeout()
        reply = status.build(view, worker_timeout_s)
        self._cadence.fill(reply.load)
        return reply

    # ------------------------------------------------------------------ liveness
    def check_liveness(self) -> None:
        """Declare silent workers dead, release silent clients, collect idle iterations and
        ephemeral datasets no job read in time."""
        now = self._clock()
        pushes: list[Push] = []
        with self._changes():
            self._cadence.update(len(self._state.workers), len(self._state.clients), now)
            for (kind, peer), when in self._cadence.take_refused_beats().items():
                seen = self._soft.worker_seen if kind == "worker" else self._soft.client_seen
                if peer in seen:  # refused for overload is not silent
                    seen[peer] = max(seen[peer], when)
            self._views.forget_collected(self._state)
            for address in liveness.silent_workers(self._state, self._soft, now,
                                                   self._worker_timeout()):
                logger.warning("worker %s missed heartbeats for %.1fs: removed",
                               address, now - self._soft.worker_seen[address])
                pushes += self._effects.remove_worker(address)
                del self._soft.worker_seen[address]
            for client_id in liveness.newly_silent_clients(self._state, self._soft, now,
                                                           self._client_timeout()):
                iteration = self._state.iteration_of_client(client_id)
                logger.warning("client %d of iteration %d silent for %.1fs: what it did not "
                               "acknowledge goes to the other clients", client_id,
                               iteration.iteration_id, now - self._soft.client_seen[client_id])
                self._soft.note_silent(client_id, iteration.iteration_id)
                pushes += self._effects.requeue_unacknowledged(iteration)
            for client_id in liveness.silent_clients(
                    self._state, self._soft, now,
                    self._cadence.timeout_s("client", self._gc_timeout_s)):
                self._release_client(client_id, f"silent for "
                                     f"{now - self._soft.client_seen[client_id]:.1f}s: released")
            for iteration in liveness.idle_iterations(self._state, self._soft, now,
                                                      self._gc_timeout_s):
                logger.info("iteration %d has had no clients for %.1fs: collected",
                            iteration.iteration_id,
                            now - self._soft.iteration_idle_since[iteration.iteration_id])
                self._effects.collect(iteration, now)
            for dataset_id in liveness.expired_ephemerals(self._soft, now, self._gc_timeout_s):
                removal = liveness.unread_ephemeral(self._state, self._soft, dataset_id, now,
                                                    self._gc_timeout_s)
                if removal is not None:
                    logger.info("ephemeral dataset %s was not read within %.0fs: removed",
                                dataset_id, self._gc_timeout_s)
                    self._apply(removal)
        self._journal.sync()
        self._pusher.push(pushes)
