"""WorkerServer: executor processes, a gRPC front, a data port, and a heartbeat to the
dispatcher."""

from __future__ import annotations

import logging
import random
import threading
import time

import grpc

from torch_dataservice import auth
from torch_dataservice.config import WorkerConfig
from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from torch_dataservice.rpc import channel_to, retry
from torch_dataservice.serving import BackgroundLoop, start_grpc_server
from torch_dataservice.wire import inprocess
from torch_dataservice.worker.data_port import DataPort
from torch_dataservice.worker.messages import FinishedSplit
from torch_dataservice.worker.service import WorkerService
from torch_dataservice.worker.split_feed import Split
from torch_dataservice.worker.tasks import TaskManager

logger = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 10.0


class WorkerRefusedError(RuntimeError):
    """The dispatcher refused this worker (e.g. not on its fixed worker list)."""


class WorkerServer:
    """A worker serving elements on `config.host:config.port` (0 = a free port).

    `start()` returns once the worker registered with the dispatcher, or after a few seconds
    if the dispatcher is not reachable yet (registration goes on in the background).
    """

    def __init__(self, config: WorkerConfig, start: bool = True) -> None:
        self._config = config
        self._uid = random.getrandbits(62)
        self._server: grpc.Server | None = None
        self._port = config.port
        self._address = ""
        self._registered = threading.Event()
        self._stopped = threading.Event()
        self.refused: str | None = None
        self._tasks: TaskManager | None = None
        self._heartbeat: BackgroundLoop | None = None
        self._data_port: DataPort | None = None
        self._dataset_cache: dict[str, common_pb2.DatasetDef] = {}
        self._dispatcher = dispatcher_pb2_grpc.DispatcherServiceStub(
            channel_to(config.dispatcher_address))
        if start:
            self.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def port(self) -> int:
        return self._port

    @property
    def config(self) -> WorkerConfig:
        return self._config

    @property
    def service(self) -> WorkerService | None:
        return self._service if self._server is not None else None

    def start(self) -> None:
        if self._server is not None:
            return
        auth.check_bind(self._config.host)  # before any executor process is started
        self._tasks = TaskManager(self._dataset, self._get_split, self._report_completed,
                                  self._config.effective_num_processes,
                                  forget_dataset=self._forget_dataset,
                                  split_prefetch=self._config.split_prefetch,
                                  executor_torch_threads=self._config.executor_torch_threads)
        self._tasks.cross_trainer_cache_bytes = self._config.cross_trainer_cache_bytes
        try:
            self._tasks.start()  # spawn executors before gRPC starts its threads
            self._service = WorkerService(self._tasks, self._registered.is_set)
            self._server, self._port = start_grpc_server(
                self._service.register, self._config.host, self._config.port)
            self._address = self._config.worker_address or f"{self._config.host}:{self._port}"
            inprocess.register(self._address, self._service)
            # Elements also travel over a plain socket: gRPC caps big payloads
            # (worker/data_port.py).
            self._data_port = DataPort(self._service.fetch, self._registered.is_set,
                                       self._config.host)
            self._data_port.start()
        except BaseException:  # undo a start that failed half-way: nothing stays behind
            self._release(grace_s=0)
            raise
        self._heartbeat = BackgroundLoop(
            "worker-heartbeat", self._config.effective_heartbeat_interval_ms / 1000,
            self._send_heartbeat)
        deadline = time.monotonic() + REGISTRATION_WAIT_S
        while time.monotonic() < deadline and self.refused is None:
            try:
                self._send_heartbeat()
                break
            except grpc.RpcError:
                time.sleep(0.1)
        self._heartbeat.start()
        logger.info("worker serving at %s", self._address)

    def _release(self, grace_s: float) -> None:
        """Stop serving (replies under way get `grace_s`), then the data port and executors."""
        if self._server is not None:
            inprocess.unregister(self._address)
            self._server.stop(grace=grace_s).wait(5)
            self._server = None
        if self._data_port is not None:
            self._data_port.stop()
            self._data_port = None
        if self._tasks is not None:
            self._tasks.close()

    def _deadline_s(self) -> float:
        return self._config.effective_dispatcher_timeout_ms / 1000

    def _send_heartbeat(self) -> None:
        if self.refused is not None or self._tasks is None:
            return
        request = dispatcher_pb2.WorkerHeartbeatRequest(
            worker_address=self._address, worker_uid=self._uid,
            current_tasks=self._tasks.task_ids(), host_id=inprocess.HOST_ID,
            process_id=inprocess.process_id())
        data_port = self._data_port
        if data_port is not None:
            request.data_port, request.data_socket = data_port.port, data_port.socket_path
        try:
            response = self._dispatcher.WorkerHeartbeat(request, timeout=5)
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.FAILED_PRECONDITION):
                self.refused = error.details()
                logger.error("the dispatcher refused this worker: %s", self.refused)
                self._stopped.set()
                return
            raise
        for task in response.new_tasks:
            self._tasks.add(task)
        for task_id in response.tasks_to_delete:
            self._tasks.delete(task_id)
        self._registered.set()

    def _dataset(self, dataset_id: str) -> common_pb2.DatasetDef:
        cached = self._dataset_cache.get(dataset_id)
        if cached is None:
            response = retry(
                lambda: self._dispatcher.GetDatasetDef(
                    dispatcher_pb2.GetDatasetDefRequest(dataset_id=dataset_id), timeout=10),
                description=f"fetching dataset {dataset_id}", deadline_s=self._deadline_s())
            cached = self._dataset_cache[dataset_id] = response.dataset
        return cached

    def _forget_dataset(self, dataset_id: str) -> None:
        self._dataset_cache.pop(dataset_id, None)

    def _get_split(self, task: common_pb2.TaskDef, repetition: int, replica: int,
                   request_id: int, finished: list[FinishedSplit],
                   max_splits: int = 1) -> list[Split]:
        """Up to `max_splits` next splits for `task`'s split feed (worker/split_feed.py), in
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
        response = retry(lambda: self._dispatcher.GetSplit(request, timeout=10),
                         description="GetSplit", deadline_s=self._deadline_s(),
                         stop=self._stopped)
        if response.end_of_splits:
            return []
        # A requeued split keeps its own (maybe older) repetition: see dispatcher/splits.py.
        return [Split(r.split_index, tuple(r.skip_offsets),
                      r.repetition if r.HasField("repetition") else repetition)
                for r in (response, *response.following)]

    def _report_completed(self, task_id: int) -> None:
        def report() -> None:
            request = dispatcher_pb2.WorkerUpdateRequest(
                worker_address=self._address, completed_tasks=[task_id])
            try:
                retry(lambda: self._dispatcher.WorkerUpdate(request, timeout=10),
                      description="WorkerUpdate", deadline_s=self._deadline_s(),
                      stop=self._stopped)
            except ServiceUnavailableError as error:
                logger.warning("could not report task %d complete: %s", task_id, error)

        threading.Thread(target=report, name="task-complete", daemon=True).start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._release(grace_s=0.5)

    def join(self, timeout: float | None = None) -> bool:
        """Block until `stop()` or until the dispatcher refused this worker."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> WorkerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
