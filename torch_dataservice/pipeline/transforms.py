"""Transform nodes: each one turns the iterator of the chain before it into a new iterator.

Nodes are frozen dataclasses validated in `__post_init__`, so a bad argument fails when the
pipeline is described, not when a worker runs it. Every transform closes its upstream iterator
when it stops early, so background threads further up (prefetch, parallel map) end promptly.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from torch_dataservice.pipeline._checks import (
    callable_name,
    check_callable,
    check_int,
    check_optional_int,
)
from torch_dataservice.pipeline.collate import is_default, stacking_collate
from torch_dataservice.pipeline.context import ExecutionContext
from torch_dataservice.pipeline.sources import Source

#: `num_parallel_calls=-1` (tf.data.AUTOTUNE) means one thread per core.
AUTOTUNE = -1


@dataclass(frozen=True)
class Upstream:
    """How a transform reaches the part of the chain before it."""

    source: Source
    #: Starts a fresh pass over the upstream chain (repeat calls it once per repetition).
    open: Callable[[], Iterator[Any]]
    #: The transforms of the upstream chain, in order (cache() fingerprints them).
    transforms: tuple[Transform, ...] = ()
    #: Starts a pass over the upstream chain under another context (cache() runs it per split).
    open_under: Callable[[ExecutionContext], Iterator[Any]] | None = None


class Transform(ABC):
    @abstractmethod
    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        """Produce this node's output for one pass."""

    @abstractmethod
    def describe(self) -> str:
        """Short text for `Pipeline.__repr__`, e.g. `batch(32)`."""

    def __repr__(self) -> str:
        # Not the dataclass repr: that would print whole arrays and datasets.
        return self.describe()


def close_iterator(iterator: Iterator[Any]) -> None:
    """Close a generator (running its cleanup) if it is one."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def open_inner(fn: Callable[[Any], Any], element: Any) -> Iterator[Any]:
    """Run a flat_map/interleave function and iterate what it returns.

    A returned Pipeline is a torch IterableDataset whose `__iter__` runs it locally with a plain
    context: inner pipelines never consume the outer source's splits.
    """
    inner = fn(element)
    if isinstance(inner, (str, bytes)) or not isinstance(inner, Iterable):
        raise TypeError(
            f"{callable_name(fn)} must return a Pipeline or an iterable of elements, "
            f"got {type(inner).__name__}"
        )
    return iter(inner)


class IterationCounter:
    """Counts the passes of one node, so each new pass can reshuffle deterministically.

    A pickled copy starts again at 0: the bytes of a pipeline do not depend on how often it was
    iterated locally, and every worker that unpickles it sees the same sequence of orders.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def next(self) -> int:
        with self._lock:
            count = self._count
            self._count += 1
            return count

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"IterationCounter({self._count})"


@dataclass(frozen=True, eq=False, repr=False)
class Map(Transform):
    """`fn(element)` for each element (no tuple unpacking, unlike tf).

    `num_parallel_calls` > 1 (or -1: one per core) runs `fn` on that many threads, keeping input
    order; it helps when `fn` releases the GIL (torch ops, I/O, decoding). None or 1 runs inline.
    """

    fn: Callable[[Any], Any]
    num_parallel_calls: int | None = None

    def __post_init__(self) -> None:
        check_callable("map fn", self.fn)
        calls = check_optional_int("num_parallel_calls", self.num_parallel_calls)
        if calls is not None and calls != AUTOTUNE and calls < 1:
            raise ValueError(
                f"num_parallel_calls must be >= 1, -1 (AUTOTUNE) or None, got {calls!r}"
            )

    def _num_threads(self) -> int:
        if self.num_parallel_calls == AUTOTUNE:
            return os.cpu_count() or 1
        return self.num_parallel_calls or 1

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        threads = self._num_threads()
        iterator = upstream.open()
        try:
            if threads == 1:
                for element in iterator:
                    yield self.fn(element)
            else:
                yield from self._parallel(iterator, threads)
        finally:
            close_iterator(iterator)

    def _parallel(self, iterator: Iterator[Any], threads: int) -> Iterator[Any]:
        # Bounded read-ahead: at most 2 * threads calls in flight, so memory stays flat.
        with ThreadPoolExecutor(threads, thread_name_prefix="tds-map") as pool:
            pending: deque[Future[Any]] = deque()
            try:
                for element in iterator:
                    pending.append(pool.submit(self.fn, element))
                    if len(pending) >= 2 * threads:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()

    def describe(self) -> str:
        calls = "" if self.num_parallel_calls is None else f", {self.num_parallel_calls}"
        return f"map({callable_name(self.fn)}{calls})"


