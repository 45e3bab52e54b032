"""The error taxonomy: what crosses process boundaries and what a caller may retry."""

from __future__ import annotations

import traceback as traceback_module

import grpc


class RemoteError(Exception):
    """An exception raised in another process (user code on a worker, or a server).

    Carries the remote exception's qualified type, message and formatted traceback, so a
    consumer sees what failed and where without access to the worker's logs.
    """

    def __init__(self, remote_type: str, remote_message: str, remote_traceback: str = "") -> None:
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        text = f"{remote_type}: {remote_message}"
        if remote_traceback:
            text += f"\n\nRemote traceback:\n{remote_traceback}"
        super().__init__(text)


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


def is_retryable(error: BaseException) -> bool:
    """Preempted / not-ready-yet errors: the same call may succeed later."""
    return isinstance(error, grpc.RpcError) and error.code() in RETRYABLE_CODES


class NotReadyError(Exception):
    """Raised by service handlers for 'not ready yet': mapped to UNAVAILABLE (retryable)."""
