"""The reader: one iteration of a job, pulled from its workers.

A heartbeat thread tells the dispatcher we are alive and learns the iteration's tasks (so
workers may come and go mid-epoch). Fetch threads, at most `max_outstanding_requests`, each
take a task round-robin, ask its worker for a batch of elements and queue it; a slot is only
freed when the consumer has taken the whole batch, so memory stays bounded by
`max_outstanding_requests` fetches. Elements are decoded in the consumer's thread.

Coordinated reads (`consumer_index` / `num_consumers`) use one fetch thread instead, asking for
round r, r+1, ... in order from task `tasks[r % len(tasks)]`, where `tasks` is the iteration's
task set sorted by id, fixed when the reader starts (the dispatcher adds no task to a
coordinated iteration once it has some, so every consumer sees the same set). A task at its end
leaves the set at the same round for every consumer (its worker answers end_of_sequence for
that round to all of them), and the iteration ends when no task is left. A task whose worker
was lost leaves at a round the dispatcher picks once every consumer is stopped on lost tasks
(dispatcher/coordinated.py `note_blocked`); rounds before it that fall on the lost task are
skipped.

target_workers: "LOCAL" reads only workers on this host; "AUTO" means LOCAL under static
sharding (FILE, DATA, FILE_OR_DATA, HINT) and every worker otherwise; "ANY" reads every worker.
How a worker is read, best first: a worker in this process by a direct call; a worker on this
host through its data port's Unix socket; any other through its data port over TCP
(worker/data_port.py, client/data_port.py); a worker without a data port over gRPC
(StreamElements). "ANY" skips the first two and takes the network path, as a remote trainer
would. A worker in this process that runs its pipelines on threads (`num_processes=0`) hands
its elements over as the objects its pipeline produced, not encoded (worker/local.py): the
consumer shares them with the pipeline, as with torch's DataLoader and `num_workers=0`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc

from torch_dataservice.client.data_port import DataPortError, DataPortPool
from torch_dataservice.errors import RemoteError, is_retryable
from torch_dataservice.observability.client import ClientStats, current_sink
from torch_dataservice.observability.waiting import Waiting, WaitReport
from torch_dataservice.policies import STATIC_POLICIES, ShardingPolicy
from torch_dataservice.proto import (
    common_pb2,
    dispatcher_pb2,
    dispatcher_pb2_grpc,
    status_pb2,
    worker_pb2,
)
from torch_dataservice.rpc import WORKER_SERVICE_NAME, channel_to, retry, rpc_error_to_exception
from torch_dataservice.wire import codec, frame, inprocess
from torch_dataservice.wire.inprocess import LocalElement

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.1
DONE_REPORT_S = 5.0  # coordinated reads: how long a consumer tries to say it read its last round
FETCH_MAX_ELEMENTS = 512
FETCH_MAX_BYTES = 8 << 20
UNREACHABLE_BACKOFF_S = 0.2
# An in-process worker that does not know a task yet gets it from the dispatcher's push within
# milliseconds: retry soon, or every epoch's first batch waits a whole backoff.
UNKNOWN_TASK_BACKOFF_S = 0.02
DEFAULT_MAX_OUTSTANDING = 4


@dataclass
class _TaskState:
    info: common_pb2.TaskInfo
    in_use: bool = False
    ended: bool = False
    retry_at: float = 0.0
    failures: int = 0


class _SplitReceived:
    """The offsets of one split received so far: every offset below `below`, and `extra`.

    Elements of a split arrive mostly in order, so this stays one int per split; the
    dispatcher's notice that a split is settled collapses it to one int whatever arrived.
    """

    __slots__ = ("below", "extra")

    def __init__(self) -> None:
        self.below = 0
        self.extra: set[int] | None = None

    def add(self, offset: int) -> bool:
        """Record `offset`; False if it was received already."""
        extra = self.extra
        if offset < self.below or (extra is not None and offset in extra):
            return False
        if offset != self.below:
            if extra is None:
                extra = self.extra = set()
            extra.add(offset)
            return True
        self.below += 1
        self._absorb()
        return True

    def settle(self, num_elements: int) -> None:
        """Every offset below `num_elements` was delivered (to this client or another)."""
        if num_elements > self.below:
            self.below = num_elements
            if self.extra is not None:
                self.extra = {o for o in self.extra if o >= num_elements} or None
            self._absorb()

    def _absorb(self) -> None:
        extra = self.extra
        while extra and self.below in extra:
            extra.remove(self.below)
            self.below += 1
        if not extra:
            self.extra = None


@dataclass(eq=False)  # identity: held in a WeakSet
class _Batch:
    payloads: deque = field(default_factory=deque)
    error: RemoteError | None = None
    borrow: bool = False  # payloads are ours alone: decode may build tensors over them
    # Exactly-once DYNAMIC: the (split key, offset) of each payload not yet yielded, in order;
    # an element is acknowledged to the dispatcher when the consumer takes it.
    tags: deque = field(default_factory=deque)
    task_id: int = 0
    nbytes: int = 0  # payload bytes received (stats)


# _fetch_round's answer when the task's worker was lost (coordinated reads).
_LOST = _Batch()


def task_groups(infos: list[common_pb2.TaskInfo], target_workers: str) -> list[list[int]]:
    """Task ids in the order fetch threads should prefer them: under "AUTO", workers in this
    process, then on this host, then the rest (a free local task is read before a remote
    one; remote ones are still read); otherwise one group. Each group is sorted by id."""
    if target_workers != "AUTO":
        return [sorted(info.task_id for info in infos)]
    groups: list[list[int]] = [[], [], []]
    for info in infos:
        rank = (0 if info.process_id == inprocess.process_id()
                else 1 if info.host_id == inprocess.HOST_ID else 2)
        groups[rank].append(info.task_id)
    return [sorted(group) for group in groups if group]


class IterationReader:
    """Iterator over one iteration of a job. Close it (or exhaust it) to release the worker."""

    def __init__(
        self,
        dispatcher_address: str,
        job_config: common_pb2.JobConfig,
        repetition: int,
        max_outstanding_requests: int | None,
        connect_timeout_s: float,
        trainer_id: str = "",
        consumer_index: int | None = None,
        at_least_latest: bool = False,
        stats: ClientStats | None = None,
    ) -> None:
        self._dispatcher = dispatcher_pb2_grpc.DispatcherServiceStub(
            channel_to(dispatcher_address))
        self._target_workers = job_config.target_workers or "AUTO"
        if self._target_workers == "AUTO" and job_config.sharding_policy in STATIC_POLICIES:
            self._target_workers = "LOCAL"  # static shards are read where they are made
        self._num_consumers = (job_config.num_consumers
                               if job_config.HasField("num_consumers") else None)
        if (consumer_index is None) != (self._num_consumers is None):
            raise ValueError("coordinated reads need both consumer_index and num_consumers, got "
                             f"consumer_index={consumer_index!r}, "
                             f"num_consumers={self._num_consumers!r}")
        self._consumer_index = consumer_index
        self._coordinated_tasks: list[int] | None = None  # fixed task set, sorted by id
        self._coordinated_finished = False
        # Coordinated reads losing workers: tasks the dispatcher says are lost, its removal
        # decisions (round, task ids) in order, and the round this consumer is stopped at.
        self._lost_tasks: set[int] = set()
        self._removals: list[tuple[int, frozenset[int]]] = []
        self._blocked_round: int | None = None
        self._consumer_done = False  # read its last round (reported with _blocked_round)
        self._heartbeat_lock = threading.Lock()
        self._skipped_tasks = False  # some tasks are not read here (LOCAL)
        self._trainer_id = trainer_id
        self._connect_timeout_s = connect_timeout_s
        # Figures (observability/client.py): a DataLoader reading on this thread made its own
        # stats the sink and counts batches and waiting itself; otherwise this reader does.
        sink = current_sink()
        self._stats = sink or stats or ClientStats()
        self._counts_consumer = sink is None
        self._received = [0, 0]  # this reader's elements and bytes (its iteration's share)
        # Saying what a long wait waits for (observability/waiting.py).
        self._address, self._wait_report = dispatcher_address, WaitReport()
        self._blocked_since: float | None = None  # the consumer's __next__ is blocked
        self._dispatcher_down_since: float | None = None
        self._reported_wait = 0.0
        try:
            job = retry(
                lambda: self._dispatcher.GetOrCreateJob(
                    dispatcher_pb2.GetOrCreateJobRequest(config=job_config), timeout=10),
                description=f"creating a job at {dispatcher_address}",
                deadline_s=connect_timeout_s)
            iteration = retry(
                lambda: self._dispatcher.GetOrCreateIteration(
                    dispatcher_pb2.GetOrCreateIterationRequest(
                        job_id=job.job_id, repetition=repetition,
                        at_least_latest=at_least_latest),
                    timeout=10),
                description="creating an iteration", deadline_s=connect_timeout_s)
        except grpc.RpcError as error:  # a refusal (bad job config, unknown dataset): say why
            raise rpc_error_to_exception(error, "joining a job") from None
        self.iteration_id = iteration.iteration_id
        self.client_id = iteration.client_id
        # The repetition joined (>= `repetition` with at_least_latest), and whether this reader
        # created its iteration (an empty one then means an empty dataset, not one that other
        # readers of the job consumed).
        self.repetition = iteration.repetition if at_least_latest else repetition
        self.created_iteration = iteration.created
        self._max_outstanding = max_outstanding_requests or DEFAULT_MAX_OUTSTANDING
        self._lock = threading.Condition()
        self._tasks: dict[int, _TaskState] = {}
        self._task_order: list[list[int]] = []  # task ids to read, best group first
        self._next_task = itertools.count()
        self._iteration_finished = False
        self._in_flight = 0
        self._results: queue.Queue[_Batch] = queue.Queue()
        self._slots = threading.BoundedSemaphore(self._max_outstanding)
        self._current: _Batch | None = None
        self._fatal: BaseException | None = None
        self._closed = threading.Event()
        self._data_ports = DataPortPool()
        # Exactly-once DYNAMIC (dispatcher/splits.py): the offsets received of every split
        # (compacted, see _SplitReceived), to drop an element handed again, and those not yet
        # reported to the dispatcher.
        self._exactly_once = (job_config.sharding_policy == ShardingPolicy.DYNAMIC
                              and not job_config.HasField("num_consumers"))
        self._received_lock = threading.Lock()
        self._seen: dict[tuple[int, int], _SplitReceived] = {}
        self._unreported: dict[tuple[int, int], list[int]] = {}
        # Elements the consumer took, not yet reported: (split key, offset), appended without
        # a lock by __next__ and drained by the heartbeat. What was received and not taken is
        # not acknowledged: if this reader dies, the dispatcher hands it to the job's others.
        self._acked: deque[tuple[tuple[int, int], int]] = deque()
        self._unacked_batches: weakref.WeakSet[_Batch] = weakref.WeakSet()
        # Lost tasks (their worker was declared dead, but may be a zombie still serving):
        # nothing from them is accepted any more, and every heartbeat says so.
        self._fenced: set[int] = set()
        self._threads = [threading.Thread(target=self._heartbeat_loop, daemon=True,
                                          name=f"reader-heartbeat-{self.client_id}")]
        if self._consumer_index is not None:
            self._threads.append(threading.Thread(
                target=self._coordinated_loop, daemon=True,
                name=f"reader-rounds-{self.client_id}"))
        else:
            self._threads += [
                threading.Thread(target=self._fetch_loop, daemon=True,
                                 name=f"reader-fetch-{self.client_id}-{i}")
                for i in range(self._max_outstanding)
            ]
        self._heartbeat()
        _readers.add(self)
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ dispatcher
    def _heartbeat(self) -> bool:
        """Report to the dispatcher and learn the tasks; False if it did not answer."""
        # One at a time (the rounds thread also beats when it stops): an older reply must not
        # be applied over a newer one.
        with self._heartbeat_lock:
            return self._beat()

    def _take_reports(self) -> dict[tuple[int, int], list[int]]:
        """The acknowledgements to send now (call with `_received_lock` held)."""
        unreported, self._unreported = self._unreported, {}
        while True:
            try:
                key, offset = self._acked.popleft()
            except IndexError:
                return unreported
            unreported.setdefault(key, []).append(offset)

    def _fence(self, task_ids: Any) -> None:
        """Accept nothing more from lost tasks; what this reader holds of them counts as
        received now (it will yield it): it is in the next heartbeat, with the fence."""
        with self._received_lock:
            new = set(task_ids) - self._fenced
            if not new:
                return
            self._fenced.update(new)
            for batch in list(self._unacked_batches):
                if batch.task_id in new:
                    while True:
                        try:
                            key, offset = batch.tags.popleft()
                        except IndexError:
                            break
                        self._unreported.setdefault(key, []).append(offset)

    def _beat(self) -> bool:
        with self._received_lock:  # what was taken from a task before it was fenced is in
            unreported = self._take_reports()
            fenced = sorted(self._fenced)
        request = dispatcher_pb2.ClientHeartbeatRequest(client_id=self.client_id,
                                                        fenced_tasks=fenced, load=self._load())
        if self._consumer_index is not None:
            request.consumer_index = self._consumer_index
            with self._lock:
                if self._blocked_round is not None:
                    request.blocked_round = self._blocked_round
                    request.removals_seen = len(self._removals)
                    request.consumer_done = self._consumer_done
        for (repetition, index), offsets in unreported.items():
            request.received.add(split=common_pb2.SplitKey(repetition=repetition, index=index),
                                 offsets=offsets)
        try:
            response = self._dispatcher.ClientHeartbeat(request, timeout=5)
        except grpc.RpcError as error:
            self._dispatcher_down_since = self._dispatcher_down_since or time.monotonic()
            with self._received_lock:  # report them with the next heartbeat
                for key, offsets in unreported.items():
                    self._unreported.setdefault(key, []).extend(offsets)
            if is_retryable(error) or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False  # the dispatcher may be restarting: keep reading known workers
            with self._lock:
                self._fatal = rpc_error_to_exception(error, "client heartbeat")
                self._lock.notify_all()
            return False
        self._dispatcher_down_since = None
        if response.lost_task_ids and self._exactly_once:
            self._fence(response.lost_task_ids)
        if response.settled:
            with self._received_lock:
                for settled in response.settled:
                    received = self._seen.get((settled.split.repetition, settled.split.index))
                    if received is not None:
                        received.settle(settled.num_elements)
        with self._lock:
            if response.error:
                self._fatal = RuntimeError(response.error)
            listed = set()
            for info in response.tasks:
                if not self._wanted(info):
                    self._skipped_tasks = True
                    continue
                listed.add(info.task_id)
                if info.task_id not in self._tasks:
                    self._tasks[info.task_id] = _TaskState(info)
            for task_id, state in list(self._tasks.items()):
                if task_id in self._fenced:
                    state.ended = True  # a fetch in flight brings nothing (_keep_new)
                elif task_id not in listed and not state.in_use:
                    # Finished or its worker is gone: nothing more will come from it.
                    state.ended = True
            self._task_order = task_groups(
                [s.info for s in self._tasks.values() if not s.ended], self._target_workers)
            self._lost_tasks = {info.task_id for info in response.tasks if info.lost}
            if len(response.removals) > len(self._removals):
                self._removals = [(r.round, frozenset(r.task_ids)) for r in response.removals]
            if self._consumer_index is not None and self._coordinated_tasks is None \
                    and self._tasks:
                self._coordinated_tasks = sorted(self._tasks)
            if response.tasks and not listed and self._target_workers == "LOCAL" \
                    and not self._tasks and self._fatal is None:
                hosts = sorted({info.worker_address for info in response.tasks})
                self._fatal = ValueError(
                    f"target_workers='LOCAL' (or 'AUTO' under static sharding) reads only "
                    f"workers on this host ({inprocess.HOST_ID}), but the job's workers {hosts} "
                    "run elsewhere")
            self._iteration_finished = response.iteration_finished
            self._lock.notify_all()
        return True

    def _load(self) -> status_pb2.ClientLoad:
        """What the dispatcher's status and optimal-workers estimate need from this reader."""
        stats, blocked = self._stats, self._blocked_since
        waiting = time.monotonic() - blocked if blocked and self._counts_consumer else 0.0
        # The wait under way counts too; a total never goes down (a restart would, to 0).
        self._reported_wait = max(self._reported_wait, stats.wait_seconds + waiting)
        return status_pb2.ClientLoad(rank=max(0, stats.rank), batches=stats.batches,
                                     wait_seconds=self._reported_wait,
                                     elements=self._received[0], bytes=self._received[1])

    def _wanted(self, info: common_pb2.TaskInfo) -> bool:
        if self._consumer_index is not None:
            return True  # every consumer must see the same task set
        if self._target_workers == "LOCAL":
            return info.host_id == inprocess.HOST_ID
        return True

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(HEARTBEAT_INTERVAL_S):
            self._heartbeat()
            blocked, now = self._blocked_since, time.monotonic()
            if self._wait_report.due(blocked, now) and blocked is not None:
                self._wait_report.report(self._waiting(), now - blocked, not self._received[0])

    def _waiting(self) -> Waiting:
        """What this reader is waiting on, for the log line of a long wait."""
        now = time.monotonic()
        down = self._dispatcher_down_since
        waiting = Waiting(self._address, self.iteration_id,
                          dispatcher_down_s=now - down if down is not None else 0.0)
        with self._lock:
            states = [s for s in self._tasks.values() if not s.ended]
        for state in states:
            target = self._data_target(state.info) or ("grpc",)
            via = ":".join(str(part) for part in target)
            (waiting.unreachable if state.failures else waiting.serving).append(
                f"worker {state.info.worker_address}" + (f" (via {via})" if state.failures
                                                         else ""))
        if not states and not down:
            from torch_dataservice.observability.status_text import fetch_status

            try:
                waiting.workers_registered = len(fetch_status(self._address, 2.0).workers)
            except grpc.RpcError:
                pass
        return waiting

    # ------------------------------------------------------------------ fetching
    def _pick_task(self) -> _TaskState | None:
        """A task to fetch from: round robin within the best group that has one free."""
        now = time.monotonic()
        start = next(self._next_task)
        for group in self._task_order:
            for i in range(len(group)):
                state = self._tasks[group[(start + i) % len(group)]]
                if not state.in_use and not state.ended and state.retry_at <= now:
                    return state
        return None

    def _fetch_loop(self) -> None:
        while not self._closed.is_set():
            if not self._slots.acquire(timeout=0.2):
                continue
            with self._lock:
                state = self._pick_task()
                if state is None:
                    self._lock.wait(0.05)
                    self._slots.release()
                    continue
                state.in_use = True
                self._in_flight += 1
            batch: _Batch | None = None
            try:
                batch = self._fetch(state)
            except Exception as error:  # raised by an in-process worker: the consumer's now
                with self._lock:
                    self._fatal = error
            finally:
                with self._lock:
                    state.in_use = False
                self._settle(batch)

    def _settle(self, batch: _Batch | None) -> None:
        """A fetch ended: queue what it brought, or give its slot back if it brought nothing."""
        with self._lock:
            self._in_flight -= 1
            if batch is not None and batch.payloads:
                self._received[0] += len(batch.payloads)
                self._received[1] += batch.nbytes
                self._stats.received(self._tasks[batch.task_id].info.worker_address,
                                     len(batch.payloads), batch.nbytes)
            if batch is not None and (batch.payloads or batch.error):
                self._results.put(batch)
            else:
                self._slots.release()
            self._lock.notify_all()

    def _fetch(self, state: _TaskState, round_index: int | None = None) -> _Batch | None:
        request = worker_pb2.GetElementsRequest(
            task_id=state.info.task_id, client_id=self.client_id,
            max_elements=FETCH_MAX_ELEMENTS, max_bytes=FETCH_MAX_BYTES,
            trainer_id=self._trainer_id)
        if round_index is not None:
            request.consumer_index = self._consumer_index
            request.round_index = round_index
            request.max_elements = 1
        address = state.info.worker_address
        target = None
        try:
            service = inprocess.lookup(address) if (
                state.info.process_id == inprocess.process_id()
                and self._target_workers != "ANY") else None
            if service is not None:
                header, payloads = service.fetch(request, local=True)
                # Objects of an executor thread (LocalElement), or payloads: big ones are the
                # worker's shared-memory segments, handed to us alone unless a cross-trainer
                # cache serves the same payload to every trainer.
                borrow = not self._trainer_id
            elif (target := self._data_target(state.info)) is not None:
                # Each big payload arrives in a buffer of its own: the tensors' memory.
                header, payloads = self._data_ports.fetch(target, request)
                borrow = True
            else:
                # Streamed in chunks and assembled into one buffer per big payload, which
                # decode then uses as the tensors' memory (wire/frame.py).
                call = channel_to(address).unary_stream(
                    f"/{WORKER_SERVICE_NAME}/StreamElements",
                    request_serializer=worker_pb2.GetElementsRequest.SerializeToString,
                )(request, timeout=30)
                try:
                    header, payloads = frame.assemble_frame(call)
                except BaseException:
                    call.cancel()
                    raise
                borrow = True
        except grpc.RpcError as error:
            if is_retryable(error) or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                state.failures += 1
                state.retry_at = time.monotonic() + min(
                    UNREACHABLE_BACKOFF_S * state.failures, 2.0)
                return None
            with self._lock:
                self._fatal = rpc_error_to_exception(error, f"reading from worker {address}")
            return None
        except LookupError:
            state.retry_at = time.monotonic() + UNKNOWN_TASK_BACKOFF_S
            return None
        except (OSError, EOFError):
            if target is None:
                raise  # from an in-process worker: not a connection problem
            # Unreachable, reset, timed out or not ready: like a retryable gRPC error.
            state.failures += 1
            state.retry_at = time.monotonic() + min(UNREACHABLE_BACKOFF_S * state.failures, 2.0)
            return None
        except DataPortError as error:
            with self._lock:
                self._fatal = RuntimeError(f"reading from worker {address}: {error}")
            return None
        state.failures = 0
        kept, tags = self._keep_new(state.info.task_id, header, payloads)
        batch = _Batch(deque(kept), borrow=borrow, tags=deque(tags),
                       task_id=state.info.task_id,
                       nbytes=sum(inprocess.payload_nbytes(p) for p in kept))
        if tags:
            with self._received_lock:
                if state.info.task_id in self._fenced:  # fenced while this fetch was out
                    batch.payloads.clear()
                    batch.tags.clear()
                else:
                    self._unacked_batches.add(batch)
        if header.has_error:
            batch.error = RemoteError(header.error.type, header.error.message,
                                      header.error.traceback)
        if header.end_of_sequence and not payloads:
            state.ended = True
        return batch

    def _data_target(self, info: common_pb2.TaskInfo) -> tuple | None:
        """Where to reach `info`'s worker's data port, or None (gRPC): its Unix socket if it
        runs on this host (unless target_workers is "ANY"), else its TCP port."""
        if (info.data_socket and info.host_id == inprocess.HOST_ID
                and self._target_workers != "ANY" and os.path.exists(info.data_socket)):
            return ("unix", info.data_socket)
        if info.data_port:
            host = info.worker_address.rsplit(":", 1)[0].strip("[]")
            return ("tcp", host, info.data_port)
        return None

    def _keep_new(self, task_id: int, header: worker_pb2.ElementBatchHeader,
                  payloads: list) -> tuple[list, list]:
        """Exactly-once DYNAMIC: drop elements already received (a split handed again after
        its worker died) or sent by a fenced task (a zombie worker); the others, and their
        tags to acknowledge when the consumer takes them (None: an untracked element)."""
        if not self._exactly_once or not payloads:
            return payloads, []
        kept: list = []
        tags: list = []
        with self._received_lock:
            if task_id in self._fenced:
                return [], []
            for info, payload in zip(header.elements, payloads, strict=False):
                if info.has_split:
                    key = (info.split.repetition, info.split.index)
                    received = self._seen.get(key)
                    if received is None:
                        received = self._seen[key] = _SplitReceived()
                    if not received.add(info.offset):
                        continue
                    tags.append((key, info.offset))
                else:
                    tags.append(None)
                kept.append(payload)
        return kept, tags

    def _coordinated_loop(self) -> None:
        """Coordinated reads: one fetch at a time, in round order (see the module docstring)."""
        round_index = 0
        active: list[int] | None = None
        applied = 0  # removals of lost tasks applied to `active`
        while not self._closed.is_set():
            if active is None:
                with self._lock:
                    if self._coordinated_tasks is None:
                        self._lock.wait(0.05)
                        continue
                    active = list(self._coordinated_tasks)
            with self._lock:
                removals = list(self._removals)
            while applied < len(removals) and removals[applied][0] <= round_index:
                active = [t for t in active if t not in removals[applied][1]]
                applied += 1
                if not active:
                    self._fail(RuntimeError(
                        "coordinated reads: every worker of the job was lost"))
                    return
            if not active:
                with self._lock:
                    # Tell the dispatcher where we ended, for good: a consumer still stopped
                    # on a lost task must not wait for this one (see _wait_for_removal).
                    self._blocked_round, self._consumer_done = round_index, True
                deadline = time.monotonic() + DONE_REPORT_S
                while not self._heartbeat() and time.monotonic() < deadline \
                        and self._fatal is None and not self._closed.wait(0.2):
                    pass
                with self._lock:
                    self._coordinated_finished = True
                    self._lock.notify_all()
                return
            task_id = active[round_index % len(active)]
            if any(task_id in tasks for _, tasks in removals[applied:]):
                round_index += 1  # the lost task's round: skipped by all who had not read it
                continue
            if not self._slots.acquire(timeout=0.2):
                continue
            state = self._tasks[task_id]
            with self._lock:
                self._in_flight += 1
            batch: _Batch | None = None
            try:
                batch = self._fetch_round(state, round_index)
            finally:
                self._settle(None if batch is _LOST else batch)
            if batch is _LOST:
                if not self._wait_for_removal(task_id, round_index, applied):
                    return
                continue
            if batch is None:
                return  # closed or failed (self._fatal is set)
            if batch.error is not None:
                return
            if batch.payloads:
                round_index += 1
            else:  # end of this task: the same round goes to the next task, for everyone
                active.remove(state.info.task_id)

    def _wait_for_removal(self, task_id: int, round_index: int, applied: int) -> bool:
        """Stopped at `round_index` on a lost task: wait until the dispatcher decides when it
        leaves (once every consumer is stopped on lost tasks). False if closed or failed."""
        deadline = time.monotonic() + self._connect_timeout_s
        with self._lock:
            self._blocked_round = round_index
        try:
            self._heartbeat()  # report now rather than at the next beat
            with self._lock:
                while not any(task_id in tasks for _, tasks in self._removals[applied:]):
                    if self._closed.is_set() or self._fatal is not None:
                        return False
                    if time.monotonic() > deadline:
                        self._fatal = RuntimeError(
                            f"coordinated read of round {round_index}: the worker of task "
                            f"{task_id} was lost, and not every consumer of the job reached "
                            f"a lost worker's round within {self._connect_timeout_s:.0f}s (is "
                            "every consumer still reading?)")
                        self._lock.notify_all()
                        return False
                    self._lock.wait(0.1)
            return True
        finally:
            with self._lock:
                self._blocked_round = None

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._fatal = error
            self._lock.notify_all()

    def _fetch_round(self, state: _TaskState, round_index: int) -> _Batch | None:
        """This consumer's element of `round_index` from `state`'s task (empty batch: its end)."""
        failing_since: float | None = None
        while not self._closed.is_set():
            if state.info.task_id in self._lost_tasks:
                return _LOST
            now = time.monotonic()
            if state.retry_at > now:
                self._closed.wait(state.retry_at - now)
                continue
            try:
                batch = self._fetch(state, round_index)
            except Exception as error:  # raised by an in-process worker
                with self._lock:
                    self._fatal = error
                return None
            if self._fatal is not None:
                return None
            if batch is None:  # worker unreachable: keep trying, but not forever
                failing_since = failing_since or now
                if now - failing_since > self._connect_timeout_s:
                    with self._lock:
                        self._fatal = RuntimeError(
                            f"coordinated read of round {round_index}: worker "
                            f"{state.info.worker_address} unreachable for "
                            f"{now - failing_since:.0f}s; coordinated reads cannot continue "
                            "without one of their workers")
                    return None
                continue
            failing_since = None
            if batch.payloads or batch.error is not None or state.ended:
                return batch
        return None

    # ------------------------------------------------------------------ consuming
    def _done(self) -> bool:
        if self._in_flight or not self._results.empty():
            return False
        if self._consumer_index is not None:
            return self._coordinated_finished
        if self._skipped_tasks:
            # Tasks read elsewhere never finish here: done when every task we read ended.
            return bool(self._tasks) and all(s.ended for s in self._tasks.values())
        if not self._iteration_finished:
            return False
        return all(state.ended or not state.in_use for state in self._tasks.values())

    def __iter__(self) -> IterationReader:
        return self

    def __next__(self) -> Any:
        blocked = None  # since when this call waits for a batch (stats: seconds waiting)
        try:
            while True:
                batch = self._current
                if batch is not None:
                    if batch.payloads:
                        payload = batch.payloads.popleft()
                        if batch.tags:
                            self._acknowledge(batch)
                        if not batch.payloads and batch.error is None:
                            self._current = None
                            self._slots.release()
                        if self._counts_consumer:
                            self._stats.batches += 1
                        if type(payload) is LocalElement:
                            return payload.take()  # the object itself: no decode, no copy
                        return codec.decode(payload, borrow=batch.borrow)
                    if batch.error is not None:
                        self._current = None
                        self._slots.release()
                        self.close()
                        raise batch.error
                if blocked is None:
                    blocked = time.perf_counter()
                    self._blocked_since = time.monotonic()  # a long wait is reported
                try:
                    self._current = self._results.get(timeout=0.05)
                    continue
                except queue.Empty:
                    pass
                with self._lock:
                    if self._fatal is not None:
                        fatal = self._fatal
                        self.close()
                        raise fatal
                    if self._done() and self._results.empty():
                        self.close()
                        raise StopIteration
        finally:
            self._blocked_since = None
            if blocked is not None and self._counts_consumer:
                self._stats.wait_seconds += time.perf_counter() - blocked

    def stats(self) -> dict[str, Any]:
        """Batches, elements, bytes, seconds waiting, per worker (observability/client.py)."""
        return self._stats.as_dict()

    def _acknowledge(self, batch: _Batch) -> None:
        """The consumer took the batch's next element: acknowledge it (exactly-once)."""
        try:
            tag = batch.tags.popleft()
        except IndexError:  # fenced meanwhile: acknowledged then
            return
        if tag is not None:
            self._acked.append(tag)

    def close(self) -> None:
        """Release the iteration; this reader's threads end on their own within about a second
        (fetches are long polls), and at interpreter exit `_close_readers` waits for them."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._data_ports.close()
        with self._received_lock:
            unreported = self._take_reports()
        request = dispatcher_pb2.ReleaseIterationClientRequest(client_id=self.client_id,
                                                               load=self._load())
        for (repetition, index), offsets in unreported.items():
            request.received.add(split=common_pb2.SplitKey(repetition=repetition, index=index),
                                 offsets=offsets)
        try:
            self._dispatcher.ReleaseIterationClient(request, timeout=2)
        except grpc.RpcError:
            pass  # the dispatcher collects silent clients itself

    def join(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic) for this reader's threads to end."""
        for thread in self._threads:
            if thread is not threading.current_thread() and thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


EXIT_JOIN_S = 5.0
# Every reader whose threads may still run. At exit they are closed and their threads joined
# before the interpreter finalizes: a thread still inside a gRPC or socket call then can abort
# the process ("terminate called without an active exception"), e.g. after a training loop
# broke out of an epoch.
_readers: weakref.WeakSet[IterationReader] = weakref.WeakSet()


@atexit.register
def _close_readers() -> None:
    readers = list(_readers)
    for reader in readers:
        try:
            reader.close()
        except Exception:  # exiting anyway: never turn a clean exit into a failure
            pass
    deadline = time.monotonic() + EXIT_JOIN_S
    for reader in readers:
        reader.join(deadline)
