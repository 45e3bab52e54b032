"""A reader's membership in its iteration: joining it, heartbeating, and the task table.

The dispatcher is told the reader is alive every HEARTBEAT_INTERVAL_S, or as often as its
last reply asked (a big fleet reports less often: dispatcher/cadence.py), with what it
acknowledged (client/delivery.py) and, for coordinated reads, where it is in the rounds
(client/rounds.py); the reply lists the iteration's tasks, so workers may come and go
mid-epoch. A reader declared silent (longer than worker_timeout_ms) learns which splits were
handed to the other readers meanwhile (`handed_again`: the consumer drops what it holds of
them). A reader released for silence (longer than job_gc_timeout_ms: a paused process) joins
again under DYNAMIC, and otherwise fails with ReaderReleasedError, naming the setting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from torch_dataservice import version
from torch_dataservice.client.delivery import Batch, Delivery
from torch_dataservice.client.transports import task_groups
from torch_dataservice.errors import ReaderReleasedError, is_retryable
from torch_dataservice.policies import TargetWorkers
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc, status_pb2
from torch_dataservice.rpc import channel_to, overload_backoff_s, retry, rpc_error_to_exception
from torch_dataservice.wire import inprocess

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.1
HEARTBEAT_TIMEOUT_S = 5
JOIN_TIMEOUT_S = 10


@dataclass
class TaskState:
    info: common_pb2.TaskInfo
    in_use: int = 0  # fetches in flight: at most two (client/reader.py, pipelined fetches)
    ended: bool = False
    retry_at: float = 0.0
    failures: int = 0
    # Pipelined fetches: the fetches started, the one whose reply header allows the next
    # fetch to start before it ends (-1: none), the first not yet handed to the consumer, and
    # the batches of later ones that ended first (queued in the order the fetches started).
    started: int = 0
    header_came: int = -1
    next_to_queue: int = 0
    ended_early: dict[int, Batch | None] = field(default_factory=dict)

    def fetch_ended(self, ticket: int, batch: Batch | None) -> list[Batch | None]:
        """Fetch `ticket` ended with `batch`: the batches now due to the consumer, in the
        order their fetches started (none while a fetch started before it is in flight)."""
        self.in_use -= 1
        self.ended_early[ticket] = batch
        due = []
        while self.next_to_queue in self.ended_early:
            due.append(self.ended_early.pop(self.next_to_queue))
            self.next_to_queue += 1
        return due


class RoundsHooks(Protocol):
    """What coordinated reads add to each heartbeat (called with the membership's lock held)."""

    def fill(self, request: dispatcher_pb2.ClientHeartbeatRequest) -> None: ...

    def apply(self, response: dispatcher_pb2.ClientHeartbeatResponse,
              tasks: dict[int, TaskState]) -> None: ...


class Membership:
    """Joins the iteration at construction; `heartbeat()` keeps the task table current."""

    def __init__(self, dispatcher_address: str, job_config: common_pb2.JobConfig,
                 repetition: int, connect_timeout_s: float, target_workers: TargetWorkers,
                 delivery: Delivery | None, at_least_latest: bool = False) -> None:
        self._stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(dispatcher_address))
        self._target_workers = target_workers
        self._delivery = delivery  # exactly-once DYNAMIC only
        self.rounds: RoundsHooks | None = None  # coordinated reads only
        # What status and the optimal-workers estimate need (observability/client.py).
        self.load: Callable[[], status_pb2.ClientLoad] | None = None
        self.down_since: float | None = None  # the dispatcher has not answered since
        try:
            job = retry(
                lambda: self._stub.GetOrCreateJob(
                    dispatcher_pb2.GetOrCreateJobRequest(
                        config=job_config, build=version.to_message(version.current())),
                    timeout=JOIN_TIMEOUT_S),
                description=f"creating a job at {dispatcher_address}",
                deadline_s=connect_timeout_s)
            iteration = retry(
                lambda: self._stub.GetOrCreateIteration(
                    dispatcher_pb2.GetOrCreateIterationRequest(
                        job_id=job.job_id, repetition=repetition,
                        at_least_latest=at_least_latest),
                    timeout=JOIN_TIMEOUT_S),
                description="creating an iteration", deadline_s=connect_timeout_s)
        except grpc.RpcError as error:  # a refusal (bad job config, unknown dataset): say why
            raise rpc_error_to_exception(error, "joining a job") from None
        self.iteration_id = iteration.iteration_id
        self.client_id = iteration.client_id
        self._job_id = job.job_id
        # The repetition joined (>= `repetition` with at_least_latest), and whether this reader
        # created its iteration (an empty one then means an empty dataset, not one that other
        # readers of the job consumed).
        self.repetition = iteration.repetition if at_least_latest else repetition
        self.created_iteration = iteration.created
        self.lock = threading.Condition()
        self.closed = threading.Event()
        self.tasks: dict[int, TaskState] = {}
        self.task_order: list[list[int]] = []  # task ids to read, best group first
        self.iteration_finished = False
        self.skipped_tasks = False  # some tasks are not read here (LOCAL)
        self.fatal: BaseException | None = None
        self._heartbeat_lock = threading.Lock()
        # As the join reply says (a big fleet's readers start stretched), until the next
        # heartbeat reply (or refusal) says otherwise.
        self.interval_s = iteration.next_heartbeat_ms / 1000 or HEARTBEAT_INTERVAL_S
        self._tasks_version = 0  # of the task list last received (0: none)
        self._listed: set[int] = set()  # the tasks it listed
        # When the last heartbeat the dispatcher answered was sent (time.monotonic()): after
        # a pause, the reader asks before it yields more (IterationReader._after_pause).
        self.answered_at = time.monotonic()
        # Splits handed to the job's other readers while this one was declared silent (a
        # paused process): the consumer drops what it holds of them before it yields more.
        self.handed_again: set[tuple[int, int]] | None = None

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.fatal = error
            self.lock.notify_all()

    def heartbeat(self) -> bool:
        """Report to the dispatcher and learn the tasks; False if it did not answer."""
        # One at a time (the rounds thread also beats when it stops): an older reply must not
        # be applied over a newer one.
        with self._heartbeat_lock:
            return self._beat()

    def heartbeat_loop(self) -> None:
        while not self.closed.wait(self.interval_s):
            self.heartbeat()

    def _beat(self) -> bool:
        sent_at = time.monotonic()
        request = dispatcher_pb2.ClientHeartbeatRequest(client_id=self.client_id,
                                                        known_tasks_version=self._tasks_version)
        if self.load is not None:
            request.load.CopyFrom(self.load())
        reports = self._delivery.report(request)[0] if self._delivery else {}
        if self.rounds is not None:
            with self.lock:
                self.rounds.fill(request)
        try:
            response = self._stub.ClientHeartbeat(request, timeout=HEARTBEAT_TIMEOUT_S)
        except grpc.RpcError as error:
            self.down_since = self.down_since or time.monotonic()
            if self._delivery:
                self._delivery.restore(reports)  # report them with the next heartbeat
            backoff = overload_backoff_s(error, f"client {self.client_id} heartbeat")
            if backoff is not None:  # overload: the next beat no sooner than it was due
                self.interval_s = max(self.interval_s, backoff)
                return False
            if is_retryable(error) or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False  # the dispatcher may be restarting: keep reading known workers
            if error.code() == grpc.StatusCode.NOT_FOUND and not self.closed.is_set():
                return self._rejoin()
            self.fail(rpc_error_to_exception(error, "client heartbeat"))
            return False
        self.down_since = None
        self.interval_s = response.next_heartbeat_ms / 1000 or HEARTBEAT_INTERVAL_S
        if response.declared_silent and self._delivery:
            keys = {(k.repetition, k.index) for k in response.handed_again}
            with self.lock:
                self.handed_again = (self.handed_again or set()) | keys
        # Not while the consumer has yet to drop what was handed again: a fence would count
        # what it holds of the lost tasks as taken (the next heartbeat fences).
        if self._delivery and response.lost_task_ids and self.handed_again is None:
            self._delivery.fence(response.lost_task_ids)
        if self._delivery and response.settled:
            self._delivery.forget_settled(response.settled)
        with self.lock:
            self._apply(response)
            self.answered_at = max(self.answered_at, sent_at)
            self.lock.notify_all()
        return True

    def _apply(self, response: dispatcher_pb2.ClientHeartbeatResponse) -> None:
        """The reply's task list into the task table (with the lock held)."""
        if response.error:
            self.fatal = RuntimeError(response.error)
        listed = self._listed  # as the last list had it, unless this reply has a new one
        if not response.tasks_unchanged:
            listed = self._listed = set()
            for info in response.tasks:
                if not self._wanted(info):
                    self.skipped_tasks = True
                    continue
                listed.add(info.task_id)
                if info.task_id not in self.tasks:
                    self.tasks[info.task_id] = TaskState(info)
        self._tasks_version = response.tasks_version
        for task_id, state in list(self.tasks.items()):
            if self._delivery and self._delivery.is_fenced(task_id):
                state.ended = True  # a fetch in flight brings nothing (Delivery.keep_new)
            elif task_id not in listed and not state.in_use:
                # Finished or its worker is gone: nothing more will come from it.
                state.ended = True
        self.task_order = task_groups(
            [s.info for s in self.tasks.values() if not s.ended], self._target_workers)
        if self.rounds is not None:
            self.rounds.apply(response, self.tasks)
        if response.tasks and not listed and self._target_workers == TargetWorkers.LOCAL \
                and not self.tasks and self.fatal is None:
            hosts = sorted({info.worker_address for info in response.tasks})
            self.fatal = ValueError(
                f"target_workers='LOCAL' (or 'AUTO' under static sharding) reads only "
                f"workers on this host ({inprocess.HOST_ID}), but the job's workers {hosts} "
                "run elsewhere")
        self.iteration_finished = response.iteration_finished

    def _wanted(self, info: common_pb2.TaskInfo) -> bool:
        if self.rounds is not None:
            return True  # every consumer must see the same task set
        if self._target_workers == TargetWorkers.LOCAL:
            return info.host_id == inprocess.HOST_ID
        return True

    def _rejoin(self) -> bool:
        """The dispatcher released this reader: it was silent for longer than
        job_gc_timeout_ms (a paused process, a debugger, a long checkpoint). Under DYNAMIC it
        joins the job's iteration again and goes on (what it received is remembered, so
        nothing is yielded twice); otherwise it fails, naming the setting."""
        released = (f"the dispatcher released this reader (client {self.client_id}): it did "
                    "not heartbeat for longer than job_gc_timeout_ms (a paused process?)")
        if self._delivery is None:
            self.fail(ReaderReleasedError(
                f"{released}; its iteration cannot be resumed under this job's sharding "
                "policy: start the dispatcher with a larger job_gc_timeout_ms "
                "(--job-gc-timeout-ms)"))
            return False
        try:
            iteration = self._stub.GetOrCreateIteration(
                dispatcher_pb2.GetOrCreateIterationRequest(job_id=self._job_id,
                                                           repetition=self.repetition),
                timeout=JOIN_TIMEOUT_S)
        except grpc.RpcError as error:
            if not is_retryable(error):
                self.fail(ReaderReleasedError(
                    str(rpc_error_to_exception(error, f"{released}; joining again"))))
            return False
        logger.warning("%s; it joined iteration %d again as client %d", released,
                       iteration.iteration_id, iteration.client_id)
        self.iteration_id, self.client_id = iteration.iteration_id, iteration.client_id
        self._tasks_version = 0  # the iteration may be a new one: list its tasks again
        return False

    def release(self) -> None:
        """Leave the iteration, reporting what was taken since the last heartbeat."""
        request = dispatcher_pb2.ReleaseIterationClientRequest(client_id=self.client_id)
        if self.load is not None:
            request.load.CopyFrom(self.load())
        if self._delivery:
            self._delivery.report(request)
        try:
            self._stub.ReleaseIterationClient(request, timeout=2)
        except grpc.RpcError:
            pass  # the dispatcher collects silent clients itself
