"""WorkerServer: executor processes, a gRPC front, a data port, and a heartbeat to the
dispatcher."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import grpc

from torch_dataservice import auth
from torch_dataservice.config import PORT_PLACEHOLDER, WorkerConfig
from torch_dataservice.observability.metrics import Collector, MetricsEndpoint, new_registry
from torch_dataservice.rpc import WORKER_SERVICE_NAME, is_version_mismatch, overload_backoff_s
from torch_dataservice.serving import BackgroundLoop, Health, advertised_host, start_grpc_server
from torch_dataservice.wire import inprocess
from torch_dataservice.worker import metrics
from torch_dataservice.worker.cache_index import WorkerCache
from torch_dataservice.worker.data_port import DataPort
from torch_dataservice.worker.dispatcher_client import CachedSplits, DispatcherClient
from torch_dataservice.worker.service import WorkerService
from torch_dataservice.worker.tasks import TaskManager

logger = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 10.0
DRAIN_IDLE_S = 10.0  # a task nobody read for this long holds nothing a reader waits for
# What the dispatcher answers to a worker it will never accept as it is: a bad or unlisted
# address, another version, a wrong token. Retrying cannot help: the worker exits.
REFUSAL_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def worker_address(config: WorkerConfig, port: int) -> str:
    """What the dispatcher tells clients to dial: `worker_address` with `%port%` filled in, or
    this host's advertised name (never a wildcard, see serving.advertised_host) and `port`."""
    if config.worker_address:
        return config.worker_address.replace(PORT_PLACEHOLDER, str(port))
    dispatcher_host = config.dispatcher_address.rpartition(":")[0]
    host = advertised_host(config.host, dispatcher_host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class WorkerRefusedError(RuntimeError):
    """The dispatcher refused this worker (e.g. not on its fixed worker list)."""


class WorkerServer:
    """A worker serving elements on `config.host:config.port` (0 = a free port).

    `start()` returns once the worker registered with the dispatcher, or after a few seconds
    if the dispatcher is not reachable yet (registration goes on in the background). Its
    gRPC health service says SERVING once the dispatcher accepted it, NOT_SERVING while it
    drains (`drain()`, what SIGTERM does in the CLI).
    """

    def __init__(self, config: WorkerConfig, start: bool = True,
                 cached_splits: CachedSplits | None = None) -> None:
        self._config = config
        self._server: grpc.Server | None = None
        self._port = config.port
        self._address = ""
        self._registered = threading.Event()
        self._stopped = threading.Event()
        self._health = Health(WORKER_SERVICE_NAME)
        self.refused: str | None = None
        self._tasks: TaskManager | None = None
        self._heartbeat: BackgroundLoop | None = None
        self._data_port: DataPort | None = None
        self._metrics: MetricsEndpoint | None = None
        # `cached_splits`: the splits held cached here, for split affinity (dispatcher_client);
        # by default what this worker's own cache() store holds.
        self._dispatcher = DispatcherClient(config, self._stopped,
                                            cached_splits or self._held_in_cache)
        self._dispatcher.flush = self._send_heartbeat
        self._beat_lock = threading.Lock()  # the loop's beats and flushes, one at a time
        if start:
            self.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def port(self) -> int:
        return self._port

    @property
    def data_port(self) -> int:
        """The TCP port elements are served on besides gRPC (0 before start)."""
        return self._data_port.port if self._data_port is not None else 0

    @property
    def registered(self) -> bool:
        """The dispatcher accepted this worker's registration."""
        return self._registered.is_set()

    @property
    def config(self) -> WorkerConfig:
        return self._config

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on (None: metrics are off)."""
        return self._metrics.port if self._metrics is not None else None

    def _held_in_cache(self) -> Mapping[str, Sequence[int]]:
        return self._tasks.cache.cached_splits() if self._tasks is not None else {}

    @property
    def cache(self) -> WorkerCache | None:
        """The worker's `cache()` store, figures and `cached_splits()` (None before start)."""
        return self._tasks.cache if self._tasks is not None else None

    @property
    def service(self) -> WorkerService | None:
        return self._service if self._server is not None else None

    def start(self) -> None:
        if self._server is not None:
            return
        auth.check_bind(self._config.host, self._config.tls)  # before executors start
        self._tasks = TaskManager(
            self._dispatcher, self._config.effective_num_processes,
            split_prefetch=self._config.split_prefetch,
            executor_torch_threads=self._config.executor_torch_threads,
            cross_trainer_cache_bytes=self._config.cross_trainer_cache_bytes)
        try:
            self._tasks.start()  # spawn executors before gRPC starts its threads
            self._service = WorkerService(self._tasks, self._registered.is_set)
            self._server, self._port = start_grpc_server(
                self._register_services, self._config.host, self._config.port,
                tls=self._config.tls)
            self._address = self._dispatcher.address = worker_address(self._config, self._port)
            inprocess.register(self._address, self._service)
            # Elements also travel over a plain socket: gRPC caps big payloads
            # (worker/data_port.py).
            self._data_port = DataPort(self._service.fetch, self._registered.is_set,
                                       self._config.host, port=self._config.data_port,
                                       tls=self._config.tls,
                                       max_connections=self._config.data_port_max_connections)
            self._data_port.on_sent = self._service.counters.sent
            self._data_port.start()
            self._start_metrics()
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

    def _register_services(self, server: grpc.Server) -> None:
        assert self._service is not None
        self._service.register(server)
        self._health.register(server)

    def _start_metrics(self) -> None:
        if self._config.metrics_port is None or self._tasks is None:
            return
        registry = new_registry()
        registry.register(Collector(metrics.collector(
            self._service.counters, self._tasks.stages, self._tasks.cache,
            self._tasks.buffered_elements)))
        self._metrics = MetricsEndpoint(registry, self._config.host, self._config.metrics_port)
        logger.info("worker metrics at %s", self._metrics.url)

    def _release(self, grace_s: float) -> None:
        """Stop serving (replies under way get `grace_s`), then the data port and executors."""
        if self._server is not None:
            self._health.shutdown()
            inprocess.unregister(self._address)
            self._server.stop(grace=grace_s).wait(5)
            self._server = None
        if self._data_port is not None:
            self._data_port.stop()
            self._data_port = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tasks is not None:
            self._tasks.close()

    def _send_heartbeat(self) -> None:
        with self._beat_lock:
            self._beat()

    def _beat(self) -> None:
        if self.refused is not None or self._tasks is None:
            return
        data_port = self._data_port
        heartbeat = self._heartbeat
        try:
            response = self._dispatcher.heartbeat(
                task_ids=self._tasks.task_ids(),
                load=metrics.load(self._service.counters, self._tasks.stages, self._tasks.cache,
                                  buffered=self._tasks.buffered_elements(),
                                  processes=self._tasks.num_executors),
                data_port=data_port.port if data_port is not None else 0,
                data_socket=data_port.socket_path if data_port is not None else "")
        except grpc.RpcError as error:
            backoff = overload_backoff_s(error, f"worker {self._address} heartbeat")
            if backoff is not None:  # overload: the next beat no sooner than it was due
                if heartbeat is not None:
                    heartbeat.interval_s = max(heartbeat.interval_s, backoff)
                return
            details = error.details() or ""
            tls = (auth.plaintext_against_tls(details)
                   if error.code() == grpc.StatusCode.UNAVAILABLE and "Socket closed" in details
                   else None)
            if error.code() in REFUSAL_CODES or tls is not None:
                kind = "version mismatch: " if is_version_mismatch(error) else ""
                self.refused = tls or f"{kind}{error.code().name}: {details}"
                logger.error("the dispatcher refused this worker: %s", self.refused)
                self._stopped.set()
                return
            raise
        if heartbeat is not None:  # as the dispatcher asks (dispatcher/cadence.py)
            heartbeat.interval_s = (response.next_heartbeat_ms
                                    or self._config.effective_heartbeat_interval_ms) / 1000
        for task in response.new_tasks:
            self._tasks.add(task)
        for task_id in response.tasks_to_delete:
            self._tasks.delete(task_id)
        if not self._registered.is_set() and not self._dispatcher.draining.is_set():
            self._health.set_serving(True)
            logger.info("worker %s registered with the dispatcher at %s (index %d): serving "
                        "(gRPC port %d, data port %d)", self._address,
                        self._config.dispatcher_address, response.worker_index, self._port,
                        self.data_port)
        self._registered.set()

    def drain(self, stop: threading.Event | None = None) -> None:
        """Leave gracefully (SIGTERM in the CLI): take no new task or split, serve what this
        worker holds for up to `drain_timeout_s`, then leave: the dispatcher requeues what was
        not delivered as if this worker had died (exactly once under DYNAMIC), and stop.
        `stop` set cuts the wait short."""
        if self._server is None or self._tasks is None:
            return
        timeout_s = self._config.drain_timeout_s
        self._dispatcher.draining.set()
        self._health.set_serving(False)
        self._tasks.stop_accepting()
        logger.info("worker %s draining: serving what it holds for up to %.0fs", self._address,
                    timeout_s)
        deadline = time.monotonic() + timeout_s
        held = self._tasks.serving(DRAIN_IDLE_S)
        while held and time.monotonic() < deadline and not (stop and stop.is_set()):
            time.sleep(0.1)
            held = self._tasks.serving(DRAIN_IDLE_S)
        if held:
            logger.warning("drain ended with task(s) %s still serving: handed back", held)
        if self._heartbeat is not None:
            self._heartbeat.stop()  # a heartbeat after leaving would register it again
        self._dispatcher.leave()
        self.stop()

    def stop(self) -> None:
        if self._server is None:
            return
        self._stopped.set()
        logger.info("worker %s stopping", self._address)
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
