"""Pieces every server shares: a gRPC server on a host/port and background loops that stop."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from torch_dataservice import auth
from torch_dataservice.config import WILDCARD_HOSTS, TLSConfig
from torch_dataservice.peers import MalformedRequests
from torch_dataservice.rpc import SERVER_OPTIONS, note_server_started

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Queue:
    """Bounds on the requests a server holds before its handlers run, beyond which gRPC itself
    answers them (no handler runs).

    A Python gRPC server takes one request at a time from gRPC's core, in a thread that
    needs the GIL; requests arriving faster wait there, by default up to 1,000 of them (then
    some are dropped, all past 3,000) for up to 30 s: seconds of queue that no handler sees.
    `pending` and `pending_hard` replace the 1,000 and 3,000 (grpc.server.max_pending_requests:
    dropped with a probability rising between them), `pending_s` the 30 s; gRPC's core answers
    what it drops CANCELLED, without running any Python. `max_concurrent` caps the requests
    handed to the handler threads and not yet finished (grpc.server's maximum_concurrent_rpcs):
    past it, RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!" (errors.GRPC_REFUSALS).
    """

    pending: int
    pending_hard: int
    pending_s: int
    max_concurrent: int

    def options(self) -> list[tuple[str, int]]:
        return [("grpc.server.max_pending_requests", self.pending),
                ("grpc.server.max_pending_requests_hard_limit", self.pending_hard),
                ("grpc.server_max_unrequested_time_in_server", self.pending_s)]


def start_grpc_server(
    register: Callable[[grpc.Server], None], host: str, port: int, max_workers: int = 64,
    tls: TLSConfig | None = None, max_receive_bytes: int | None = None,
    executor: Executor | None = None, queue: Queue | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server with `register(server)` adding the servicers; returns (server, port).
    With `tls`, it serves over TLS only (and requires client certificates given a CA).
    `max_receive_bytes` caps a request's size (None: no cap): what one request may make the
    server buffer. `executor` runs the handlers (default: `max_workers` threads). `queue`
    bounds how many requests may wait for a handler (None: gRPC's defaults, thousands)."""
    auth.check_bind(host, tls)
    note_server_started()
    options = SERVER_OPTIONS
    if max_receive_bytes is not None:
        options = [(key, max_receive_bytes if key == "grpc.max_receive_message_length"
                    else value) for key, value in SERVER_OPTIONS]
    if queue is not None:
        options = [*options, *queue.options()]
    server = grpc.server(
        executor or ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=options,
        maximum_concurrent_rpcs=queue.max_concurrent if queue is not None else None,
        interceptors=[*auth.server_interceptors(), MalformedRequests()],
    )
    register(server)
    try:
        bound = (server.add_secure_port(f"{host}:{port}", auth.server_credentials(tls))
                 if tls is not None else server.add_insecure_port(f"{host}:{port}"))
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        bound = 0
    if bound == 0:
        server.stop(None)
        raise OSError(f"could not bind {host}:{port} (in use or not a local address?)")
    server.start()
    return server, bound


# Health service name that is SERVING for as long as the server runs: a liveness probe asks
# for it, so a worker waiting for its dispatcher, or draining, is not restarted.
LIVENESS = "liveness"


class Health:
    """The standard gRPC health service (`grpc.health.v1.Health`) of one server.

    Readiness: the overall server ("") and `service_name`, NOT_SERVING until
    `set_serving(True)`. Liveness: `LIVENESS`, SERVING until `shutdown()`. This is what a
    Kubernetes `grpc:` probe or `grpc_health_probe` asks; it needs no token (auth.py lets it
    through), so probes that cannot send metadata work.
    """

    def __init__(self, service_name: str) -> None:
        self._names = ("", service_name)
        self._servicer = health.HealthServicer()
        self._servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self.set_serving(False)

    def register(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self._names:
            self._servicer.set(name, status)

    def shutdown(self) -> None:
        """NOT_SERVING for good (watchers are told), before the server stops."""
        self._servicer.enter_graceful_shutdown()


class BackgroundLoop:
    """Call `body()` every `interval_s` on a daemon thread until `stop()` (`body` may change
    `interval_s`: a heartbeat's next interval is the dispatcher's to set).

    Exceptions in `body` are logged and the loop goes on: a transient failure must not end
    heartbeats or liveness checks for the life of the process.
    """

    def __init__(self, name: str, interval_s: float, body: Callable[[], None]) -> None:
        self.interval_s = interval_s
        self._body = body
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            try:
                self._body()
                failures = 0
            except grpc.RpcError as error:
                # A peer that is down (e.g. a restarting dispatcher): one line, not a traceback
                # per beat, and only on the first failure and then every 20th.
                if failures % 20 == 0:
                    logger.warning("%s: %s (%s)", self._thread.name, error.code().name,
                                   error.details())
                failures += 1
            except Exception:
                logger.exception("%s failed", self._thread.name)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


# Where a UDP socket is "connected" to learn the default route's interface when there is no
# peer to route toward: TEST-NET-1 (RFC 5737), never contacted (connecting a UDP socket sends
# nothing).
_UNROUTED_PROBE = "192.0.2.1"


def _route_source(toward: str) -> str | None:
    """The local address the kernel would use to reach `toward` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(toward.strip("[]"), 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(address)
                source = probe.getsockname()[0]
        except OSError:
            continue
        ip = ipaddress.ip_address(source.split("%", 1)[0])
        if not ip.is_loopback and not ip.is_unspecified:
            return source
    return None


def advertised_host(bind_host: str, toward: str | None = None) -> str:
    """The host other machines should dial for a server bound to `bind_host`.

    A specific bind address is its own answer. A wildcard (0.0.0.0, ::) is never advertised:
    a client would dial itself. Instead, the address of the interface that routes toward
    `toward` (a worker's dispatcher host), else the one of the default route, else the host
    name. An address is the safest default: it needs no DNS (Kubernetes pods, network
    namespaces and many compute nodes have no name others can resolve, and a Debian-style
    /etc/hosts maps the host name to 127.0.1.1), and the route to the dispatcher is by
    construction on the network the fleet uses. The host name is the last resort (a host
    with no route at all). Multi-homed hosts whose clients sit on another network than the
    dispatcher set `--worker-address`.
    """
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    candidates = [toward] if toward else []
    for target in (*candidates, _UNROUTED_PROBE):
        source = _route_source(target)
        if source is not None:
            return f"[{source}]" if ":" in source else source
    return socket.gethostname()


def write_port_file(path: str, address: str) -> None:
    """Write `address` (HOST:PORT) to `path` atomically: a reader polling for the file (the
    Slurm pattern, `worker --dispatcher-file`) sees it whole or not at all."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".tds-port-", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(address + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def close_and_join(objects: list[Any], join_s: float) -> None:
    """At exit: close each of `objects`, then give their threads `join_s` in all to end
    (`join(deadline)`), so no thread is inside a gRPC or socket call when the interpreter
    finalizes. Exiting anyway: a failing close never turns a clean exit into a failure."""
    for item in objects:
        try:
            item.close()
        except Exception:
            pass
    deadline = time.monotonic() + join_s
    for item in objects:
        item.join(deadline)
