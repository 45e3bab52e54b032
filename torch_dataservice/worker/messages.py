"""The protocol between the worker front and its executor processes: one typed message each way.

Both sides `match` on the message's type, never on a tuple's length, so a change to a message
shows in one place and a type checker follows it across the process boundary. Messages are
NamedTuples: they pickle almost as cheaply as plain tuples (this is the per-element path).

front -> executor                            executor -> front
  DatasetBytes  a pipeline's (or shared        SmallElements   encoded elements, several
                object's) bytes                                per message
  Release       drop a dataset                 LocalElements   tokens of objects on the
  Start         run a replica                                  front's LocalChannel
  Credit        n more elements may be made    BigElement      header; `size` raw bytes follow
  SplitReply    the splits asked for (or none) SegmentElement  a payload in shared memory
  Stop          stop a replica                                 (worker/shm.py); capacity > 0:
  FreeSegment   a segment may be reused                        a new segment, its fd follows
  Shutdown      end the executor               SharedElement   a payload whose big tensors
                                                               are in shared memory already;
                                                               their files' fds follow
                                               End / Failed    a replica ended / failed
                                               SplitRequest    a replica wants its next splits
                                               SplitDone       a replica finished a split
                                               Blocked         a replica waits for credits
                                               Ready           the executor is set up (first)
                                               Bundle          several of these as one write
                                               CacheCounts     cache() hits, misses, evictions
                                               CacheUsed       a dataset's cache() entries
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from torch_dataservice.pipeline.sharding import ReplicaPlan
from torch_dataservice.wire.splits import HandedSplit, SplitKey

ReplicaKey = tuple[int, int]  # (task id, replica index)
# (replica, split or None, offset in the split, payload: bytes, or a LocalChannel token)
ElementItem = tuple[ReplicaKey, "SplitKey | None", int, Any]


class TaskError(NamedTuple):
    """A pipeline's failure, for the reader: (qualified type, message, traceback text)."""

    type: str
    message: str
    traceback: str


class FinishedSplit(NamedTuple):
    """A split a replica finished producing, reported to the dispatcher (exactly-once)."""

    repetition: int
    index: int  # type: ignore[assignment]  # the proto's name; hides tuple.index
    elements: int


# ------------------------------------------------------------------ front -> executor
class DatasetBytes(NamedTuple):
    dataset_id: str
    pipeline: bytes


class Release(NamedTuple):
    dataset_id: str


class Start(NamedTuple):
    key: ReplicaKey
    dataset_id: str
    plan: ReplicaPlan
    compression: str | None
    credits: int


class Credit(NamedTuple):
    key: ReplicaKey
    n: int


class SplitReply(NamedTuple):
    """The splits for request `request_id`, in hand-out order (at most the `want` asked for);
    none: no more splits in the repetition asked for."""

    key: ReplicaKey
    request_id: int
    splits: tuple[HandedSplit, ...]


class Stop(NamedTuple):
    key: ReplicaKey


class FreeSegment(NamedTuple):
    segment: int


class Shutdown(NamedTuple):
    pass


# ------------------------------------------------------------------ executor -> front
class SmallElements(NamedTuple):
    items: list[ElementItem]


class LocalElements(NamedTuple):
    items: list[ElementItem]


class BigElement(NamedTuple):
    key: ReplicaKey
    split: SplitKey | None
    offset: int
    size: int


class SegmentElement(NamedTuple):
    key: ReplicaKey
    split: SplitKey | None
    offset: int
    size: int
    segment: int
    capacity: int
    start: int = 0  # where the payload starts in the segment


class SharedElement(NamedTuple):
    """A payload whose big tensors are in shared-memory files of their own (worker/shm.py):
    `pieces` in order, each bytes or (file number, offset, count); the files' fds follow."""

    key: ReplicaKey
    split: SplitKey | None
    offset: int
    size: int
    pieces: tuple[bytes | tuple[int, int, int], ...]
    files: int


class End(NamedTuple):
    key: ReplicaKey


class Failed(NamedTuple):
    key: ReplicaKey
    error: TaskError


class Blocked(NamedTuple):
    """The replica ran out of credits (worker/flow.py): it waits for the front to send some."""

    key: ReplicaKey


class SplitRequest(NamedTuple):
    """A replica wants up to `want` more splits (cheap splits are asked for several at a time),
    having finished `finished` (a report the ask carries: see SplitDone)."""

    key: ReplicaKey
    request_id: int
    repetition: int
    finished: FinishedSplit | None
    want: int = 1


class SplitDone(NamedTuple):
    """A replica finished `finished` and reads the next split it holds, with no ask."""

    key: ReplicaKey
    finished: FinishedSplit


class Bundle(NamedTuple):
    """Several messages written as one (what the executor had queued between big payloads)."""

    messages: tuple[Any, ...]


class Ready(NamedTuple):
    """The executor's first message: it is set up and reads commands (the worker's start()
    returns once every executor said so)."""

    pid: int


class Stages(NamedTuple):
    """The executor's running stage totals (observability/stages.py), a few times a second."""

    totals: tuple[float, ...]


class CacheCounts(NamedTuple):
    """The executor's cache() figures since its last report (pipeline/cache.py), with its
    stage times."""

    hits: int
    misses: int
    evictions: int


class CacheUsed(NamedTuple):
    """A replica of `dataset_id` keeps split entries in `directory`/`fingerprint` (sent once
    per executor and dataset): the front lists the splits it holds (worker/cache_index.py)."""

    dataset_id: str
    directory: str
    fingerprint: str


ToExecutor = DatasetBytes | Release | Start | Credit | SplitReply | Stop | FreeSegment | Shutdown
FromExecutor = (SmallElements | LocalElements | BigElement | SegmentElement | SharedElement
                | End | Failed
                | SplitRequest | SplitDone | Blocked | Stages | Ready | Bundle | CacheCounts
                | CacheUsed)


# ------------------------------------------------------------------ raw payload bytes
def write_all(fd: int, data: Any) -> None:
    """Write a buffer whole (a BigElement's payload follows its header this way)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view):]


def read_exactly(fd: int, size: int) -> memoryview:
    """`size` bytes from `fd` into one buffer (the only copy on the receiving side)."""
    view = memoryview(np.empty(size, dtype=np.uint8))  # unlike bytearray, not zero-filled first
    received = 0
    while received < size:
        n = os.readv(fd, [view[received:]])
        if n == 0:
            raise EOFError(f"connection closed {size - received} bytes before the payload's end")
        received += n
    return view
