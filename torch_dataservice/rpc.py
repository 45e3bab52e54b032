"""gRPC plumbing shared by every component: channels, status mapping and the one retry helper."""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from torch_dataservice import auth, fork_gate
from torch_dataservice.errors import (
    ERROR_KIND_KEY,
    VERSION_MISMATCH_KIND,
    FailedPreconditionError,
    NotReadyError,
    ServiceUnavailableError,
    VersionMismatchError,
    is_retryable,
    retry_after_ms,
)
from torch_dataservice.peers import PeerLog, peer_host

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The worker's gRPC service (generic handlers, so no generated stub): readers name it too.
WORKER_SERVICE_NAME = "torch_dataservice.v1.WorkerService"

# Elements of any size: gRPC's default 4 MB receive cap must not limit element size.
MAX_MESSAGE_BYTES = 2**31 - 1
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # Reconnect quickly after a server restart instead of grpc's default backoff of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.enable_retries", 0),
]
# How long after a server is back its peers may take to reach it: a channel that failed to
# connect tries again after its backoff, at most max_reconnect_backoff_ms plus gRPC's jitter
# (up to 20%); calls made meanwhile fail at once with the last connection error.
RECONNECT_WITHIN_S = 1.2 * dict(CHANNEL_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 0),
]


def parse_service(service: Any) -> tuple[str, str]:
    """`"grpc://HOST:PORT"`, `"HOST:PORT"` or `(protocol, address)` -> (protocol, address)."""
    if isinstance(service, tuple):
        if len(service) != 2 or not all(isinstance(part, str) for part in service):
            raise ValueError(f"service tuple must be (protocol, address), got {service!r}")
        protocol, address = service
    elif isinstance(service, str):
        if not service:
            raise ValueError("service must not be empty")
        if service.count("://") > 1:
            raise ValueError(f"service {service!r} must contain at most one '://'")
        if "://" in service:
            protocol, address = service.split("://")
        else:
            protocol, address = "grpc", service
    else:
        raise ValueError(
            f"service must be a string or a (protocol, address) tuple, got {service!r}")
    if protocol != "grpc":
        raise ValueError(f"unsupported protocol {protocol!r} in service {service!r}; use 'grpc'")
    if not address:
        raise ValueError(f"service {service!r} has an empty address")
    return protocol, address


_channels: dict[tuple[str, str | None, Any], grpc.Channel] = {}
_channels_lock = threading.Lock()


_servers_started = False
_own_channels = False  # a `new_channel` was made


def note_server_started() -> None:
    """A gRPC server of ours runs in this process (serving.py): see grpc_started."""
    global _servers_started
    _servers_started = True


def grpc_started() -> bool:
    """Whether a gRPC channel or server of ours ran in this process: gRPC's threads may run
    (or come back), so the process must not be forked (worker/launch.py)."""
    return _servers_started or _own_channels or bool(_channels)


def channel_to(address: str) -> grpc.Channel:
    """A shared channel to `address` (one per address, token and TLS settings per process),
    carrying the fleet's token when one is set and over TLS when `TORCH_DATASERVICE_TLS_CA` is
    set (see auth.py); its calls hold off forks (fork_gate.py). Keyed by both: a channel made
    before they were set must not serve a server that requires them (e.g. on a reused port)."""
    tls = auth.client_tls()
    key = (address, auth.token(), tls)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None:
            channel = _channels[key] = new_channel(address)
        return channel


