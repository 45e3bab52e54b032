"""Where the dispatcher's updates go before any reply depends on them.

Without fault tolerance nothing is kept (`NullJournal`). The fault-tolerant journal
(`file_journal.FileJournal`) writes each update to `work_dir` and replays them on start.

The service appends under its lock, in apply order, one record per request (service.py
`_changes`; if an append fails, it rebuilds its state from `reread()`), and calls `sync()`
before every reply with the lock released: a reply never depends on an update that is not
durable, and concurrent requests share one fsync; `durable` wraps every handler that applies a
change with that sync.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch_dataservice.proto import dispatcher_pb2


class Journal(Protocol):
    # The record `replay` is at (for errors), and the damage a recovering replay cut at.
    replay_position: str
    recovered_from: str | None

    def append(self, update: dispatcher_pb2.Update) -> None: ...

    def sync(self) -> None: ...

    def maybe_compact(self, state: Any) -> bool: ...

    def compact(self, state: Any) -> None: ...

    def replay(self) -> Iterator[dispatcher_pb2.Update]: ...

    def reread(self) -> Iterator[dispatcher_pb2.Update]: ...

    def close(self) -> None: ...


class NullJournal:
    """Keeps nothing: a restarted dispatcher starts empty."""

    replay_position = ""
    recovered_from: str | None = None

    def append(self, update: dispatcher_pb2.Update) -> None:
        pass

    def sync(self) -> None:
        pass

    def maybe_compact(self, state: Any) -> bool:
        return False

    def compact(self, state: Any) -> None:
        pass

    def replay(self) -> Iterator[dispatcher_pb2.Update]:
        return iter(())

    def reread(self) -> Iterator[dispatcher_pb2.Update]:
        raise RuntimeError("a NullJournal keeps nothing to rebuild a state from (and its "
                           "appends never fail)")

    def close(self) -> None:
        pass


def durable(method: Callable[..., Any]) -> Callable[..., Any]:
    """Sync the journal after the handler released the lock, before the reply leaves (not
    counted as pending: Cadence.waiting_for_disk); time the request for
    tds_dispatcher_rpc_seconds{method}, from when it was queued for a handler thread (the
    dispatcher's own latency: its queue, its handling and its journal)."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: Any) -> Any:
        started = self._cadence.queued_at() or time.monotonic()
        try:
            response = method(self, request, context)
            with self._cadence.waiting_for_disk():
                self._journal.sync()
            return response
        finally:
            self._observe.rpc(name, time.monotonic() - started)

    return wrapper
