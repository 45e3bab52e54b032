"""No gRPC call of ours is in flight when this process forks.

gRPC's fork handlers stop its threads before a fork and restart them after, in both
processes, but only if no other thread is inside gRPC then; otherwise they print "Other
threads are currently calling into gRPC, skipping fork() handlers" and the child inherits
gRPC mid-call (a torch DataLoader worker forked so dies of SIGSEGV). A reader's heartbeat is
such a call, and a training script forks whenever it likes (torch's DataLoader workers, a
multiprocessing pool). So each of our calls holds the gate (`held`; `rpc.channel_to`'s
channels do it for every unary call), and a fork closes it (os.register_at_fork): calls that
would start wait until the fork is done, and the fork waits for those in flight. Our calls
have deadlines; one still running after `FORK_WAIT_S` is logged and the fork goes on.

This covers gRPC clients only: a gRPC server always has a thread inside gRPC, so a process
that may fork runs none (torch/embedded.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

logger = logging.getLogger(__name__)

FORK_WAIT_S = 5.0


class _Gate:
    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._calls = 0
        self._forks = 0  # forks under way (two threads may fork at once)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._forks)
            self._calls += 1
        try:
            yield
        finally:
            with self._condition:
                self._calls -= 1
                if not self._calls:
                    self._condition.notify_all()

    def before_fork(self) -> None:
        with self._condition:
            self._forks += 1
            if not self._condition.wait_for(lambda: not self._calls, FORK_WAIT_S):
                logger.warning("fork(): %d gRPC call(s) of torch_dataservice still running "
                               "after %.0f s; forking anyway (gRPC may say it skips its fork "
                               "handlers)", self._calls, FORK_WAIT_S)

    def after_fork_in_parent(self) -> None:
        with self._condition:
            self._forks -= 1
            self._condition.notify_all()


_gate = _Gate()


def held() -> contextlib.AbstractContextManager[None]:
    """Hold off forks for the duration (one gRPC call: a stream read to its end)."""
    return _gate.held()


class _Held(grpc.UnaryUnaryClientInterceptor):
    """Every unary call of a channel holds the gate (a blocking call runs inside)."""

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any,
                              request: Any) -> Any:
        with _gate.held():
            return continuation(details, request)


def gated(channel: grpc.Channel) -> grpc.Channel:
    """`channel`, each of whose unary calls holds off forks."""
    return grpc.intercept_channel(channel, _Held())


def _before_fork() -> None:
    _gate.before_fork()


def _after_fork_in_parent() -> None:
    _gate.after_fork_in_parent()


def _after_fork_in_child() -> None:
    global _gate
    _gate = _Gate()  # no call of the parent's runs here, nor does its lock


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
