"""A worker's figures: what it sent, by transport, and where its executors' time went.

`WorkerCounters` is updated once per fetch reply (never per element) under a lock, by the
gRPC, data-port and in-process paths alike; the Prometheus collector and the heartbeat
(dispatcher status, optimal-workers estimate) read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from torch_dataservice.observability import metrics
from torch_dataservice.observability.stages import STAGES, StageTotals
from torch_dataservice.proto import status_pb2
from torch_dataservice.worker.cache_index import WorkerCache

TRANSPORTS = ("grpc", "tcp", "unix", "local")


class WorkerCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.elements = 0
        self.bytes_by_transport = dict.fromkeys(TRANSPORTS, 0)

    def sent(self, transport: str, elements: int, nbytes: int) -> None:
        with self._lock:
            self.elements += elements
            self.bytes_by_transport[transport] += nbytes

    def snapshot(self) -> tuple[int, int]:
        """(elements, bytes) sent so far, all transports."""
        with self._lock:
            return self.elements, sum(self.bytes_by_transport.values())


def load(counters: WorkerCounters, stage_totals: StageTotals, cache: WorkerCache, *,
         buffered: int, processes: int) -> status_pb2.WorkerLoad:
    """What a heartbeat tells the dispatcher (its status view and optimal-workers estimate)."""
    elements, nbytes = counters.snapshot()
    totals = stage_totals.totals()
    hits, misses, evictions = cache.counts()
    return status_pb2.WorkerLoad(
        elements_sent=elements, bytes_sent=nbytes, buffered_elements=buffered,
        elements_produced=int(totals["elements"]),
        busy_seconds=totals["compute"] + totals["encode"], processes=processes,
        cache_bytes=cache.nbytes(), cache_hits=hits, cache_misses=misses,
        cache_evictions=evictions)


def collector(counters: WorkerCounters, stage_totals: StageTotals, cache: WorkerCache,
              buffered: Callable[[], int]) -> Callable[[], Iterable[Any]]:
    """The worker's metric families, read when /metrics is scraped."""

    def collect() -> Iterable[Any]:
        with counters._lock:
            elements = counters.elements
            by_transport = dict(counters.bytes_by_transport)
        yield metrics.counter("tds_worker_elements", "Elements sent to readers", elements)
        sent = metrics.counter("tds_worker_bytes_sent", "Payload bytes sent to readers",
                               labels=["transport"])
        for transport, nbytes in by_transport.items():
            sent.add_metric([transport], nbytes)
        yield sent
        yield metrics.gauge("tds_worker_buffered_elements",
                            "Elements made and waiting for a reader", buffered())
        totals = stage_totals.totals()
        stage = metrics.counter(
            "tds_worker_stage_seconds",
            "Seconds executors spent per stage: split (waiting for a split), compute (the "
            "pipeline), encode, send (to the worker front)", labels=["stage"])
        for name in STAGES:
            stage.add_metric([name], totals[name])
        yield stage
        yield metrics.counter("tds_worker_elements_produced",
                              "Elements the executors produced", totals["elements"])
        hits, misses, evictions = cache.counts()
        yield metrics.gauge("tds_worker_cache_bytes", "Bytes of the cache() entries it holds",
                            cache.nbytes())
        yield metrics.counter("tds_worker_cache_hits", "cache() entries (splits) read back",
                              hits)
        yield metrics.counter("tds_worker_cache_misses",
                              "cache() entries (splits) computed, not found", misses)
        yield metrics.counter("tds_worker_cache_evictions",
                              "cache() entries evicted or not kept (max_bytes, a full disk)",
                              evictions)

    return collect