@dataclass(frozen=True, eq=False, repr=False)
class Filter(Transform):
    predicate: Callable[[Any], Any]

    def __post_init__(self) -> None:
        check_callable("filter predicate", self.predicate)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        iterator = upstream.open()
        try:
            for element in iterator:
                if self.predicate(element):
                    yield element
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        return f"filter({callable_name(self.predicate)})"


@dataclass(frozen=True, eq=False, repr=False)
class Batch(Transform):
    """Groups `batch_size` consecutive elements and collates them (default: torch's
    `default_collate`, so a batch looks like a torch DataLoader batch)."""

    batch_size: int
    drop_remainder: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, minimum=1)
        if self.collate_fn is not None:
            check_callable("collate_fn", self.collate_fn)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        # torch's default, stacking big batches where an executor sends them from (collate.py)
        collate = stacking_collate if is_default(self.collate_fn) else self.collate_fn
        assert collate is not None
        iterator = upstream.open()
        try:
            batch: list[Any] = []
            for element in iterator:
                batch.append(element)
                if len(batch) == self.batch_size:
                    yield collate(batch)
                    batch = []
            if batch and not self.drop_remainder:
                yield collate(batch)
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        extra = ", drop_remainder=True" if self.drop_remainder else ""
        return f"batch({self.batch_size}{extra})"


