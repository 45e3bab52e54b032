"""Exactly-once DYNAMIC on the reader's side: what it received, acknowledged and fenced.

Workers tag each element with (split repetition, split index, offset). The reader
  - drops an element it received already (a split handed again after its worker died);
  - acknowledges an element when the consumer takes it: acknowledgements ride on the next
    heartbeat as [start, end) ranges of offsets (mostly one per split), so what was received
    and not taken goes to the job's other readers if this one dies (dispatcher/splits.py);
  - fences the tasks the dispatcher lists as lost (their worker may be a zombie): nothing
    more is accepted from them, and what it holds of them counts as acknowledged at once, so
    the fence and those acknowledgements reach the dispatcher in the same heartbeat;
  - forgets the offsets of a split once the dispatcher says it is settled;
  - drops what it holds unacknowledged of the splits the dispatcher handed to the others
    while it was declared silent (a paused process), and forgets those offsets.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch_dataservice.errors import RemoteError
from torch_dataservice.proto import common_pb2, dispatcher_pb2, worker_pb2
from torch_dataservice.wire.splits import index_ranges

Key = tuple[int, int]  # (split repetition, split index)


@dataclass(eq=False)  # identity: held in a WeakSet
class Batch:
    """Elements of one fetch, queued for the consumer."""

    payloads: deque = field(default_factory=deque)
    error: RemoteError | None = None
    borrow: bool = False  # payloads are ours alone: decode may build tensors over them
    # The (split key, offset) of each payload not yet taken, in order (None: untracked).
    tags: deque = field(default_factory=deque)
    task_id: int = 0
    nbytes: int = 0  # payload bytes received (stats)
    # The (repetition, index, offset) tag of each payload not yet taken, for what the consumer
    # yielded (client/consumed.py); unlike `tags`, a fence does not empty it.
    split_tags: deque = field(default_factory=deque)


class SplitReceived:
    """The offsets of one split received so far: every offset below `below`, and `extra`.

    Elements of a split arrive mostly in order, so this stays one int per split; the
    dispatcher's notice that a split is settled collapses it to one int whatever arrived.
    """

    __slots__ = ("below", "extra")

    def __init__(self) -> None:
        self.below = 0
        self.extra: set[int] | None = None

    def add(self, offset: int) -> bool:
        """Record `offset`; False if it was received already."""
        extra = self.extra
        if offset < self.below or (extra is not None and offset in extra):
            return False
        if offset != self.below:
            if extra is None:
                extra = self.extra = set()
            extra.add(offset)
            return True
        self.below += 1
        self._absorb()
        return True

    def forget(self, offsets: Iterable[int]) -> None:
        """`offsets` were dropped before they were taken: they may be received again."""
        offsets = set(offsets)
        if not offsets:
            return
        low = min(offsets)
        if low < self.below:
            self.extra = set(range(low, self.below)) | (self.extra or set())
            self.below = low
        assert self.extra is not None
        self.extra -= offsets
        self._absorb()

    def deliver_below(self, num_elements: int) -> None:
        """Every offset below `num_elements` was delivered (to this client or another)."""
        if num_elements > self.below:
            self.below = num_elements
            if self.extra is not None:
                self.extra = {o for o in self.extra if o >= num_elements} or None
            self._absorb()

    def _absorb(self) -> None:
        extra = self.extra
        while extra and self.below in extra:
            extra.remove(self.below)
            self.below += 1
        if not extra:
            self.extra = None


class Delivery:
    """One reader's exactly-once bookkeeping (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seen: dict[Key, SplitReceived] = {}
        self._unreported: dict[Key, list[int]] = {}
        # Taken by the consumer, not yet reported: appended without a lock by `acknowledge`.
        self._acked: deque[tuple[Key, int]] = deque()
        self._fenced: set[int] = set()
        self._unacked: weakref.WeakSet[Batch] = weakref.WeakSet()

    def keep_new(self, task_id: int, header: worker_pb2.ElementBatchHeader,
                 payloads: list) -> Batch:
        """A batch of the elements not received before (none from a fenced task)."""
        batch = Batch(task_id=task_id)
        with self._lock:
            if task_id in self._fenced:
                return batch
            for info, payload in zip(header.elements, payloads, strict=False):
                tag = None
                if info.has_split:
                    tag = (info.split.repetition, info.split.index), info.offset
                    received = self.seen.get(tag[0])
                    if received is None:
                        received = self.seen[tag[0]] = SplitReceived()
                    if not received.add(info.offset):
                        continue
                batch.payloads.append(payload)
                batch.tags.append(tag)
                batch.split_tags.append(None if tag is None else (*tag[0], tag[1]))
            if batch.tags:
                self._unacked.add(batch)
        return batch

    def acknowledge(self, batch: Batch) -> None:
        """The consumer took the batch's next element."""
        try:
            tag = batch.tags.popleft()
        except IndexError:  # fenced meanwhile: acknowledged then
            return
        if tag is not None:
            self._acked.append(tag)

    def fence(self, task_ids: Iterable[int]) -> None:
        """Accept nothing more from lost tasks; what is held of them counts as taken."""
        with self._lock:
            new = set(task_ids) - self._fenced
            if not new:
                return
            self._fenced.update(new)
            for batch in list(self._unacked):
                if batch.task_id in new:
                    while True:
                        try:
                            tag = batch.tags.popleft()
                        except IndexError:
                            break
                        if tag is not None:
                            self._unreported.setdefault(tag[0], []).append(tag[1])

    def drop_unacknowledged(self, keys: set[Key]) -> int:
        """Drop the elements received and not taken of the splits `keys`, forgetting their
        offsets; returns how many. The dispatcher declared this reader silent and handed those
        splits to the job's other readers without its report. Called by the consumer's thread
        between two takes, before the lost tasks are fenced (a fence counts what is held of
        them as taken)."""
        dropped = 0
        with self._lock:
            for batch in list(self._unacked):
                if not any(tag is not None and tag[0] in keys for tag in batch.tags):
                    continue
                kept = [(payload, tag, split_tag) for payload, tag, split_tag
                        in zip(batch.payloads, batch.tags, batch.split_tags, strict=True)
                        if tag is None or tag[0] not in keys]
                forgotten: dict[Key, list[int]] = {}
                for tag in batch.tags:
                    if tag is not None and tag[0] in keys:
                        forgotten.setdefault(tag[0], []).append(tag[1])
                for key, offsets in forgotten.items():
                    received = self.seen.get(key)
                    if received is not None:
                        received.forget(offsets)
                dropped += len(batch.payloads) - len(kept)
                for queue, column in ((batch.payloads, 0), (batch.tags, 1),
                                      (batch.split_tags, 2)):
                    queue.clear()
                    queue.extend(row[column] for row in kept)
        return dropped

    def is_fenced(self, task_id: int) -> bool:
        return task_id in self._fenced

    def report(self, request: Any) -> tuple[dict[Key, list[int]], list[int]]:
        """Fill a heartbeat or release request: what was taken since the last report, and
        the fenced tasks. Returns them, for `restore` if the request is not delivered."""
        with self._lock:
            reports, self._unreported = self._unreported, {}
            while True:
                try:
                    key, offset = self._acked.popleft()
                except IndexError:
                    break
                reports.setdefault(key, []).append(offset)
            fenced = sorted(self._fenced)
        for (repetition, index), offsets in reports.items():
            request.received.add(split=common_pb2.SplitKey(repetition=repetition, index=index),
                                 offset_ranges=index_ranges(offsets))
        if isinstance(request, dispatcher_pb2.ClientHeartbeatRequest):
            request.fenced_tasks.extend(fenced)
        return reports, fenced

    def restore(self, reports: dict[Key, list[int]]) -> None:
        """The request carrying `reports` was not delivered: send them with the next one."""
        with self._lock:
            for key, offsets in reports.items():
                self._unreported.setdefault(key, []).extend(offsets)

    def forget_settled(self, settled: Iterable[dispatcher_pb2.SettledSplit]) -> None:
        """The dispatcher says these splits are settled: keep one int per split, whatever
        of it arrived here."""
        with self._lock:
            for split in settled:
                received = self.seen.get((split.split.repetition, split.split.index))
                if received is not None:
                    received.deliver_below(split.num_elements)


def split_tags(header: worker_pb2.ElementBatchHeader) -> list[tuple[int, int, int] | None]:
    """Each element's (split repetition, split index, offset), None where untagged (none at
    all when no element is tagged: OFF and static sharding)."""
    if not any(info.has_split for info in header.elements):
        return []
    return [(info.split.repetition, info.split.index, info.offset) if info.has_split else None
            for info in header.elements]
