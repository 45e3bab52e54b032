"""DispatchServer: the dispatcher as an object a test, a script or the CLI can start and stop."""

from __future__ import annotations

import logging
import threading

import grpc

from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher.cadence import QueuedExecutor
from torch_dataservice.dispatcher.journal import Journal, NullJournal
from torch_dataservice.dispatcher.observe import DispatcherObserver, collector
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.observability.metrics import Collector, MetricsEndpoint
from torch_dataservice.proto import dispatcher_pb2_grpc
from torch_dataservice.serving import (
    BackgroundLoop,
    Health,
    Queue,
    advertised_host,
    start_grpc_server,
)

logger = logging.getLogger(__name__)

DISPATCHER_SERVICE_NAME = "torch_dataservice.v1.DispatcherService"
REQUEST_OVERHEAD_BYTES = 1 << 20
# Its handlers share one lock and the GIL: more threads add no CPU, only a convoy whose wait
# no handler sees. Enough to batch journal fsyncs (group commit: an fsync takes ~0.1 ms);
# past them, requests wait in the executor's queue, where admission sees how long
# (dispatcher/cadence.py). At 1,000 workers + 4,096 readers, journaled, 8 threads answered
# 90-92% of the offered RPCs at 0.75-0.81 core, GetSplit p99 134-268 ms; 32 threads 75-87%
# at 0.86-0.87 core, p99 417-841 ms (benchmarks/dispatcher_capacity.py, same session).
HANDLER_THREADS = 8
# Requests waiting beyond the handler threads, in gRPC's core and in the threads' queue: a
# ms or so of work each, so a request accepted waits tens of ms, not seconds; past these gRPC
# answers them itself (serving.Queue; peers back off: errors.retry_after_ms, RETRYABLE_CODES).
QUEUE = Queue(pending=16, pending_hard=64, pending_s=1, max_concurrent=64)


def _open_journal(config: DispatcherConfig) -> Journal:
    if not config.fault_tolerant_mode:
        return NullJournal()
    from torch_dataservice.dispatcher.file_journal import FileJournal

    return FileJournal(config.work_dir, recovery=config.journal_recovery)  # type: ignore[arg-type]


class DispatchServer:
    """A dispatcher serving gRPC on `config.host:config.port` (0 = a free port).

    `target` is what clients pass as `service`. Usable as a context manager.
    """

    def __init__(self, config: DispatcherConfig | None = None, start: bool = True) -> None:
        self._config = config or DispatcherConfig()
        self._server: grpc.Server | None = None
        self._port = self._config.port
        self._stopped = threading.Event()
        self._service: DispatcherService | None = None
        self._liveness: BackgroundLoop | None = None
        self._advertised_host = advertised_host(self._config.host)
        self._health: Health | None = None
        self._metrics: MetricsEndpoint | None = None
        if start:
            self.start()

    @property
    def config(self) -> DispatcherConfig:
        return self._config

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """HOST:PORT for clients and workers: a wildcard bind (0.0.0.0) is advertised as this
        host's routable address (serving.advertised_host)."""
        return f"{self._advertised_host}:{self._port}"

    @property
    def target(self) -> str:
        return f"grpc://{self.address}"

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on (None: metrics are off)."""
        return self._metrics.port if self._metrics is not None else None

    def start(self) -> None:
        if self._server is not None:
            return
        journal = _open_journal(self._config)
        observer = DispatcherObserver(with_metrics=self._config.metrics_port is not None)
        if hasattr(journal, "on_fsync"):
            journal.on_fsync = observer.fsync
        # Replays the journal.
        self._service = DispatcherService(self._config, journal, observer=observer)
        self._health = health = Health(DISPATCHER_SERVICE_NAME)

        def register(server: grpc.Server) -> None:
            dispatcher_pb2_grpc.add_DispatcherServiceServicer_to_server(self._service, server)
            health.register(server)

        # Requests beyond a dataset definition's limit (plus room for the rest of the
        # request) are refused by gRPC before they are buffered whole.
        self._server, self._port = start_grpc_server(
            register, self._config.host, self._config.port, tls=self._config.tls,
            max_receive_bytes=self._config.max_dataset_bytes + REQUEST_OVERHEAD_BYTES,
            executor=QueuedExecutor(max_workers=HANDLER_THREADS, thread_name_prefix="grpc"),
            queue=QUEUE)
        health.set_serving(True)  # the journal is replayed: requests see the whole state
        interval = min(self._config.effective_job_gc_check_interval_ms,
                       self._config.effective_worker_timeout_ms // 4 or 1) / 1000
        self._liveness = BackgroundLoop("dispatcher-liveness", interval,
                                        self._service.check_liveness)
        self._liveness.start()
        if observer.registry is not None:
            observer.registry.register(Collector(collector(observer,
                                                           self._service.cluster_status)))
            self._metrics = MetricsEndpoint(observer.registry, self._config.host,
                                            self._config.metrics_port or 0)
            logger.info("dispatcher metrics at %s", self._metrics.url)
        logger.info("dispatcher serving at %s", self.target)

    def stop(self) -> None:
        if self._server is None:
            return
        if self._liveness is not None:
            self._liveness.stop()
        if self._health is not None:
            self._health.shutdown()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._server.stop(grace=0.5).wait(5)
        if self._service is not None:
            self._service.close()
        self._server = None
        self._stopped.set()

    def join(self, timeout: float | None = None) -> bool:
        """Block until `stop()` (from another thread or a signal handler)."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> DispatchServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
