"""Pieces every server shares: a gRPC server on a host/port and background loops that stop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from torch_dataservice import auth
from torch_dataservice.rpc import SERVER_OPTIONS

logger = logging.getLogger(__name__)


def start_grpc_server(
    register: Callable[[grpc.Server], None], host: str, port: int, max_workers: int = 64
) -> tuple[grpc.Server, int]:
    """Start a gRPC server with `register(server)` adding the servicers; returns (server, port)."""
    auth.check_bind(host)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=SERVER_OPTIONS,
        interceptors=auth.server_interceptors(),
    )
    register(server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        bound = 0
    if bound == 0:
        server.stop(None)
        raise OSError(f"could not bind {host}:{port} (in use or not a local address?)")
    server.start()
    return server, bound


class BackgroundLoop:
    """Call `body()` every `interval_s` on a daemon thread until `stop()`.

    Exceptions in `body` are logged and the loop goes on: a transient failure must not end
    heartbeats or liveness checks for the life of the process.
    """

    def __init__(self, name: str, interval_s: float, body: Callable[[], None]) -> None:
        self._interval_s = interval_s
        self._body = body
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self._interval_s):
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
