"""`prefetch(n)`: run the upstream chain on a background thread, `n` elements ahead.

One queue-filling loop with a stop event (the torchdata `nodes/prefetch.py` shape): exceptions
raised upstream travel through the queue and are re-raised in the consumer, and a consumer that
stops early sets the event and joins the thread, which closes the upstream chain on its way out.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch_dataservice.pipeline._checks import check_int
from torch_dataservice.pipeline.context import ExecutionContext
from torch_dataservice.pipeline.transforms import Transform, Upstream, close_iterator

#: How often a producer blocked on a full queue checks whether the consumer went away.
_POLL_SECONDS = 0.05
_JOIN_SECONDS = 10.0


class _End:
    """Marks the end of the upstream chain in the queue."""


@dataclass(frozen=True)
class _Failure:
    """An exception raised upstream, on its way to the consumer."""

    error: BaseException


def _put(buffer: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put unless the consumer stopped; False means the consumer is gone."""
    while not stop.is_set():
        try:
            buffer.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _fill(
    open_upstream: Callable[[], Iterator[Any]], buffer: queue.Queue[Any], stop: threading.Event
) -> None:
    try:
        # Opened here, not in the consumer, so the upstream generators live on this thread.
        iterator = open_upstream()
        try:
            for element in iterator:
                if not _put(buffer, element, stop):
                    return
        finally:
            close_iterator(iterator)
    except BaseException as error:  # noqa: BLE001 - shipped to the consumer, re-raised there
        _put(buffer, _Failure(error), stop)
        return
    _put(buffer, _End(), stop)


@dataclass(frozen=True, eq=False, repr=False)
class Prefetch(Transform):
    """Up to `buffer_size` elements produced ahead of the consumer (0: no thread, pass-through).

    Stopping early joins the thread (for at most a few seconds), so it waits for the element the
    upstream is producing at that moment.
    """

    buffer_size: int

    def __post_init__(self) -> None:
        check_int("prefetch buffer_size", self.buffer_size, minimum=0)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        if self.buffer_size == 0:
            iterator = upstream.open()
            try:
                yield from iterator
            finally:
                close_iterator(iterator)
            return
        buffer: queue.Queue[Any] = queue.Queue(maxsize=self.buffer_size)
        stop = threading.Event()
        thread = threading.Thread(
            target=_fill, args=(upstream.open, buffer, stop), name="tds-prefetch", daemon=True
        )
        thread.start()
        try:
            while True:
                item = buffer.get()
                if isinstance(item, _End):
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            stop.set()
            # Bounded: an upstream stuck in a blocking call must not hang the consumer's exit;
            # the daemon thread then ends with its upstream.
            thread.join(timeout=_JOIN_SECONDS)

    def describe(self) -> str:
        return f"prefetch({self.buffer_size})"
