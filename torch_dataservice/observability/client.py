"""A consumer's figures: batches, elements, bytes, seconds blocked, per worker.

One `ClientStats` per consumer-facing object: a `tds.DataLoader` (all its epochs), or a
Pipeline read through the service (all iterations of that Pipeline object). The consumer's
thread alone writes `batches` and `wait_seconds` (no lock); fetch threads add what each reply
brought under a lock, once per reply. A DataLoader reads through a Pipeline reader on a
thread of its own: it makes its stats the thread's sink (`collecting`), so the reader adds
what it receives there and leaves batches and waiting to the loader, whose `__next__` is the
one the trainer blocks in.

Prometheus: `tds_client_wait_seconds_total{rank}` and `tds_client_batches_total{rank}` (plus
elements and bytes), summed over this process's consumers, so that wait per batch of a rank is
one division. Exposed with `TORCH_DATASERVICE_METRICS_PORT` (local rank i serves on port
P + i, so the ranks of one host do not collide) or `register_client_metrics(registry)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from torch_dataservice.observability import metrics

logger = logging.getLogger(__name__)

METRICS_PORT_ENV = "TORCH_DATASERVICE_METRICS_PORT"
_FIGURES = ("batches", "wait_seconds", "elements", "bytes")


def default_rank() -> int:
    """This process's torch.distributed rank as torchrun sets it (RANK), else 0."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class ClientStats:
    """What one consumer received and how long it waited (see the module docstring)."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = default_rank() if rank is None else rank
        self.batches = 0           # taken by the consumer
        self.wait_seconds = 0.0    # the consumer's __next__ blocked
        self.elements = 0          # received from workers
        self.bytes = 0
        self.per_worker: dict[str, list[int]] = {}  # address -> [elements, bytes]
        self.samples_dropped = 0   # even_batches (DataLoader), per epoch
        self.samples_padded = 0
        self.batches_dropped = 0   # ... with a user's sampler, or an iterable: whole batches
        self.batches_padded = 0
        self._lock = threading.Lock()
        _ProcessMetrics.get().track(self)

    def received(self, worker: str, elements: int, nbytes: int) -> None:
        """A reply from `worker` brought `elements` elements of `nbytes` bytes in all."""
        with self._lock:
            self.elements += elements
            self.bytes += nbytes
            counts = self.per_worker.setdefault(worker, [0, 0])
            counts[0] += elements
            counts[1] += nbytes

    def dropped_at_end(self, batches: int) -> None:
        """Coordinated reads: a task ended with an incomplete round of `batches` elements that
        no consumer received (`even_batches` for iterables drops whole batches). Every
        consumer is told, so every rank reports the same total, as for map-style datasets."""
        with self._lock:
            self.batches_dropped += batches

    def figures(self) -> tuple[int, float, int, int]:
        return self.batches, self.wait_seconds, self.elements, self.bytes

    def __del__(self) -> None:
        try:  # its figures stay in the process's counters, which never decrease
            _ProcessMetrics.get().retire(self)
        except Exception:
            pass

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            per_worker = {address: {"elements": e, "bytes": b}
                          for address, (e, b) in sorted(self.per_worker.items())}
        return {"rank": self.rank, "batches": self.batches, "elements": self.elements,
                "bytes": self.bytes, "wait_seconds": self.wait_seconds,
                "wait_seconds_per_batch": self.wait_seconds / self.batches if self.batches
                else 0.0,
                "per_worker": per_worker, "samples_dropped": self.samples_dropped,
                "samples_padded": self.samples_padded, "batches_dropped": self.batches_dropped,
                "batches_padded": self.batches_padded}


_sink = threading.local()


@contextlib.contextmanager
def collecting(stats: ClientStats) -> Iterator[None]:
    """Readers created on this thread meanwhile add what they receive to `stats`."""
    previous = getattr(_sink, "stats", None)
    _sink.stats = stats
    try:
        yield
    finally:
        _sink.stats = previous


def current_sink() -> ClientStats | None:
    return getattr(_sink, "stats", None)


class _ProcessMetrics:
    """Every ClientStats of this process, live or gone, for the per-rank counters."""

    _instance: _ProcessMetrics | None = None
    _instance_lock = threading.RLock()

    def __init__(self) -> None:
        # Reentrant: a ClientStats collected (its __del__) while this thread holds it.
        self._lock = threading.RLock()
        self._live: weakref.WeakSet[ClientStats] = weakref.WeakSet()
        self._retired: dict[int, list[float]] = {}  # rank -> figures of collected stats
        self._registries: list[Any] = []
        self.endpoint: metrics.MetricsEndpoint | None = None

    @classmethod
    def get(cls) -> _ProcessMetrics:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
                cls._instance._serve_from_env()
            return cls._instance

    def track(self, stats: ClientStats) -> None:
        with self._lock:
            self._live.add(stats)

    def retire(self, stats: ClientStats) -> None:
        """`stats` is being collected: fold its figures into its rank's retired totals."""
        with self._lock:
            if stats not in self._live:
                return
            self._live.discard(stats)
            totals = self._retired.setdefault(stats.rank, [0.0] * len(_FIGURES))
            for i, value in enumerate(stats.figures()):
                totals[i] += value

    def per_rank(self) -> dict[int, list[float]]:
        with self._lock:
            result = {rank: list(values) for rank, values in self._retired.items()}
            for stats in list(self._live):
                totals = result.setdefault(stats.rank, [0.0] * len(_FIGURES))
                for i, value in enumerate(stats.figures()):
                    totals[i] += value
        return result

    def collect(self) -> Iterable[Any]:
        families = [
            metrics.counter("tds_client_batches", "Batches the consumer took", labels=["rank"]),
            metrics.counter("tds_client_wait_seconds", "Seconds the consumer's __next__ was "
                            "blocked waiting for data", labels=["rank"]),
            metrics.counter("tds_client_elements", "Elements received from workers",
                            labels=["rank"]),
            metrics.counter("tds_client_bytes_received", "Payload bytes received from workers",
                            labels=["rank"]),
        ]
        for rank, values in sorted(self.per_rank().items()):
            for family, value in zip(families, values, strict=True):
                family.add_metric([str(rank)], value)
        return families

    def register(self, registry: Any) -> None:
        with self._lock:
            if any(r is registry for r in self._registries):
                return
            self._registries.append(registry)
        registry.register(metrics.Collector(self.collect))

    def _serve_from_env(self) -> None:
        port = os.environ.get(METRICS_PORT_ENV)
        if not port:
            return
        try:
            chosen = int(port) + int(os.environ.get("LOCAL_RANK", "0"))
            registry = metrics.new_registry()
            self.register(registry)
            self.endpoint = metrics.MetricsEndpoint(registry, "0.0.0.0", chosen)
            logger.info("client metrics at %s", self.endpoint.url)
        except (ValueError, OSError) as error:  # never fail a training run over metrics
            logger.warning("%s=%r: client metrics not served: %s", METRICS_PORT_ENV, port,
                           error)


def register_client_metrics(registry: Any = None) -> None:
    """Expose this process's client figures through `registry` (default: prometheus_client's
    global registry, which the user's own `start_http_server` already serves)."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    _ProcessMetrics.get().register(registry)


def feeding(stats: ClientStats, iterator: Iterator[Any]) -> Iterator[Any]:
    """`iterator`, advanced with `stats` as the sink: readers it creates on the thread that
    advances it (a DataLoader's reading thread) add what they receive to `stats`."""
    with collecting(stats):
        yield from iterator
