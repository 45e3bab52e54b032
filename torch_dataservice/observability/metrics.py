"""Prometheus exposition for one server object: its own registry and its own HTTP endpoint.

A registry per server (never prometheus_client's global one) lets several servers share one
process (tests, the embedded service of tds.DataLoader) and each expose only its own figures.
The figures themselves are plain counters kept by the code that moves data; a `Collector`
reads them at scrape time, so the data path never calls into prometheus_client.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

FALLBACK_VERSION = "0.1.0"


def build_versions() -> tuple[str, str]:
    """(package version, wire protocol version) for tds_build_info."""
    try:  # the version module (issue 10) is the source of truth once it exists
        from torch_dataservice import version as _version  # type: ignore[attr-defined]

        return (str(getattr(_version, "__version__", FALLBACK_VERSION)),
                str(getattr(_version, "PROTOCOL_VERSION", 1)))
    except ImportError:
        pass
    try:
        package = importlib.metadata.version("torch-dataservice")
    except importlib.metadata.PackageNotFoundError:
        package = FALLBACK_VERSION
    from torch_dataservice.wire.data_port import VERSION

    return package, str(VERSION)


class Collector:
    """A prometheus_client collector that builds its metric families when scraped."""

    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Any]:
        try:
            return list(self._collect())
        except Exception:  # a scrape must never take a server down
            logger.exception("collecting metrics failed")
            return []


def new_registry() -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(Collector(build_info))
    return registry


def build_info() -> list[Any]:
    from prometheus_client.core import GaugeMetricFamily

    version, protocol = build_versions()
    family = GaugeMetricFamily("tds_build_info", "Package and wire protocol version (always 1)",
                               labels=["version", "protocol"])
    family.add_metric([version, protocol], 1)
    return [family]


def gauge(name: str, help_text: str, value: float | None = None,
          labels: Iterable[str] = ()) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, help_text, value=value, labels=list(labels) or None)


def counter(name: str, help_text: str, value: float | None = None,
            labels: Iterable[str] = ()) -> Any:
    """A counter family; `name` without `_total` (prometheus_client adds it)."""
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, help_text, value=value, labels=list(labels) or None)


class MetricsEndpoint:
    """`registry` served as Prometheus text at http://HOST:PORT/metrics (port 0: a free one)."""

    def __init__(self, registry: Any, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        """Where to scrape it from another host: a wildcard bind (0.0.0.0) is named by this
        host's routable address, as the servers' own addresses are."""
        from torch_dataservice.serving import advertised_host

        return f"http://{advertised_host(self.host)}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
