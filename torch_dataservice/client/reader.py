"""The reader: one iteration of a job, pulled from its workers.

A heartbeat thread tells the dispatcher we are alive and learns the iteration's tasks (so
workers may come and go mid-epoch). Fetch threads, at most `max_outstanding_requests`, each
take a task round-robin, ask its worker for a batch of elements and queue it; a slot is only
freed when the consumer has taken the whole batch, so memory stays bounded by
`max_outstanding_requests` fetches. Elements are decoded in the consumer's thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc

from torch_dataservice.errors import RemoteError, is_retryable
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc, worker_pb2
from torch_dataservice.rpc import channel_to, retry, rpc_error_to_exception
from torch_dataservice.wire import codec, frame
from torch_dataservice.worker import local
from torch_dataservice.worker.service import SERVICE_NAME

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.1
FETCH_MAX_ELEMENTS = 512
FETCH_MAX_BYTES = 8 << 20
UNREACHABLE_BACKOFF_S = 0.2
DEFAULT_MAX_OUTSTANDING = 4


@dataclass
class _TaskState:
    info: common_pb2.TaskInfo
    in_use: bool = False
    ended: bool = False
    retry_at: float = 0.0
    failures: int = 0


@dataclass
class _Batch:
    payloads: deque = field(default_factory=deque)
    error: RemoteError | None = None


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
    ) -> None:
        self._dispatcher = dispatcher_pb2_grpc.DispatcherServiceStub(
            channel_to(dispatcher_address))
        self._target_workers = job_config.target_workers or "AUTO"
        self._trainer_id = trainer_id
        self._connect_timeout_s = connect_timeout_s
        job = retry(
            lambda: self._dispatcher.GetOrCreateJob(
                dispatcher_pb2.GetOrCreateJobRequest(config=job_config), timeout=10),
            description=f"creating a job at {dispatcher_address}", deadline_s=connect_timeout_s,
            )
        iteration = retry(
            lambda: self._dispatcher.GetOrCreateIteration(
                dispatcher_pb2.GetOrCreateIterationRequest(job_id=job.job_id,
                                                           repetition=repetition), timeout=10),
            description="creating an iteration", deadline_s=connect_timeout_s)
        self.iteration_id = iteration.iteration_id
        self.client_id = iteration.client_id
        self._max_outstanding = max_outstanding_requests or DEFAULT_MAX_OUTSTANDING
        self._lock = threading.Condition()
        self._tasks: dict[int, _TaskState] = {}
        self._task_order: list[int] = []
        self._next_task = itertools.count()
        self._iteration_finished = False
        self._in_flight = 0
        self._results: queue.Queue[_Batch] = queue.Queue()
        self._slots = threading.BoundedSemaphore(self._max_outstanding)
        self._current: _Batch | None = None
        self._fatal: BaseException | None = None
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._heartbeat_loop, daemon=True,
                                          name=f"reader-heartbeat-{self.client_id}")]
        self._threads += [
            threading.Thread(target=self._fetch_loop, daemon=True,
                             name=f"reader-fetch-{self.client_id}-{i}")
            for i in range(self._max_outstanding)
        ]
        self._heartbeat()
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ dispatcher
    def _heartbeat(self) -> None:
        try:
            response = self._dispatcher.ClientHeartbeat(
                dispatcher_pb2.ClientHeartbeatRequest(client_id=self.client_id), timeout=5)
        except grpc.RpcError as error:
            if is_retryable(error) or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return  # the dispatcher may be restarting: keep reading known workers
            with self._lock:
                self._fatal = rpc_error_to_exception(error, "client heartbeat")
                self._lock.notify_all()
            return
        with self._lock:
            if response.error:
                self._fatal = RuntimeError(response.error)
            listed = set()
            for info in response.tasks:
                if not self._wanted(info):
                    continue
                listed.add(info.task_id)
                if info.task_id not in self._tasks:
                    self._tasks[info.task_id] = _TaskState(info)
            for task_id, state in list(self._tasks.items()):
                if task_id not in listed and not state.in_use:
                    # Finished or its worker is gone: nothing more will come from it.
                    state.ended = True
            self._task_order = sorted(t for t, s in self._tasks.items() if not s.ended)
            self._iteration_finished = response.iteration_finished
            self._lock.notify_all()

    def _wanted(self, info: common_pb2.TaskInfo) -> bool:
        if self._target_workers == "LOCAL":
            return info.host_id == local.HOST_ID
        return True

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(HEARTBEAT_INTERVAL_S):
            self._heartbeat()

    # ------------------------------------------------------------------ fetching
    def _pick_task(self) -> _TaskState | None:
        now = time.monotonic()
        order = self._task_order
        if not order:
            return None
        start = next(self._next_task)
        for i in range(len(order)):
            state = self._tasks[order[(start + i) % len(order)]]
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
            finally:
                with self._lock:
                    state.in_use = False
                    self._in_flight -= 1
                    if batch is not None and (batch.payloads or batch.error):
                        self._results.put(batch)
                    else:
                        self._slots.release()
                    self._lock.notify_all()

    def _fetch(self, state: _TaskState) -> _Batch | None:
        request = worker_pb2.GetElementsRequest(
            task_id=state.info.task_id, client_id=self.client_id,
            max_elements=FETCH_MAX_ELEMENTS, max_bytes=FETCH_MAX_BYTES,
            trainer_id=self._trainer_id)
        address = state.info.worker_address
        try:
            service = local.lookup(address) if state.info.process_id == local.process_id() \
                else None
            if service is not None:
                header, payloads = service.fetch(request)
            else:
                raw = channel_to(address).unary_unary(
                    f"/{SERVICE_NAME}/GetElements",
                    request_serializer=worker_pb2.GetElementsRequest.SerializeToString,
                )(request, timeout=30)
                header, payloads = frame.parse_frame(raw)
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
            state.retry_at = time.monotonic() + UNREACHABLE_BACKOFF_S
            return None
        state.failures = 0
        batch = _Batch(deque(payloads))
        if header.has_error:
            batch.error = RemoteError(header.error.type, header.error.message,
                                      header.error.traceback)
        if header.end_of_sequence and not payloads:
            state.ended = True
        return batch

    # ------------------------------------------------------------------ consuming
    def _done(self) -> bool:
        if self._in_flight or not self._results.empty():
            return False
        if not self._iteration_finished:
            return False
        return all(state.ended or not state.in_use for state in self._tasks.values())

    def __iter__(self) -> IterationReader:
        return self

    def __next__(self) -> Any:
        while True:
            batch = self._current
            if batch is not None:
                if batch.payloads:
                    payload = batch.payloads.popleft()
                    if not batch.payloads and batch.error is None:
                        self._current = None
                        self._slots.release()
                    return codec.decode(payload)
                if batch.error is not None:
                    self._current = None
                    self._slots.release()
                    self.close()
                    raise batch.error
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

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._dispatcher.ReleaseIterationClient(
                dispatcher_pb2.ReleaseIterationClientRequest(client_id=self.client_id),
                timeout=2)
        except grpc.RpcError:
            pass  # the dispatcher collects silent clients itself

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
