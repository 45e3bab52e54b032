"""A shared token on every RPC, and no unauthenticated server on a network.

Registering a pipeline ships code that workers execute, and readers unpickle what workers
send: a server reachable from a network without authentication is a remote code-execution
endpoint. So a server refuses to bind anything but loopback unless `TORCH_DATASERVICE_TOKEN`
is set (or `TORCH_DATASERVICE_ALLOW_UNAUTHENTICATED=1` says the network is trusted). With a
token, servers reject every call that does not carry it and clients attach it to every call.
Use TLS or a private network as well: the token travels in clear over plain gRPC.

TLS (`TLSConfig` on a server; `TORCH_DATASERVICE_TLS_CA` and optionally `_CERT`/`_KEY` on a
client): gRPC and the data port are encrypted, and the token, when set, travels only inside
TLS. The rule for binding beyond loopback stays one line: a token, or mTLS (a server with a
`ca_file` admits only clients holding a certificate that CA signed, which authenticates them
as a token would), or the explicit opt-out. TLS without mTLS and without a token is refused:
encryption alone lets anyone in.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import os
import re
import socket
import ssl
from collections.abc import Callable
from typing import Any

import grpc

from torch_dataservice.config import TLSConfig
from torch_dataservice.peers import PeerLog, peer_host

logger = logging.getLogger(__name__)

TOKEN_ENV = "TORCH_DATASERVICE_TOKEN"
ALLOW_UNAUTHENTICATED_ENV = "TORCH_DATASERVICE_ALLOW_UNAUTHENTICATED"
METADATA_KEY = "x-torch-dataservice-token"
TLS_CA_ENV = "TORCH_DATASERVICE_TLS_CA"
TLS_CERT_ENV = "TORCH_DATASERVICE_TLS_CERT"
TLS_KEY_ENV = "TORCH_DATASERVICE_TLS_KEY"


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


def check_bind(host: str, tls: TLSConfig | None = None) -> None:
    """Refuse to serve on a non-loopback `host` without a token or mTLS (module docstring)."""
    if is_loopback(host) or token() is not None or (tls is not None and tls.mutual):
        return
    if os.environ.get(ALLOW_UNAUTHENTICATED_ENV) == "1":
        return
    raise ValueError(
        f"refusing to serve on host {host!r} without authentication: anyone who can reach it "
        f"could run code on this machine. Set {TOKEN_ENV} to a shared secret on every server "
        f"and client, or require client certificates (--tls-ca, TLSConfig.ca_file), or set "
        f"{ALLOW_UNAUTHENTICATED_ENV}=1 on a trusted network")


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
        return _refusal(handler, handler_call_details.method)


# Once per peer per minute, with a count: a peer without the token must not flood the log.
_refused = PeerLog(logger, "refused a call (missing or wrong token)")


def _refusal(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        _refused.note(peer_host(context.peer()), method)
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


def client_tls() -> tuple[str, str | None, str | None] | None:
    """(ca, cert, key) from the environment when clients of this process use TLS, else None.

    TLS is on when `TORCH_DATASERVICE_TLS_CA` names the CA that signed the servers'
    certificates; `_CERT`/`_KEY` are presented to servers that require them (mTLS)."""
    ca = os.environ.get(TLS_CA_ENV) or None
    if ca is None:
        return None
    cert, key = os.environ.get(TLS_CERT_ENV) or None, os.environ.get(TLS_KEY_ENV) or None
    if (cert is None) != (key is None):
        raise ValueError(f"set both {TLS_CERT_ENV} and {TLS_KEY_ENV}, or neither; got "
                         f"{TLS_CERT_ENV}={cert!r}, {TLS_KEY_ENV}={key!r}")
    return ca, cert, key


def tls_hint(details: str) -> str:
    """What to check when a connection fails the way a TLS mismatch makes it fail: a plain
    client sees its connection closed, a TLS one a failed handshake ("" otherwise)."""
    text = details.lower()
    if client_tls() is None and "socket closed" in text:
        return (f" (if the server uses TLS, set {TLS_CA_ENV} to the CA that signed its "
                "certificate)")
    if client_tls() is not None and ("ssl" in text or "handshake" in text
                                     or "socket closed" in text):
        return (f" (TLS handshake failed: check that {TLS_CA_ENV} signed the server's "
                f"certificate, and set {TLS_CERT_ENV}/{TLS_KEY_ENV} if the server requires "
                "client certificates)")
    return ""


# How gRPC reports a connection the server closed: "... ipv4:127.0.0.1:5000: Socket closed".
_CLOSED_BY = re.compile(r"(?:ipv4:|ipv6:)?(\[[^\]]+\]|[^\s:\[\]]+):(\d+): Socket closed")
PROBE_TIMEOUT_S = 2.0


def plaintext_against_tls(details: str) -> str | None:
    """What to do when this process dials in plaintext and the server that closed the
    connection (named in `details`) speaks TLS, probed with one handshake; else None.

    A plaintext gRPC channel against a TLS server only ever sees "Socket closed", which a
    retry never mends: said at once, a reader without the CA fails in seconds, not after its
    whole connect deadline."""
    if client_tls() is not None:
        return None
    match = _CLOSED_BY.search(details)
    if match is None or not speaks_tls(match.group(1).strip("[]"), int(match.group(2))):
        return None
    return (f"the server at {match.group(1)}:{match.group(2)} speaks TLS and this process "
            f"dials it in plaintext: set {TLS_CA_ENV} to the CA that signed its certificate")


def speaks_tls(host: str, port: int) -> bool:
    """Whether `host:port` answers a TLS handshake (its certificate unchecked: this only
    tells TLS from plaintext)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as raw, \
                context.wrap_socket(raw):
            return True
    except ssl.SSLError as error:  # an alert is TLS too (e.g. it wants a client certificate)
        return "ALERT" in str(error.reason or "")
    except OSError:
        return False


def _read(path: str) -> bytes:
    with open(path, "rb") as source:
        return source.read()


def channel_credentials(tls: tuple[str, str | None, str | None]) -> grpc.ChannelCredentials:
    """gRPC client credentials for `client_tls()`: trust the CA, present the cert if any."""
    ca, cert, key = tls
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key) if key else None,
        certificate_chain=_read(cert) if cert else None)


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """gRPC server credentials; with mTLS (`TLSConfig.mutual`), clients must present a
    certificate its CA signed."""
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=_read(tls.ca_file) if tls.mutual else None,
        require_client_auth=tls.mutual)


def server_ssl_context(tls: TLSConfig) -> ssl.SSLContext:
    """The data port's TLS: the same identity and client-certificate rule as gRPC."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.mutual:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(tls.ca_file)
    return context


@functools.lru_cache(maxsize=8)
def client_ssl_context(tls: tuple[str, str | None, str | None]) -> ssl.SSLContext:
    """A reader's TLS for data ports: verify the worker (and its host name) against the CA."""
    ca, cert, key = tls
    context = ssl.create_default_context(cafile=ca)
    if cert and key:
        context.load_cert_chain(cert, key)
    return context
