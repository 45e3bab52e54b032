"""The worker's side of the dispatcher: its heartbeat, its leave, the dataset definitions it
reads, the splits its tasks ask for and the tasks it reports complete. Every call has a
deadline (`dispatcher_timeout_ms`) and retries with backoff (rpc.retry) where a retry is safe.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import grpc

from torch_dataservice import version
from torch_dataservice.config import WorkerConfig
from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc, status_pb2
from torch_dataservice.rpc import channel_to, retry
from torch_dataservice.wire import inprocess
from torch_dataservice.wire.splits import HandedSplit, SplitKey, index_ranges
from torch_dataservice.worker.messages import FinishedSplit

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 5.0


CachedSplits = Callable[[], Mapping[str, Sequence[int]]]
ASKED_MEMORY = 256  # (task, repetition) pairs remembered as asked for already


class HeldReport:
    """The splits this worker holds cached (`cached_splits`: per dataset id, the split indices
    whose cache entries are complete), as heartbeats carry them (dispatcher/affinity.py): a
    version that moves when the set changes, and the set itself only while the dispatcher's
    acknowledged version differs (it restarted, or has not seen the change yet)."""

    def __init__(self, cached_splits: CachedSplits) -> None:
        self._cached_splits = cached_splits
        self._lock = threading.Lock()
        self._last: dict[str, list[int]] = {}
        self.version = 0
        self.acknowledged = 0

    def changed(self) -> bool:
        """Whether the dispatcher lacks the current set (asks `cached_splits`)."""
        current = {dataset_id: index_ranges(indices)
                   for dataset_id, indices in self._cached_splits().items() if indices}
        with self._lock:
            if current != self._last:
                self._last, self.version = current, self.version + 1
            return self.version != self.acknowledged

    def fill(self, request: dispatcher_pb2.WorkerHeartbeatRequest) -> None:
        pending = self.changed()
        with self._lock:
            request.held_version = self.version
            if pending:
                request.held_report = True
                request.held.extend(dispatcher_pb2.HeldSplits(dataset_id=d, ranges=r)
                                    for d, r in sorted(self._last.items()))

    def acknowledge(self, response: dispatcher_pb2.WorkerHeartbeatResponse) -> None:
        with self._lock:
            self.acknowledged = response.held_version

    def exchange(self, request: dispatcher_pb2.WorkerHeartbeatRequest,
                 send: Callable[[dispatcher_pb2.WorkerHeartbeatRequest],
                                dispatcher_pb2.WorkerHeartbeatResponse],
                 ) -> dispatcher_pb2.WorkerHeartbeatResponse:
        """Send a heartbeat with what it says of the held splits; once more at once, with
        the set, if the reply shows the dispatcher lacks it (it restarted: its first splits
        must not wait a heartbeat interval to go where they are cached). The last reply."""
        self.fill(request)
        response = send(request)
        self.acknowledge(response)
        if not request.held_report and self.changed():
            self.fill(request)
            response = send(request)
            self.acknowledge(response)
        return response


class DispatcherClient:
    """`address` is the worker's, set once it listens. `draining` set: no new split is asked
    for (a task ends once it served its stock), and such an end is not reported complete.

    `cached_splits` (None: nothing is reported): the splits this worker holds cached, sent
    in heartbeats when they change, so the dispatcher hands them back here (split affinity).
    `flush` (set by the server): send a heartbeat now. A task's first ask of a repetition
    sends one first when the held splits changed since the last, so that the epoch's first
    splits go where they are cached (the last ones of the epoch before completed moments ago).
    """

    def __init__(self, config: WorkerConfig, stopped: threading.Event,
                 cached_splits: CachedSplits | None = None) -> None:
        self._config = config
        self._stopped = stopped  # cuts retries short
        self._stub = dispatcher_pb2_grpc.DispatcherServiceStub(
            channel_to(config.dispatcher_address))
        self.uid = random.getrandbits(62)
        self.address = ""
        self.draining = threading.Event()
        self._drain_ended: set[int] = set()  # tasks ended by the drain, not by their data
        self._datasets: dict[str, common_pb2.DatasetDef] = {}
        self._held = HeldReport(cached_splits) if cached_splits is not None else None
        self.flush: Callable[[], None] | None = None
        self._asked: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._asked_lock = threading.Lock()
        self.split_cover_s = 0.0  # as the last GetSplit reply said (worker/split_budget.py)

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def _deadline_s(self) -> float:
        return self._config.effective_dispatcher_timeout_ms / 1000

    def heartbeat(self, *, task_ids: list[int], load: status_pb2.WorkerLoad,
                  data_port: int, data_socket: str) -> dispatcher_pb2.WorkerHeartbeatResponse:
        """One heartbeat (raises grpc.RpcError: the caller tells a refusal from an outage)."""
        request = dispatcher_pb2.WorkerHeartbeatRequest(
            worker_address=self.address, worker_uid=self.uid, current_tasks=task_ids,
            host_id=inprocess.HOST_ID, process_id=inprocess.process_id(),
            build=version.to_message(version.current()), load=load, data_port=data_port,
            data_socket=data_socket)
        if self._held is None:
            return self._stub.WorkerHeartbeat(request, timeout=5)
        return self._held.exchange(request,
                                   lambda r: self._stub.WorkerHeartbeat(r, timeout=5))

    def _first_ask(self, task_id: int, repetition: int) -> None:
        """Before a task's first split of `repetition`: the held splits reach the dispatcher
        first if they changed (see the class docstring). Other asks of it wait for that."""
        if self._held is None or self.flush is None:
            return
        with self._asked_lock:
            if (task_id, repetition) in self._asked:
                return
            self._asked[(task_id, repetition)] = None
            if len(self._asked) > ASKED_MEMORY:
                self._asked.popitem(last=False)
            if self._held.changed():
                try:
                    self.flush()
                except grpc.RpcError as error:  # the regular heartbeat sends them later
                    logger.warning("could not report held splits before task %d asks for "
                                   "splits: %s", task_id, error.code().name)

    def leave(self) -> None:
        request = dispatcher_pb2.WorkerHeartbeatRequest(
            worker_address=self.address, worker_uid=self.uid, leaving=True)
        try:
            self._stub.WorkerHeartbeat(request, timeout=LEAVE_TIMEOUT_S)
            logger.info("worker %s left the dispatcher", self.address)
        except grpc.RpcError as error:
            logger.warning("could not tell the dispatcher that this worker leaves (%s): it "
                           "will declare it dead after worker_timeout_ms", error.code().name)

    def dataset(self, dataset_id: str) -> common_pb2.DatasetDef:
        cached = self._datasets.get(dataset_id)
        if cached is None:
            response = retry(
                lambda: self._stub.GetDatasetDef(
                    dispatcher_pb2.GetDatasetDefRequest(dataset_id=dataset_id), timeout=10),
                description=f"fetching dataset {dataset_id}", deadline_s=self._deadline_s())
            cached = self._datasets[dataset_id] = response.dataset
        return cached

    def pipeline(self, dataset_id: str) -> bytes:
        """A dataset's pipeline bytes (what an executor is sent to run it)."""
        return self.dataset(dataset_id).pipeline

    def forget_dataset(self, dataset_id: str) -> None:
        self._datasets.pop(dataset_id, None)

    def get_split(self, task: common_pb2.TaskDef, *, repetition: int, replica: int,
                  request_id: int, finished: list[FinishedSplit],
                  max_splits: int = 1) -> list[HandedSplit]:
        """Up to `max_splits` next splits for `task`'s split stock (worker/task_state.py), in
        order, reporting the splits it finished; none at the end of `repetition`'s splits.

        Retried until the dispatcher answers (it may be restarting, or ask us to wait for
        requeued splits); the request id makes a retry return the same split.
        """
        request = dispatcher_pb2.GetSplitRequest(
            iteration_id=task.iteration_id, repetition=repetition, task_id=task.task_id,
            replica=replica, request_id=request_id + 1, max_splits=max_splits)
        for split_repetition, index, elements in finished:
            request.finished_splits.add(elements=elements).split.CopyFrom(
                common_pb2.SplitKey(repetition=split_repetition, index=index))
        self._first_ask(task.task_id, repetition)
        if self.draining.is_set():  # no new split: the task ends once it served its stock
            self._drain_ended.add(task.task_id)
            if not finished:
                return []
            request.report_only = True  # let what it finished settle before it leaves
        response = retry(lambda: self._stub.GetSplit(request, timeout=10),
                         description="GetSplit", deadline_s=self._deadline_s(),
                         stop=self._stopped)
        self.split_cover_s = response.split_cover_ms / 1000
        if response.end_of_splits:
            return []
        # A requeued split keeps its own (maybe older) repetition: see dispatcher/splits.py.
        return [HandedSplit(SplitKey(r.repetition if r.HasField("repetition") else repetition,
                                     r.split_index), tuple(r.skip_offsets))
                for r in (response, *response.following)]

    def report_completed(self, task_id: int) -> None:
        """Tell the dispatcher, on a thread of its own, that `task_id` reached its end."""
        if task_id in self._drain_ended:
            return  # ended early by the drain: the dispatcher requeues the rest when it leaves
        threading.Thread(target=self._report_completed, args=(task_id,), name="task-complete",
                         daemon=True).start()

    def _report_completed(self, task_id: int) -> None:
        request = dispatcher_pb2.WorkerUpdateRequest(
            worker_address=self.address, completed_tasks=[task_id])
        try:
            retry(lambda: self._stub.WorkerUpdate(request, timeout=10),
                  description="WorkerUpdate", deadline_s=self._deadline_s(), stop=self._stopped)
        except ServiceUnavailableError as error:
            logger.warning("could not report task %d complete: %s", task_id, error)
