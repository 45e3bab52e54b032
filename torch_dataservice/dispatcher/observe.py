"""What the dispatcher measures and hears about load: soft figures for status and metrics.

Like SoftState, a restart forgets all of it and re-learns it from the next heartbeats. The
handlers feed it (one call each, under the service lock); `dispatcher/status.py` turns it,
with the state, into the cluster status that `torch-dataservice status` prints and that the
dispatcher's Prometheus collector re-exposes. Histograms exist only when metrics are on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch_dataservice.observability import metrics
from torch_dataservice.observability.rates import RateWindow
from torch_dataservice.proto import status_pb2

logger = logging.getLogger("torch_dataservice.dispatcher.service")

RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


@dataclass
class ClientSample:
    iteration_id: int
    rank: int
    window: RateWindow = field(default_factory=RateWindow)  # batches, wait s, elements, bytes


@dataclass
class WorkerSample:
    load: status_pb2.WorkerLoad
    # elements sent, bytes sent, elements produced, busy seconds
    window: RateWindow = field(default_factory=RateWindow)


class DispatcherObserver:
    """Load figures from heartbeats, counters of the dispatcher's own work, and histograms."""

    def __init__(self, with_metrics: bool = False) -> None:
        self.started = time.monotonic()
        self.workers: dict[str, WorkerSample] = {}
        self.clients: dict[int, ClientSample] = {}
        self.released_elements: dict[int, int] = {}  # iteration -> elements of gone clients
        self.splits = 0  # handed out by GetSplit
        self.calls: dict[str, int] = {}  # answered, per method
        self.finished: set[int] = set()  # iterations whose end was logged
        self.registry: Any = None
        self._rpc_seconds: Any = None
        self._fsync_seconds: Any = None
        if with_metrics:
            from prometheus_client import Histogram

            self.registry = metrics.new_registry()
            self._rpc_seconds = Histogram(
                "tds_dispatcher_rpc_seconds", "Dispatcher RPC time from its arrival in the "
                "handler threads' queue to its reply (journal sync included)", ["method"],
                registry=self.registry, buckets=RPC_BUCKETS)
            self._fsync_seconds = Histogram(
                "tds_dispatcher_journal_fsync_seconds", "Journal fsync time (fault-tolerant "
                "mode)", registry=self.registry, buckets=FSYNC_BUCKETS)

    def rpc(self, method: str, seconds: float) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self._rpc_seconds is not None:
            self._rpc_seconds.labels(method).observe(seconds)

    def fsync(self, seconds: float) -> None:
        if self._fsync_seconds is not None:
            self._fsync_seconds.observe(seconds)

    def worker(self, address: str, load: status_pb2.WorkerLoad, now: float) -> None:
        sample = self.workers.get(address)
        if sample is None:
            sample = self.workers[address] = WorkerSample(load)
        sample.load = load
        sample.window.add(now, (load.elements_sent, load.bytes_sent, load.elements_produced,
                                load.busy_seconds))

    def forget_worker(self, address: str) -> None:
        self.workers.pop(address, None)

    def client(self, client_id: int, iteration_id: int, load: status_pb2.ClientLoad,
               now: float) -> None:
        sample = self.clients.get(client_id)
        if sample is None:
            sample = self.clients[client_id] = ClientSample(iteration_id, load.rank)
        sample.window.add(now, (load.batches, load.wait_seconds, load.elements, load.bytes))

    def release(self, client_id: int, iteration_id: int, why: str) -> None:
        """The client left: what it received stays counted in its iteration."""
        sample = self.clients.pop(client_id, None)
        received = int(sample.window.latest[2]) if sample and sample.window.latest else 0
        self.released_elements[iteration_id] = self.released_elements.get(
            iteration_id, 0) + received
        logger.info("client %d of iteration %d %s (%d elements received)", client_id,
                    iteration_id, why, received)

    def joined(self, client_id: int, iteration_id: int, job: Any, created: bool) -> None:
        if created:
            config = job.config
            logger.info("iteration %d of job %d created (dataset %s, policy %d%s%s)",
                        iteration_id, job.job_id, config.dataset_id, config.sharding_policy,
                        f", name {job.name!r}" if job.name else "",
                        f", {config.num_consumers} consumers"
                        if config.HasField("num_consumers") else "")
        logger.info("client %d joined iteration %d", client_id, iteration_id)

    def task_finished(self, state: Any, iteration: Any) -> None:
        """Log an iteration's end once, when its last task finished."""
        if iteration.iteration_id not in self.finished and state.is_finished(iteration):
            self.finished.add(iteration.iteration_id)
            logger.info("iteration %d finished: %d element(s) delivered so far",
                        iteration.iteration_id, self.released_elements.get(
                            iteration.iteration_id, 0) + sum(
                            int(s.window.latest[2]) for s in self.clients.values()
                            if s.iteration_id == iteration.iteration_id and s.window.latest))


def collector(observer: DispatcherObserver,
              status: Callable[[], status_pb2.GetClusterStatusResponse]
              ) -> Callable[[], Iterable[Any]]:
    """The dispatcher's gauges and counters, read from one status snapshot per scrape."""

    def collect() -> Iterable[Any]:
        snapshot = status()
        yield metrics.gauge("tds_dispatcher_workers", "Registered workers",
                            len(snapshot.workers))
        yield metrics.gauge("tds_dispatcher_iterations", "Iterations not finished",
                            sum(not it.finished for it in snapshot.iterations))
        yield metrics.gauge("tds_dispatcher_clients", "Readers attached", len(snapshot.clients))
        yield metrics.counter("tds_dispatcher_splits", "DYNAMIC splits handed out",
                              observer.splits)
        load = snapshot.load
        yield metrics.gauge("tds_dispatcher_load_cores", "The dispatcher's CPU seconds per "
                            "second, over its last liveness check", load.cores)
        yield metrics.gauge("tds_dispatcher_rpcs_per_second", "RPCs answered per second",
                            load.rpcs_per_s)
        yield metrics.gauge("tds_dispatcher_refused_per_second", "RPCs refused per second "
                            "(RESOURCE_EXHAUSTED with a retry-after: over capacity)",
                            load.refused_per_s)
        intervals = metrics.gauge(
            "tds_dispatcher_heartbeat_interval_seconds", "The heartbeat interval the dispatcher "
            "asks for (dispatcher/cadence.py; 0: the peers' own default)", labels=["peer"])
        intervals.add_metric(["worker"], load.worker_heartbeat_ms / 1000)
        intervals.add_metric(["client"], load.client_heartbeat_ms / 1000)
        yield intervals
        optimal = metrics.gauge(
            "tds_dispatcher_optimal_workers", "Workers that would keep the iteration's "
            "consumers from waiting (dispatcher/status.py)", labels=["iteration"])
        for it in snapshot.iterations:
            if it.optimal_workers:
                optimal.add_metric([str(it.iteration_id)], it.optimal_workers)
        yield optimal

    return collect
