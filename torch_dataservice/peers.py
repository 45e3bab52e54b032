"""What a misbehaving peer can make a server do: answered, counted, and logged once a minute.

Requests gRPC cannot decode are answered INVALID_ARGUMENT by deserializers of our own
(`MalformedRequests`) instead of grpcio's path for a deserializer that raises, which logs a
traceback per request and leaks native memory (grpcio 1.85: about 15 KB per request, 1.1 GB
after a fuzz of 10,000 requests per dispatcher method). Misbehaviour is logged once per peer
host per minute with a count (`PeerLog`), so junk can flood neither memory nor the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
MAX_PEERS = 1024  # peers remembered for the count; beyond, the oldest are forgotten


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`) or of a
    `host:port`: one count per machine, not per connection."""
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            peer = peer[len(prefix):]
            break
    else:
        return peer
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class PeerLog:
    """Log what a peer did wrong at most once per `every_s` per peer host, with how many
    times it did so since the last line."""

    def __init__(self, log: logging.Logger, what: str, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._what = what
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, list[Any]] = {}  # host -> [last logged at, count since]

    def note(self, host: str, detail: str) -> None:
        now = self._clock()
        with self._lock:
            entry = self._peers.get(host)
            if entry is not None and now - entry[0] < self._every_s:
                entry[1] += 1
                return
            count = 1 if entry is None else entry[1] + 1
            self._peers.pop(host, None)  # re-inserted last: the dict stays in logging order
            self._peers[host] = [now, 0]
            while len(self._peers) > MAX_PEERS:
                self._peers.pop(next(iter(self._peers)))
        if entry is None:
            self._log.warning("%s from %s (%s); more from this peer are logged once every "
                              "%.0f s with a count", self._what, host, detail, self._every_s)
        else:
            self._log.warning("%s from %s: %d times in the last %.0f s (latest: %s)",
                              self._what, host, count, now - entry[0], detail)


class Malformed:
    """What our deserializer returns for bytes that are no request of the method."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:
            return Malformed(f"{type(error).__name__}: {error}"[:200])

    return deserialize


MAX_GUARDED = 256


class MalformedRequests(grpc.ServerInterceptor):
    """Answer undecodable requests INVALID_ARGUMENT (and count them) before any handler runs.

    Installed after the token check (auth.TokenCheck), whose refusal then also decodes with
    ours: a caller without the token is told UNAUTHENTICATED whatever it sent."""

    def __init__(self) -> None:
        self.log = PeerLog(logger, "malformed request")
        # (method, handler) -> the guarded handler: built once, not per request (this runs in
        # the one thread that takes every request from gRPC, so it bounds what a server
        # takes in per second). Emptied when full: a refused call's handler is built per call.
        self._guarded: dict[tuple[str, Any], Any] = {}

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if (handler is None or handler.request_streaming
                or handler.request_deserializer is None):
            return handler
        key = (handler_call_details.method, handler)
        guarded = self._guarded.get(key)
        if guarded is None:
            if len(self._guarded) >= MAX_GUARDED:
                self._guarded.clear()
            guarded = self._guarded[key] = self._guard(*key)
        return guarded

    def _guard(self, method: str, handler: Any) -> Any:
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, kind)

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                self.log.note(peer_host(context.peer()), f"{method}: {request.error}")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed {method} request: {request.error}")
            return behavior(request, context)

        return handler._replace(**{kind: guarded},
                                request_deserializer=_tolerant(handler.request_deserializer))
