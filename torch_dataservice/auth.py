"""A shared token on every RPC, and no unauthenticated server on a network.

Registering a pipeline ships code that workers execute, and readers unpickle what workers
send: a server reachable from a network without authentication is a remote code-execution
endpoint. So a server refuses to bind anything but loopback unless `TORCH_DATASERVICE_TOKEN`
is set (or `TORCH_DATASERVICE_ALLOW_UNAUTHENTICATED=1` says the network is trusted). With a
token, servers reject every call that does not carry it and clients attach it to every call.
Use TLS or a private network as well: the token travels in clear over plain gRPC.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)

TOKEN_ENV = "TORCH_DATASERVICE_TOKEN"
ALLOW_UNAUTHENTICATED_ENV = "TORCH_DATASERVICE_ALLOW_UNAUTHENTICATED"
METADATA_KEY = "x-torch-dataservice-token"


def token() -> str | None:
    """The shared token of this process's fleet, or None."""
    return os.environ.get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_bind(host: str) -> None:
    """Refuse to serve on a non-loopback `host` without a token (see the module docstring)."""
    if is_loopback(host) or token() is not None:
        return
    if os.environ.get(ALLOW_UNAUTHENTICATED_ENV) == "1":
        return
    raise ValueError(
        f"refusing to serve on host {host!r} without authentication: anyone who can reach it "
        f"could run code on this machine. Set {TOKEN_ENV} to a shared secret on every server "
        f"and client (or {ALLOW_UNAUTHENTICATED_ENV}=1 on a trusted network)")


# Health checks need no token: Kubernetes' `grpc:` probes cannot send metadata, and the
# answer (SERVING or not) reveals nothing and runs no code.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenCheck(grpc.ServerInterceptor):
    """Server side: every call must carry the token (health checks excepted)."""

    def __init__(self, expected: str) -> None:
        self._expected = expected.encode()

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get(METADATA_KEY, "")
        given_bytes = given.encode() if isinstance(given, str) else given
        if handler is None or hmac.compare_digest(given_bytes, self._expected):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        logger.warning("refused a call from %s: missing or wrong token", context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"missing or wrong {TOKEN_ENV} token")

    if handler.response_streaming:
        def refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
            refuse(request, context)
            yield  # pragma: no cover - abort raises

        return grpc.unary_stream_rpc_method_handler(
            refuse_stream, request_deserializer=handler.request_deserializer)
    return grpc.unary_unary_rpc_method_handler(
        refuse, request_deserializer=handler.request_deserializer)


class _TokenAttach(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: attach the token to every call."""

    def __init__(self, value: str) -> None:
        self._metadata = (METADATA_KEY, value)

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._metadata]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


def secure_channel(channel: grpc.Channel) -> grpc.Channel:
    """`channel` with the token attached to every call (unchanged without a token)."""
    value = token()
    if value is None:
        return channel
    return grpc.intercept_channel(channel, _TokenAttach(value))


def server_interceptors() -> list[grpc.ServerInterceptor]:
    value = token()
    return [TokenCheck(value)] if value is not None else []