def new_channel(address: str) -> grpc.Channel:
    """A channel of its own to `address`, set up as `channel_to`'s are; the caller closes it
    (for peers that come and go by the thousand: a shared channel would stay open forever)."""
    global _own_channels
    tls = auth.client_tls()
    raw = (grpc.secure_channel(address, auth.channel_credentials(tls), options=CHANNEL_OPTIONS)
           if tls is not None else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
    _own_channels = True
    return fork_gate.gated(auth.secure_channel(raw))


WAIT_REPORT_ENV = "TORCH_DATASERVICE_WAIT_WARNING_S"


def wait_report_s() -> float:
    """How long a wait goes on before it is reported, and then how often (default 10 s)."""
    try:
        return max(0.05, float(os.environ.get(WAIT_REPORT_ENV, "10")))
    except ValueError:
        return 10.0


_overload_logged = False


def overload_backoff_s(error: BaseException, what: str) -> float | None:
    """How long to wait after an overloaded dispatcher's refusal: its retry-after hint with
    jitter (0.5x to 1.5x, so refused peers do not come back together); None for any other
    error. The first refusal in this process is logged, the rest at debug level."""
    hint = retry_after_ms(error)
    if hint is None:
        return None
    global _overload_logged
    level = logging.DEBUG if _overload_logged else logging.WARNING
    _overload_logged = True
    logger.log(level, "%s: the dispatcher is over its capacity and asked to retry after %d ms: "
               "backing off (logged once)", what, hint)
    return hint / 1000 * (0.5 + random.random())


def retry(
    call: Callable[[], T],
    *,
    description: str,
    deadline_s: float,
    stop: threading.Event | None = None,
    initial_backoff_s: float = 0.05,
    max_backoff_s: float = 1.0,
) -> T:
    """Call `call` until it succeeds, retrying only retryable errors, until `deadline_s` passes.

    Exponential backoff with jitter, capped at `max_backoff_s`; an overloaded dispatcher's
    refusal waits its retry-after hint instead (overload_backoff_s). Raises
    ServiceUnavailableError (chained to the last error) when the deadline expires or `stop`
    is set.
    """
    started = time.monotonic()
    end = started + deadline_s
    report_every = wait_report_s()
    reported = 0
    backoff = initial_backoff_s
    attempt = 0
    probed = False
    while True:
        attempt += 1
        try:
            return call()
        except grpc.RpcError as error:
            if not is_retryable(error):
                raise
            if not probed and "Socket closed" in (error.details() or ""):
                probed = True  # once: a plaintext channel against a TLS server is no outage
                mismatch = auth.plaintext_against_tls(error.details() or "")
                if mismatch is not None:
                    raise ServiceUnavailableError(f"{description}: {mismatch}") from error
            now = time.monotonic()
            remaining, waited = end - now, now - started
            if remaining <= 0 or (stop is not None and stop.is_set()):
                why = "stopped" if remaining > 0 else "no answer"  # never a timeout not waited
                details = error.details() or ""
                raise ServiceUnavailableError(
                    f"{description}: {why} after {waited:.1f}s and {attempt} attempts "
                    f"({error.code().name}: {details}){auth.tls_hint(details)}"
                ) from error
            if waited >= report_every * (reported + 1):
                reported = int(waited // report_every)
                logger.warning("%s: %s, retrying (%.0f s so far, giving up after %.0f s)",
                               description, error.details() or error.code().name, waited,
                               deadline_s)
            overloaded = overload_backoff_s(error, description)
            sleep = min(remaining, overloaded if overloaded is not None
                        else min(backoff * (0.5 + random.random()), max_backoff_s))
            if stop is not None:
                if stop.wait(sleep):
                    raise ServiceUnavailableError(
                        f"{description}: stopped after {time.monotonic() - started:.1f}s"
                    ) from error
            else:
                time.sleep(sleep)
            backoff = min(backoff * 2, max_backoff_s)


# Request integers (ids, repetitions, offsets, rounds, counts) are never negative (a static
# worker index may be -1: none) and stay far from int64's end, so that no `+ 1` on them
# overflows what the journal's protobuf records can hold.
MAX_REQUEST_INT = 2**62
_MAY_BE_MINUS_ONE = frozenset({"worker_index"})


# How an integer field outside [0, 2**62) shows in a serialized message: a varint of at least
# 9 bytes (8 with the continuation bit) whose 9th byte holds bit 62 or continues (negative
# int32 and int64 take 10 bytes; our protos have no sint or fixed integer types). Strings,
# bytes and doubles may match too: those messages are then checked field by field.
_LONG_VARINT = re.compile(rb"[\x80-\xff]{8}[\x40-\xff]")


def check_request(message: Any) -> None:
    """Refuse (ValueError, naming the field) integers a well-behaved peer never sends.

    Runs on every request, so first on the serialized message, in C (a few microseconds): a
    message without such a varint (_LONG_VARINT) holds no integer out of range; only the
    others are walked field by field (`_check_fields`), which costs tens of microseconds for a
    heartbeat that acknowledges a few splits."""
    if _LONG_VARINT.search(message.SerializeToString()) is not None:
        _check_fields(message, "")


def _check_fields(message: Any, path: str) -> None:
    """check_request's walk: names are built only for what is refused, and a repeated integer
    field is checked by its least and greatest values."""
    for field, value in message.ListFields():
        if field.message_type is not None:
            prefix = f"{path}{field.name}."
            for item in (value if field.is_repeated else (value,)):
                _check_fields(item, prefix)
            continue
        repeated = field.is_repeated
        if not (isinstance(value, int) or (repeated and value and isinstance(value[0], int))):
            continue
        low = -1 if field.name in _MAY_BE_MINUS_ONE else 0
        if repeated and low <= min(value) and max(value) < MAX_REQUEST_INT:
            continue
        for number in (value if repeated else (value,)):
            if not low <= number < MAX_REQUEST_INT:
                raise ValueError(f"{path}{field.name}={number} is out of range [{low}, 2**62)")


# An operator looks for refused peers in the log; a peer that keeps asking gets one line a
# minute, with a count.
_refused = PeerLog(logger, "refused a peer of another version")


def servicer_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """Map handler exceptions to gRPC statuses with the message a caller can act on.

    Requests are checked first (`check_request`): a field out of range is INVALID_ARGUMENT
    and never reaches the state. NotReadyError -> UNAVAILABLE (retryable), ValueError ->
    INVALID_ARGUMENT, KeyError/LookupError -> NOT_FOUND, FailedPreconditionError ->
    FAILED_PRECONDITION, VersionMismatchError -> FAILED_PRECONDITION (marked in the trailing
    metadata, and logged once a minute per peer host),
    anything else -> INTERNAL with its type and message.
    """

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            check_request(request)
            return method(self, request, context)
        except NotReadyError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except VersionMismatchError as error:
            _refused.note(peer_host(context.peer()), f"{method.__name__}: {error}")
            context.set_trailing_metadata(((ERROR_KIND_KEY, VERSION_MISMATCH_KIND),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except LookupError as error:
            context.abort(grpc.StatusCode.NOT_FOUND, str(error.args[0] if error.args else error))
        except FailedPreconditionError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except Exception as error:  # surface to the caller, never kill the server
            logger.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")

    return wrapper


def rpc_error_to_exception(error: grpc.RpcError, what: str) -> Exception:
    """A non-retryable RpcError as the Python exception a user expects."""
    code = error.code()
    details = error.details() or ""
    if is_version_mismatch(error):
        return VersionMismatchError(f"{what}: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(f"{what}: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return LookupError(f"{what}: {details}")
    return RuntimeError(f"{what}: {code.name}: {details}")


def is_version_mismatch(error: grpc.RpcError) -> bool:
    """The dispatcher refused the call because the versions differ (see servicer_method)."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
    return any(key == ERROR_KIND_KEY and value == VERSION_MISMATCH_KIND
               for key, value in trailing)
