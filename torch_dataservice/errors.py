"""The error taxonomy: what crosses process boundaries and what a caller may retry."""

from __future__ import annotations

import functools
import importlib
import sys
import traceback as traceback_module
from typing import Any

import grpc


class RemoteError(Exception):
    """An exception raised in another process (user code on a worker, or a server).

    Carries the remote exception's qualified type, message and formatted traceback, so a
    consumer sees what failed and where without access to the worker's logs.

    Where the remote type exists here too (`KeyError`, a class of the user's script or of an
    installed package), the error is also an instance of that type, so `except KeyError:` works
    as with torch's DataLoader, which re-raises the worker's exception type. A type that cannot
    be found, or whose instances cannot be made without calling its constructor, stays a plain
    `RemoteError`.
    """

    def __new__(cls, remote_type: str = "", *args: Any, **kwargs: Any) -> RemoteError:
        made = (_remote_subclass(remote_type) if cls is RemoteError else None) or cls
        # The next __new__ after RemoteError in `made`'s MRO: the remote type's own (builtin) one.
        return super(RemoteError, made).__new__(made)  # noqa: UP008

    def __init__(self, remote_type: str, remote_message: str, remote_traceback: str = "") -> None:
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        text = f"{remote_type}: {remote_message}"
        if remote_traceback:
            text += f"\n\nRemote traceback:\n{remote_traceback}"
        Exception.__init__(self, text)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return RemoteError, (self.remote_type, self.remote_message, self.remote_traceback)


def _find_type(qualified: str) -> type | None:
    """The exception class named `module.QualName`, if this process has or can import it.

    Only classes already imported are looked up, plus modules that import without error: a
    name from the wire never runs code beyond a module import (the workers run the trainer's
    pickled code anyway, so the trust boundary is the same)."""
    module_name, _, qualname = qualified.rpartition(".")
    while module_name:
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except Exception:
                module = None
        if module is not None:
            found: Any = module
            for part in qualname.split("."):
                found = getattr(found, part, None)
            return found if isinstance(found, type) else None
        module_name, _, head = module_name.rpartition(".")
        qualname = f"{head}.{qualname}"
    return None


# Never re-created as themselves: a remote StopIteration must not end the reader's iteration
# silently, and these are not errors of the user's data code.
_NOT_RECREATED = (StopIteration, StopAsyncIteration)


@functools.lru_cache(maxsize=256)
def _remote_subclass(qualified: str) -> type | None:
    """A class that is both `RemoteError` and the remote exception's own type, or None."""
    found = _find_type(qualified) if qualified else None
    if (found is None or not issubclass(found, Exception) or issubclass(found, RemoteError)
            or issubclass(found, _NOT_RECREATED)):
        return None
    # A Python-level __new__ may need constructor arguments we do not have: keep RemoteError.
    if any("__new__" in vars(k) for k in found.__mro__ if k.__module__ != "builtins"):
        return None
    try:
        both = type(found.__name__, (RemoteError, found), {
            "__module__": found.__module__, "__qualname__": found.__qualname__,
            "__init__": RemoteError.__init__, "__str__": RemoteError.__str__})
        both.__new__(both)  # an incompatible builtin layout fails here, not at raise time
    except TypeError:
        return None
    return both


class ServiceUnavailableError(ConnectionError):
    """The service could not be reached before the deadline."""


def describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """(qualified type, message, traceback text) of an exception, for the wire."""
    exc_type = type(exc)
    qualified = f"{exc_type.__module__}.{exc_type.__qualname__}"
    text = "".join(traceback_module.format_exception(exc_type, exc, exc.__traceback__))
    return qualified, str(exc), text


RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)


# Trailing metadata of a RESOURCE_EXHAUSTED refusal from an overloaded dispatcher: how many ms
# to wait before trying again (dispatcher/cadence.py).
RETRY_AFTER_KEY = "x-torch-dataservice-retry-after-ms"


# What gRPC itself answers when a server has too many requests in its handlers
# (serving.Queue.max_concurrent): no hint comes with it, so peers wait
# GRPC_REFUSAL_RETRY_AFTER_MS (with jitter). Other RESOURCE_EXHAUSTED errors (a message over
# the size limit) are no overload and not retried. A request dropped from the core's queue
# (serving.Queue.pending) is answered CANCELLED with the details "CANCELLED" (a call the
# caller cancelled itself says "Locally cancelled by application!"): also an overload, waited
# out the same way, not retried at once as an outage would be.
GRPC_REFUSALS = ("Concurrent RPC limit exceeded",)
GRPC_DROPPED = "CANCELLED"
GRPC_REFUSAL_RETRY_AFTER_MS = 250


def retry_after_ms(error: BaseException) -> int | None:
    """How long an overloaded dispatcher's refusal asks to wait (its hint, or gRPC's own
    refusal or drop of a request past its queue); None for other errors."""
    if not isinstance(error, grpc.RpcError):
        return None
    if error.code() == grpc.StatusCode.CANCELLED:
        dropped = (getattr(error, "details", lambda: None)() or "") == GRPC_DROPPED
        return GRPC_REFUSAL_RETRY_AFTER_MS if dropped else None
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
    for key, value in trailing:
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    details = getattr(error, "details", lambda: None)() or ""
    if any(details.startswith(refusal) for refusal in GRPC_REFUSALS):
        return GRPC_REFUSAL_RETRY_AFTER_MS
    return None


def is_retryable(error: BaseException) -> bool:
    """Preempted / not-ready-yet / overloaded (with a retry-after) errors: the same call may
    succeed later."""
    return isinstance(error, grpc.RpcError) and (error.code() in RETRYABLE_CODES
                                                 or retry_after_ms(error) is not None)


class NotReadyError(Exception):
    """Raised by service handlers for 'not ready yet': mapped to UNAVAILABLE (retryable)."""


class ReaderReleasedError(RuntimeError, LookupError):
    """The dispatcher released a reader silent for longer than job_gc_timeout_ms (a paused or
    stalled process), and its iteration cannot be joined again. A `tds.DataLoader` registers
    what it had not yielded again (its epoch's dataset may be gone with the iteration)."""


class JournalCorruptError(RuntimeError):
    """The dispatcher's journal is damaged in the middle (not a torn tail from a crash):
    replaying past the damage would roll state back and hand out data twice. The message
    names the file and byte offset, and how to recover (`journal_recovery="truncate"`)."""


class FailedPreconditionError(RuntimeError):
    """A request that can never succeed in the server's current state (FAILED_PRECONDITION),
    e.g. a reader whose iteration a journal recovery dropped."""


class VersionMismatchError(RuntimeError):
    """The dispatcher refused this process: its wire protocol or Python `major.minor` differ
    from the dispatcher's (torch_dataservice/version.py). The message names both sides'
    versions; upgrade or downgrade one side so that they match."""


# Trailing metadata that marks a FAILED_PRECONDITION as a version refusal, so a client can
# raise VersionMismatchError without parsing the message.
ERROR_KIND_KEY = "x-torch-dataservice-error"
VERSION_MISMATCH_KIND = "version-mismatch"
