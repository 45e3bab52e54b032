"""The iterator of one epoch of `tds.DataLoader`, and the readers that feed it.

A reading thread pulls from the service, restores torch's order, pins, and fills a small queue;
`__next__` takes from it, so a wait longer than `timeout` can be detected (torch's error, and,
as with torch, the next `next()` waits again). A batch whose making raised arrives as a
`BatchError` and is raised in its place; the epoch goes on with the next batch, as torch's.

Three readers, one per way an epoch's elements arrive:
- `read_positions`: map-style, `(position, batch)`; in order, a small reorder buffer.
- `read_shards`: an iterable dataset's `(shard, j, batch)`; in order, round-robin over the
  shards still running, which is the order of torch's in-order multi-worker iterator.
- `read_arrivals`: whatever arrives, as it arrives (in_order=False, job_name, coordinated
  reads), minus the first `skip` after a resume.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch_dataservice.errors import ReaderReleasedError
from torch_dataservice.observability.client import ClientStats, collecting
from torch_dataservice.serving import close_and_join
from torch_dataservice.torch.fetch import BatchError
from torch_dataservice.torch.shards import ShardEnd

logger = logging.getLogger(__name__)

_POLL_S = 0.1

Emit = Callable[[Any, Any], None]  # (position or None, batch)
# Runs on the reading thread: emits the epoch's batches; records the sources it opens in the
# list, so that closing the iterator can close them from another thread.
Reading = Callable[[Emit, list], None]
EXIT_JOIN_S = 2.0

# Iterators whose reading threads may still run: closed at exit, before the embedded service
# stops (embedded.py), so a script that broke out of an epoch exits promptly and quietly.
_live: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()


@dataclass
class Progress:
    """How far the latest iterator got: what `state_dict()` saves."""

    epoch: int
    yielded: int
    total: int | None
    rng: dict | None
    #: Positions yielded (map-style): what an out-of-order resume leaves out.
    positions: set[int] = field(default_factory=set)
    finished: bool = False
    #: DYNAMIC iterables (torch/iterable_state.py): the splits' elements yielded (a
    #: ConsumedSplits; batches arrive positioned by their (repetition, split, offset) tag),
    #: and the reading they come from, which asks the dispatcher for split sizes.
    consumed: Any = None
    source: Any = None


class _End:
    pass


@dataclass
class _Failure:
    error: BaseException


class _Stopped(Exception):
    pass


@dataclass
class IterOptions:
    timeout: float = 0
    depth: int = 2
    pin_device: str | None = None
    #: len() reported for an iterable dataset: torch warns when more batches come.
    iterable_len: int | None = None
    dataset: Any = None
    num_workers: int = 0
    length: Callable[[], int] | None = None
    #: torch's sampler draws: one index batch per next() (no workers), or one per batch
    #: yielded (workers, after their prefetch at iter()).
    on_next: Callable[[], None] | None = None
    on_yield: Callable[[], None] | None = None
    #: DataLoader.stats(): readers made on the reading thread add to it; next() counts
    #: batches and the seconds it blocked.
    stats: ClientStats | None = None


class LoaderIterator:
    """One epoch. `prepare()` (run at construction, or at the first `next()` when `lazy`, on
    the caller's thread: it may draw from the caller's RNGs) returns the reading to run on
    the thread."""

    def __init__(self, prepare: Callable[[], Reading], progress: Progress,
                 options: IterOptions, lazy: bool = False) -> None:
        self._progress = progress
        self._options = options
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(2, options.depth))
        self._stop = threading.Event()
        self._done = False
        self._prepare: Callable[[], Reading] | None = prepare
        self._thread: threading.Thread | None = None
        self._sources: list[Any] = []
        _live.add(self)
        if not lazy:
            self._start()

    def _start(self) -> None:
        prepare, self._prepare = self._prepare, None
        assert prepare is not None
        reading = prepare()
        # The thread holds no reference to this object, so an abandoned iterator is collected
        # and its __del__ stops the thread.
        self._thread = threading.Thread(
            target=_run_reading,
            args=(reading, self._queue, self._stop, self._options.pin_device, self._sources,
                  self._options.stats),
            name="tds-dataloader-reader", daemon=True)
        self._thread.start()

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        if self._progress.total is not None:
            return self._progress.total
        if self._options.length is None:
            raise TypeError("this DataLoader's iterator has no length")
        return self._options.length()

    def _get(self) -> Any:
        timeout = self._options.timeout
        if timeout > 0:
            try:
                return self._queue.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
        return self._queue.get()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._prepare is not None:
            try:
                self._start()
            except BaseException:
                self._finish(failed=True)
                raise
        if self._options.on_next is not None:
            self._options.on_next()
        blocked = time.perf_counter()
        item = self._get()  # a timeout leaves the iterator as it is: next() waits again
        stats = self._options.stats
        if stats is not None:
            stats.wait_seconds += time.perf_counter() - blocked
        if isinstance(item, _End):
            self._finish(failed=False)
            raise StopIteration
        if isinstance(item, _Failure):
            self._finish(failed=True)
            raise item.error
        position, batch = item
        if self._options.on_yield is not None:
            self._options.on_yield()
        progress = self._progress
        progress.yielded += 1
        if stats is not None:
            stats.batches += 1
        if isinstance(position, int):
            progress.positions.add(position)
        elif isinstance(position, tuple) and progress.consumed is not None:
            progress.consumed.add(*position)
        self._warn_if_past_len()
        if isinstance(batch, BatchError):
            raise batch.error()
        return batch

    def _warn_if_past_len(self) -> None:
        """torch's warning when an iterable dataset yields more than its reported len()."""
        options = self._options
        reported = options.iterable_len
        yielded = self._progress.yielded
        if reported is None or yielded <= reported:
            return
        message = (f"Length of IterableDataset {options.dataset} was reported to be {reported}"
                   f"(when accessing len(dataloader)), but {yielded} samples have been fetched. ")
        if options.num_workers > 0:
            message += (
                "For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                "for examples.")
        warnings.warn(message, stacklevel=3)

    def _finish(self, failed: bool) -> None:
        self._done = True
        if not failed:
            self._progress.finished = True
        self._stop.set()

    def close(self) -> None:
        """Stop reading and release the service's iteration (also done when the iterator is
        garbage-collected, and at exit)."""
        self._done = True
        self._stop.set()
        for source in list(self._sources):
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def join(self, deadline: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __del__(self) -> None:
        self._stop.set()


def close_all() -> None:
    """Close every live iterator and wait (briefly) for their reading threads."""
    close_and_join(list(_live), EXIT_JOIN_S)


def _run_reading(reading: Reading, out: queue.Queue, stop: threading.Event,
                 pin_device: str | None, sources: list, stats: ClientStats | None) -> None:
    """The reading thread: `reading` emits (position, batch) pairs into `out`, pinned; then
    the end, or the failure that stopped it."""

    def put(item: Any) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue
        raise _Stopped

    def emit(position: Any, batch: Any) -> None:
        if stop.is_set():
            raise _Stopped
        if pin_device is not None and not isinstance(batch, BatchError):
            from torch.utils.data._utils.pin_memory import pin_memory

            batch = pin_memory(batch, pin_device)
        put((position, batch))

    try:
        with collecting(stats) if stats is not None else contextlib.nullcontext():
            reading(emit, sources)
        put(_End())
    except _Stopped:
        pass
    except BaseException as error:  # reaches the consumer on its next __next__
        try:
            put(_Failure(error))
        except _Stopped:
            pass


def reading_from(open_source: Callable[[], Iterator[Any]],
                 read: Callable[[Iterator[Any], Emit], None]) -> Reading:
    """A reading that opens the service's source on the thread and closes it at the end."""

    def run(emit: Emit, sources: list) -> None:
        source = open_source()
        sources.append(source)
        try:
            read(source, emit)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    return run


def reading_positions(reader: Any, items: list[tuple[int, Any]],
                      register: Callable[[list[tuple[int, Any]]], Any] | None,
                      read: Callable[[Iterator[Any], Emit, list[int]], None]) -> Reading:
    """A map-style epoch's reading: `read(source, emit, positions)` from `reader`, which reads
    `items` (position, index batch). If the dispatcher released the reader (this process did
    not heartbeat for longer than job_gc_timeout_ms: a step holding the GIL) and the epoch's
    dataset went with its iteration, the items not emitted yet are registered again with
    `register` (as a resumed loader registers what it had not yielded), and reading goes on."""

    def run(emit: Emit, sources: list) -> None:
        emitted: set[int] = set()

        def tracked(position: Any, batch: Any) -> None:
            emitted.add(position)
            emit(position, batch)

        def read_all(reader: Any, positions: list[int]) -> None:
            reading_from(lambda: iter(reader), lambda source, out: read(
                source, out, positions))(tracked, sources)

        current, left = reader, items
        while True:
            try:
                read_all(current, [p for p, _ in left])
                return
            except ReaderReleasedError as error:
                left = [(p, b) for p, b in left if p not in emitted]
                if register is None or not left:
                    raise
                logger.warning("%s: the %d batch(es) of this epoch not yielded yet are "
                               "registered again, and the epoch goes on", error, len(left))
                current = register(left)

    return run


def read_positions(source: Iterator[tuple[int, Any]], emit: Emit, expected: list[int]) -> None:
    """`(position, batch)` pairs, emitted in the order of `expected` (ascending). The epoch
    ends as soon as the last expected one is out, without waiting for the service."""
    waiting: dict[int, Any] = {}
    pending = deque(expected)
    for position, batch in source:
        waiting[position] = batch
        while pending and pending[0] in waiting:
            next_position = pending.popleft()
            emit(next_position, waiting.pop(next_position))
        if not pending:
            return
    # Only a failed worker leaves gaps (DYNAMIC: each split at most once then).
    for position in sorted(waiting):
        emit(position, waiting[position])


def read_shards(source: Iterator[tuple[int, int, Any]], emit: Emit, num_shards: int,
                skip: int) -> None:
    """`(shard, j, batch)` triples, emitted round-robin over the shards still running (torch's
    in-order iterator: worker k's j-th batch, then worker k+1's...); the first `skip` are
    dropped (a resumed epoch)."""
    queues: dict[int, deque[Any]] = {k: deque() for k in range(num_shards)}
    running = list(range(num_shards))
    turn = 0
    emitted = 0

    def drain() -> None:
        nonlocal turn, emitted
        while running:
            turn %= len(running)
            shard_queue = queues[running[turn]]
            if not shard_queue:
                return
            batch = shard_queue.popleft()
            if isinstance(batch, ShardEnd):
                running.pop(turn)  # the next shard in the cycle takes its turn
                continue
            turn += 1
            emitted += 1
            if emitted > skip:
                emit(None, batch)

    for shard, _, batch in source:
        queues[shard].append(batch)
        drain()
    for shard in running:  # a shard lost with its worker: what arrived, in shard order
        for batch in queues[shard]:
            if not isinstance(batch, ShardEnd):
                emitted += 1
                if emitted > skip:
                    emit(None, batch)


def read_arrivals(source: Iterator[Any], emit: Emit, skip: int, positioned: bool,
                  tagged: bool) -> None:
    """Elements as they arrive. `positioned`: `(position, batch)` pairs (the position is kept
    for the state); `tagged`: `(shard, j, batch)` triples (shard ends dropped), or with
    `positioned` `(position, (shard, j, batch))`."""
    skipped = 0
    for element in source:
        position = None
        if positioned:
            position, element = element
        if tagged:
            element = element[2]
            if isinstance(element, ShardEnd):
                continue
        if skipped < skip:
            skipped += 1
            continue
        emit(position, element)