def _is_batched_structure(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray, Mapping, list, tuple))


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def split_batch(batch: Any) -> list[Any]:
    """Cut a batch into its rows along dim 0.

    Tensors and arrays are split along dim 0. Dicts and namedtuples are structures: every
    component is split and rows are rebuilt with the same keys/type. A list or tuple whose items
    are all tensors/arrays/dicts/lists/tuples is a structure too (what `default_collate` makes of
    tuple elements); a list or tuple of anything else (scalars, str, bytes, None) is itself the
    batch, one row per item. Hence a batch that is a list of tensors (`collate_fn=list`) is read
    as a structure, not as rows.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("cannot unbatch a 0-dimensional tensor")
        return list(batch.unbind(0))
    if isinstance(batch, np.ndarray):
        if batch.ndim == 0:
            raise ValueError("cannot unbatch a 0-dimensional array")
        return list(batch)
    if isinstance(batch, Mapping):
        columns = {key: split_batch(value) for key, value in batch.items()}
        length = _common_length(columns)
        return [{key: column[i] for key, column in columns.items()} for i in range(length)]
    if isinstance(batch, (list, tuple)):
        if _is_namedtuple(batch) or (batch and all(_is_batched_structure(v) for v in batch)):
            parts = [split_batch(value) for value in batch]
            length = _common_length(dict(enumerate(parts)))
            rows = (tuple(part[i] for part in parts) for i in range(length))
            if _is_namedtuple(batch):
                return [type(batch)(*row) for row in rows]
            return [type(batch)(row) for row in rows]
        return list(batch)
    raise ValueError(f"cannot unbatch an element of type {type(batch).__name__}: {batch!r}")


def _common_length(columns: Mapping[Any, list[Any]]) -> int:
    lengths = {key: len(column) for key, column in columns.items()}
    if not lengths:
        raise ValueError("cannot unbatch an empty structure")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"cannot unbatch components of different lengths: {lengths}")
    return next(iter(lengths.values()))


@dataclass(frozen=True, eq=False, repr=False)
class Unbatch(Transform):
    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        iterator = upstream.open()
        try:
            for batch in iterator:
                yield from split_batch(batch)
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        return "unbatch()"


@dataclass(frozen=True, eq=False, repr=False)
class Shuffle(Transform):
    """tf's buffered shuffle, reshuffled on every pass.

    With a seed, pass k uses an RNG derived from (seed, k): the same object always produces the
    same sequence of orders. Without one, every pass draws fresh randomness.
    """

    buffer_size: int
    seed: int | None = None
    counter: IterationCounter = field(default_factory=IterationCounter, init=False, repr=False)

    def __post_init__(self) -> None:
        check_int("buffer_size", self.buffer_size, minimum=1)
        check_optional_int("seed", self.seed)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        iteration = self.counter.next()
        rng = random.Random() if self.seed is None else random.Random(f"{self.seed}:{iteration}")
        iterator = upstream.open()
        try:
            buffer: list[Any] = []
            for element in iterator:
                if len(buffer) < self.buffer_size:
                    buffer.append(element)
                    continue
                index = rng.randrange(self.buffer_size)
                yield buffer[index]
                buffer[index] = element
            rng.shuffle(buffer)
            yield from buffer
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        seed = "" if self.seed is None else f", seed={self.seed}"
        return f"shuffle({self.buffer_size}{seed})"


@dataclass(frozen=True, eq=False, repr=False)
class FlatMap(Transform):
    fn: Callable[[Any], Any]

    def __post_init__(self) -> None:
        check_callable("flat_map fn", self.fn)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        iterator = upstream.open()
        try:
            for element in iterator:
                inner = open_inner(self.fn, element)
                try:
                    yield from inner
                finally:
                    close_iterator(inner)
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        return f"flat_map({callable_name(self.fn)})"


@dataclass(frozen=True, eq=False, repr=False)
class Interleave(Transform):
    """tf `interleave`: cycle over `cycle_length` inner iterators, `block_length` elements from
    each in turn; an exhausted slot is refilled from the input when the cycle comes back to it.

    `cycle_length=None` means one slot per core, as tf's AUTOTUNE default (so the order depends on
    the host; pass it explicitly for reproducible order).
    """

    fn: Callable[[Any], Any]
    cycle_length: int | None = None
    block_length: int = 1

    def __post_init__(self) -> None:
        check_callable("interleave fn", self.fn)
        check_optional_int("cycle_length", self.cycle_length, minimum=1)
        check_int("block_length", self.block_length, minimum=1)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        cycle_length = self.cycle_length or os.cpu_count() or 1
        slots: list[Iterator[Any] | None] = [None] * cycle_length
        cycle_index = block_index = num_open = 0
        end_of_input = False
        iterator = upstream.open()
        try:
            while not end_of_input or num_open > 0:
                current = slots[cycle_index]
                if current is not None:
                    try:
                        element = next(current)
                    except StopIteration:
                        slots[cycle_index] = None
                        num_open -= 1
                        cycle_index, block_index = (cycle_index + 1) % cycle_length, 0
                        continue
                    yield element
                    block_index += 1
                    if block_index == self.block_length:
                        cycle_index, block_index = (cycle_index + 1) % cycle_length, 0
                elif not end_of_input:
                    try:
                        outer = next(iterator)
                    except StopIteration:
                        end_of_input = True
                        continue
                    slots[cycle_index] = open_inner(self.fn, outer)
                    num_open += 1
                else:
                    cycle_index, block_index = (cycle_index + 1) % cycle_length, 0
        finally:
            for slot in slots:
                if slot is not None:
                    close_iterator(slot)
            close_iterator(iterator)

    def describe(self) -> str:
        return (
            f"interleave({callable_name(self.fn)}, cycle_length={self.cycle_length}, "
            f"block_length={self.block_length})"
        )


def _empty_pass_ends(source: Any) -> bool:
    ends = getattr(source, "empty_pass_ends", None)
    return ends() if callable(ends) else True


@dataclass(frozen=True, eq=False, repr=False)
class Repeat(Transform):
    """Re-runs the upstream chain `count` times (None or -1: forever).

    Locally a pass that produced nothing ends the repeat, so an empty dataset cannot spin. Under a
    split provider an empty pass is normal (other workers may have taken every split of that
    repetition), so it only ends the repeat when the source has no splits at all; over a shared
    service job too, when the job's other readers consumed that pass (`empty_pass_ends`).
    """

    count: int | None = None

    def __post_init__(self) -> None:
        check_optional_int("count", self.count, minimum=-1)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        count = None if self.count == -1 else self.count
        source = upstream.source
        stop_on_empty = (
            ctx.split_provider is None or not source.splittable or source.num_splits == 0  # type: ignore[attr-defined]
        )
        for _ in itertools.count() if count is None else range(count):
            produced = False
            iterator = upstream.open()
            try:
                for element in iterator:
                    produced = True
                    yield element
            finally:
                close_iterator(iterator)
            if not produced and stop_on_empty and _empty_pass_ends(source):
                return

    def describe(self) -> str:
        return "repeat()" if self.count is None else f"repeat({self.count})"


@dataclass(frozen=True, eq=False, repr=False)
class Take(Transform):
    """The first `n` elements (-1: all). Reads no element past the n-th, so it takes no extra
    split from the dispatcher."""

    n: int

    def __post_init__(self) -> None:
        check_int("take n", self.n, minimum=-1)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        if self.n == 0:
            return
        iterator = upstream.open()
        try:
            yield from itertools.islice(iterator, None if self.n == -1 else self.n)
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        return f"take({self.n})"


@dataclass(frozen=True, eq=False, repr=False)
class Skip(Transform):
    """Drops the first `n` elements (-1: all of them, as tf)."""

    n: int

    def __post_init__(self) -> None:
        check_int("skip n", self.n, minimum=-1)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        iterator = upstream.open()
        try:
            if self.n == -1:
                for _ in iterator:
                    pass
                return
            yield from itertools.islice(iterator, self.n, None)
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        return f"skip({self.n})"
