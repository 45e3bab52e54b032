"""The loop inside one executor process: run pipeline replicas, encode, send element bytes.

The worker front talks to it over one duplex `multiprocessing` connection. Each replica is a
thread here that iterates its pipeline, encodes every element (encoding and compression are
CPU work that must not run in the front) and sends it, but only while it holds credits: the
front grants a credit for every element it hands to a client, so a slow consumer stops the
pipeline instead of filling memory.

On a thread of the front's own process (`num_processes=0`) elements are not encoded here: each
goes to the front as the object itself (`LocalElement`, wire/inprocess.py) through an in-memory
`LocalChannel`, and only its token through the connection, so an in-process reader receives it
without an encode, a copy or a decode. Credits then count an estimate of its encoded size.

The messages both ways are the typed ones of worker/messages.py.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import cloudpickle

from torch_dataservice.errors import describe_exception
from torch_dataservice.observability import stages
from torch_dataservice.pipeline import (
    ExecutionContext,
    Pipeline,
    cache,
    collate,
    shared_objects,
)
from torch_dataservice.wire import codec
from torch_dataservice.wire.inprocess import LocalElement
from torch_dataservice.wire.splits import SplitKey
from torch_dataservice.worker import shm
from torch_dataservice.worker.local import LocalChannel
from torch_dataservice.worker.messages import (
    BigElement,
    Blocked,
    Bundle,
    CacheCounts,
    CacheUsed,
    Credit,
    DatasetBytes,
    End,
    Failed,
    FinishedSplit,
    FreeSegment,
    LocalElements,
    Ready,
    Release,
    ReplicaKey,
    SegmentElement,
    SharedElement,
    Shutdown,
    SmallElements,
    SplitDone,
    SplitReply,
    SplitRequest,
    Stages,
    Start,
    Stop,
    TaskError,
    ToExecutor,
    write_all,
)
from torch_dataservice.worker.replica_splits import SplitAsker
from torch_dataservice.worker.replica_splits import Stopped as _Stopped

logger = logging.getLogger(__name__)

# Elements an executor thread may hand over as objects and not yet see taken (num_processes=0).
LOCAL_CREDITS = 64

# Credits bound a replica's elements in flight by count; this bounds them by bytes too, so the
# count can be large enough for tiny elements (many per fetch) while big ones stay few.
MAX_BYTES_IN_FLIGHT = 64 << 20
# Larger payloads skip pickling and go as raw bytes after their header (see send_element).
INLINE_PAYLOAD_BYTES = 64 << 10
# A replica whose elements come at least this far apart writes each small one itself (no hand
# -off to the sender thread and no wake-up of it per element); faster ones are left to the
# sender, which writes all those queued meanwhile as one message.
SLOW_ELEMENT_S = 0.0005
# Payloads up to this size are copied once and sent in the background; larger ones are written
# from the element's own memory while the replica waits (a copy would cost more than the wait).
COPY_PAYLOAD_BYTES = 8 << 20


# What the sender thread's outbox holds besides messages for the front as they are: elements,
# which it batches (small and local ones) or writes with their payload (big ones).
class _Small(NamedTuple):
    item: tuple[ReplicaKey, SplitKey | None, int, bytes]


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere nothing).

    A released dataset is often tens of MB, and glibc keeps freed chunks below its adaptive
    mmap threshold for reuse: without this an executor's RSS would stay at the high-water mark
    of every dataset it ever held, and by how much would depend on timing. Releases are rare
    (a dataset no task needs any more), so the walk over the heap costs nothing that matters.
    """
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        function = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
        _malloc_trim = function if function is not None else (lambda pad: 0)
    _malloc_trim(0)


_malloc_trim: Any = None

class _Local(NamedTuple):
    item: tuple[ReplicaKey, SplitKey | None, int, int]  # ... LocalChannel token


@dataclass
class _Big:
    header: BigElement
    parts: list[codec.Part]
    written: threading.Event | None  # set once written: the replica waits for its memory


@dataclass
class _Segment:
    header: SegmentElement
    fd: int | None  # a new segment's, sent after the header (SCM_RIGHTS)


@dataclass
class _Shared:
    header: SharedElement
    fds: list[int]  # dups of the files', sent after the header (SCM_RIGHTS), then closed


_Outgoing = (_Small | _Local | _Big | _Segment | _Shared | End | Failed | SplitRequest
             | SplitDone | Blocked | Stages | CacheCounts | CacheUsed)

# A payload whose tensors of at least codec.SHARED_MIN_BYTES are in shared memory already,
# with at most SHARED_INLINE_BYTES of other bytes, is sent as those files (SharedElement),
# not copied into a segment.
SHARED_INLINE_BYTES = 1 << 20


def _shared_element(key: ReplicaKey, split: SplitKey | None, offset: int, size: int,
                    parts: list[codec.Part], shared: dict[int, tuple[int, int]]
                    ) -> _Shared | None:
    """The element as pieces of its tensors' shared-memory files (SharedElement), or None
    when too little of it is in them. The files' fds are dup'ed: the tensors may go first."""
    pieces: list[bytes | tuple[int, int, int]] = []
    inline: list[codec.Part] = []
    inline_bytes = 0
    files: dict[int, int] = {}  # a storage's fd -> its number in the message
    for index, part in enumerate(parts):
        source = shared.get(index)
        count = memoryview(part).nbytes
        if source is None or count < codec.SHARED_MIN_BYTES:
            inline.append(part)
            inline_bytes += count
            continue
        if inline:
            pieces.append(b"".join(inline))
            inline = []
        fd, at = source
        pieces.append((files.setdefault(fd, len(files)), at, count))
    if not files or inline_bytes > SHARED_INLINE_BYTES:
        return None
    if inline:
        pieces.append(b"".join(inline))
    fds: list[int] = []
    try:
        for fd in files:
            fds.append(os.dup(fd))
    except OSError:
        for fd in fds:
            os.close(fd)
        return None  # out of descriptors: copy into a segment instead
    return _Shared(SharedElement(key, split, offset, size, tuple(pieces), len(fds)), fds)


class _Replica:
    """One copy of a task's pipeline, running on its own thread."""

    def __init__(self, executor: ExecutorLoop, key: ReplicaKey, pipeline: Pipeline, *,
                 dataset_id: str, compression: str | None, use_splits: bool,
                 credits: int) -> None:
        self.key = key
        self.dataset_id = dataset_id
        self._executor = executor
        self._pipeline = pipeline
        self._compression = compression
        self._use_splits = use_splits
        self._credits = credits
        self._in_flight: deque[int] = deque()  # sizes of elements sent and not credited back
        self._bytes_in_flight = 0
        self._said_blocked = False  # the front was told this replica waits for credits
        self._cond = threading.Condition()
        self._stopped = False
        self.clock = executor.clocks.new()  # stage times (observability/stages.py)
        # Exactly-once DYNAMIC (see dispatcher/splits.py): the split being read, how many
        # elements each split produced so far, and the offsets clients already received of a
        # split handed again after its worker died.
        self._holding: SplitKey | None = None
        # The (repetition, index) key of the split last handed to this replica, and how many
        # were handed: `_run` tags elements with the key (the split's own repetition, which
        # for a requeued split may be older than the pass reading it) and restarts offsets at
        # each new split (the source's (repetition, index) may repeat: a requeued split and
        # the same index of the current pass look alike to it).
        self._split_key: SplitKey | None = None
        self._splits_taken = 0
        self._produced: dict[SplitKey, int] = {}
        self._skip: dict[SplitKey, frozenset[int]] = {}
        self._splits = SplitAsker(executor, key, credits)  # asked ahead, several if cheap
        self._taken_at: float | None = None  # perf_counter when it took its last split
        self.thread = threading.Thread(target=self._run, name=f"replica-{key}", daemon=True)

    # --- called by the executor's receive loop
    def add_credits(self, n: int) -> None:
        with self._cond:
            self._credits += n
            self._said_blocked = False
            # Credits say how many, not which: the oldest elements are the ones handed out
            # first, and in any case the bytes return to 0 when every element is credited.
            for _ in range(min(n, len(self._in_flight))):
                self._bytes_in_flight -= self._in_flight.popleft()
            self._cond.notify_all()

    def deliver_split(self, reply: SplitReply) -> None:
        self._splits.deliver(reply)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._splits.stop()

    # --- the replica thread
    def get_split(self, source_index: int, repetition: int) -> int | None:
        """The next split of `repetition`: one held or asked for (worker/replica_splits.py),
        which reports the split finished here before the next one's elements."""
        finished = None
        if self._holding is not None:
            # Synchronous chains ask for the next split only after emitting all of this one.
            finished = FinishedSplit(*self._holding, self._produced.pop(self._holding, 0))
            self._skip.pop(self._holding, None)
            self._holding = None
        asked = time.perf_counter()
        handed = self._splits.next(repetition, finished,
                                   None if self._taken_at is None else asked - self._taken_at)
        self._taken_at = time.perf_counter()
        self.clock.times[stages.SPLIT] += self._taken_at - asked
        if handed is None:
            return None
        key, skip = handed
        self._holding = self._split_key = key
        self._splits_taken += 1
        if skip:
            self._skip[self._holding] = frozenset(skip)
        return key.index

    def _cache_used(self, directory: str, fingerprint: str) -> None:
        self._executor.cache_used(CacheUsed(self.dataset_id, directory, fingerprint))

    def _take_credit(self, size: int) -> None:
        with self._cond:
            since = 0.0  # back-pressure is not counted as work (observability/stages.py)
            while not self._stopped and (self._credits <= 0 or (
                    self._in_flight and self._bytes_in_flight + size > MAX_BYTES_IN_FLIGHT)):
                since = since or time.perf_counter()
                if not self._said_blocked:  # the front batches credits: ask for them now
                    self._said_blocked = True
                    self._executor.send(Blocked(self.key))
                self._cond.wait(1.0)
            if since:
                self.clock.times[stages.BLOCKED] += time.perf_counter() - since
            if self._stopped:
                raise _Stopped
            self._credits -= 1
            self._in_flight.append(size)
            self._bytes_in_flight += size

    def _run(self) -> None:
        """The replica's one loop: pull, tag, encode, send, and time each stage. Kept whole:
        it is the per-element hot path, each step visible in one place."""
        ctx = ExecutionContext(split_provider=self if self._use_splits else None,
                               cache_dir=self._executor.cache_dir,
                               cache_used=self._cache_used)
        try:
            last_split = None
            offset = 0
            last_sent = time.monotonic()
            elements: Iterator[Any] = self._pipeline.iterate(ctx)
            clock, now = self.clock, time.perf_counter  # stage times: observability/stages.py
            compute = encode = 0.0
            count = 0
            published = encoded = now()
            for element in elements:
                computed = now()
                compute += computed - encoded  # credit waits and big sends: subtracted later
                # The source sets ctx.current_split right after get_split returns a split (on
                # this thread), so the split taken last is the one it describes.
                split = None if ctx.current_split is None else self._splits_taken
                if split != last_split:
                    last_split, offset = split, 0
                else:
                    offset += 1
                wire_split = None if split is None else self._split_key
                if wire_split is not None:
                    self._produced[wire_split] = offset + 1
                    skip = self._skip.get(wire_split)
                    if skip is not None and offset in skip:
                        continue  # a client received it from a worker that died since
                if self._executor.local is not None:  # a thread of the front's process
                    kept = LocalElement(element, self._compression, codec.estimate_size(element))
                    del element  # the front (and its reader) hold it, not this loop
                    self._take_credit(kept.size)
                    self._executor.send_local(self.key, wire_split, offset, element=kept)
                    del kept
                    count += 1
                    continue
                shared: dict[int, tuple[int, int]] | None = (
                    {} if self._executor.sends_shared else None)
                parts = codec.encode(element, self._compression, shared)
                encoded = now()
                encode += encoded - computed
                size = codec.payload_size(parts)
                self._take_credit(size)
                sent_at = time.monotonic()
                sending = now() if size > INLINE_PAYLOAD_BYTES else 0.0  # a copy or a wait
                self._executor.send_element(self.key, wire_split, offset, parts=parts,
                                            size=size, shared=shared,
                                            slow=sent_at - last_sent >= SLOW_ELEMENT_S)
                if sending:
                    clock.times[stages.SEND] += now() - sending
                last_sent = sent_at
                count += 1
                if encoded - published > stages.PUBLISH_S:
                    published = encoded
                    clock.publish(compute, encode, count)
                    compute = encode = 0.0
                    count = 0
            compute += now() - encoded  # the last pull, which found the end
            clock.publish(compute, encode, count)
            self._executor.send(End(self.key))
        except _Stopped:
            pass
        except BaseException as error:  # user code failed: the consumer must see it
            self._executor.send(Failed(self.key, TaskError(*describe_exception(error))))
        finally:
            self._executor.clocks.end(self.clock)
            self._executor.forget(self.key)


class ExecutorLoop:
    """Receives commands from the front and runs replicas until told to shut down."""

    def __init__(self, conn: Connection, local: LocalChannel | None = None,
                 cache_dir: str | None = None) -> None:
        self._conn = conn
        self.cache_dir = cache_dir  # the worker's directory for cache() (pipeline/cache.py)
        self._cache_reported: set[CacheUsed] = set()
        # Set when this loop runs on a thread of the front's process: elements go as objects.
        self.local = local
        self._datasets: dict[str, bytes] = {}
        # Shared objects (pipeline/shared_objects.py), unpickled at their first use; their bytes
        # are dropped then. The front releases both when no task of the worker needs them.
        self._objects: dict[str, Any] = {}
        self._replicas: dict[ReplicaKey, _Replica] = {}
        self._lock = threading.Lock()
        self.clocks = stages.ExecutorClocks()
        self._stages_shipped = 0.0
        # One sender thread writes everything, in order: small elements queued while it was
        # writing go out as one message (a write per tiny element would cost more than it).
        # None stops the sender.
        self._outbox: deque[_Outgoing | None] = deque()
        self._outbox_ready = threading.Condition()
        self._writing = False  # a thread (the sender or an inline writer) writes the outbox
        # Big payloads go through shared memory when the connection is a Unix socket (it
        # carries the segments' file descriptors).
        self._sock: socket.socket | None = None
        self._segments: shm.SegmentPool | None = None
        try:
            self._sock = socket.socket(fileno=os.dup(conn.fileno()))
            if self._sock.family == socket.AF_UNIX:
                self._segments = shm.SegmentPool()
        except OSError:
            pass
        if self._segments is not None and local is None:  # a process of its own
            collate.use_allocator(self._segments.array)
        self._sender = threading.Thread(target=self._send_loop, name="executor-send",
                                        daemon=True)
        self._sender.start()

    def send(self, message: _Outgoing | None, inline: bool = False, wake: bool = True) -> None:
        """Queue `message` for the front (None: stop the sender after what is queued). With
        `inline`, write it (and what is queued) on this thread if nobody is writing. Without
        `wake`, leave it for the next write (the caller knows one comes soon)."""
        with self._outbox_ready:
            self._outbox.append(message)
            if not inline or self._writing:
                if wake:
                    self._outbox_ready.notify()
                return
            self._writing = True
            messages = self._with_stages(list(self._outbox))
            self._outbox.clear()
        try:
            self._write(messages)
        except (OSError, ValueError):  # the front is gone; the receive loop ends too
            pass
        finally:
            with self._outbox_ready:
                self._writing = False
                self._outbox_ready.notify()  # the sender writes what came meanwhile

    def flush(self) -> None:
        """Have the sender write what is queued (messages sent without `wake`)."""
        with self._outbox_ready:
            if self._outbox:
                self._outbox_ready.notify()

    def send_local(self, key: ReplicaKey, split: SplitKey | None, offset: int, *,
                   element: LocalElement) -> None:
        """Hand `element` to the front as an object: its token travels in order with the
        other messages, batched like small elements."""
        assert self.local is not None
        self.send(_Local((key, split, offset, self.local.put(element))))

    @property
    def sends_shared(self) -> bool:
        """Whether elements may go as files (the front's socket passes fds: SharedElement)."""
        return self._segments is not None

    def send_element(self, key: ReplicaKey, split: SplitKey | None, offset: int, *,
                     parts: list[codec.Part], size: int,
                     shared: dict[int, tuple[int, int]] | None = None,
                     slow: bool = False) -> None:
        """Send an encoded element; a `slow` replica's small one is written right away.
        `shared`: its parts in shared-memory files (codec.encode)."""
        if size <= INLINE_PAYLOAD_BYTES:
            self.send(_Small((key, split, offset, b"".join(parts))), inline=slow)
            return
        if shared and self._segments is not None:
            # Its tensors' own pages: no copy here nor in the front (sendfile). As torch's
            # DataLoader workers share such tensors, the pipeline must not change them after.
            message = _shared_element(key, split, offset, size, parts, shared)
            if message is not None:
                self.send(message)
                return
        if self._segments is not None and size >= shm.SHM_PAYLOAD_BYTES:
            # A batch stacked into a segment (pipeline/collate.py): the payload is written
            # around it, and the batch goes out from where it is.
            placed = self._segments.place(parts)
            if placed is not None:
                segment, start, capacity, fd = placed
                self.send(_Segment(SegmentElement(key, split, offset, size, segment,
                                                  0 if fd is None else capacity, start), fd))
                return
            # One copy into shared memory, and the replica is free: the front maps it.
            acquired = self._segments.acquire(size)
            if acquired is not None:
                segment, mapping, fd = acquired
                shm.copy_into(mapping, parts)
                self.send(_Segment(SegmentElement(key, split, offset, size, segment,
                                                  0 if fd is None else len(mapping)), fd))
                return
        if size <= COPY_PAYLOAD_BYTES:
            # One copy (about a millisecond) frees the replica to compute the next element
            # while the sender writes this one, instead of idling until the front has read it.
            self.send(_Big(BigElement(key, split, offset, size), [b"".join(parts)], None))
            return
        # The parts are views of the element's memory: wait until they are written, so the
        # pipeline may reuse that memory as soon as it gets the next element.
        written = threading.Event()
        self.send(_Big(BigElement(key, split, offset, size), parts, written))
        while not written.wait(1.0) and self._sender.is_alive():
            pass

    def cache_used(self, used: CacheUsed) -> None:
        """Tell the front, once, where a dataset's cache entries are."""
        with self._lock:
            if used in self._cache_reported:
                return
            self._cache_reported.add(used)
        self.send(used)

    def _with_stages(self, messages: list[_Outgoing | None]) -> list[_Outgoing | None]:
        """`messages`, with the stage totals (and the cache figures) a few times a second
        and at each task's end: they ride with what is written anyway (call with the outbox
        lock held)."""
        now = time.perf_counter()
        if now - self._stages_shipped >= stages.SHIP_INTERVAL_S or any(
                m is None or isinstance(m, (End, Failed)) for m in messages):
            self._stages_shipped = now
            at = len(messages) - (bool(messages) and messages[-1] is None)
            messages.insert(at, Stages(self.clocks.totals()))
            counts = cache.COUNTS.take()
            if any(counts):
                messages.insert(at, CacheCounts(*counts))
        return messages

    def _send_loop(self) -> None:
        while True:
            with self._outbox_ready:
                while not self._outbox or self._writing:
                    self._outbox_ready.wait()
                self._writing = True
                messages = self._with_stages(list(self._outbox))
                self._outbox.clear()
            started = time.perf_counter()
            try:
                done = self._write(messages)
                self.clocks.write_seconds += time.perf_counter() - started
            except (OSError, ValueError):  # the front is gone; the receive loop ends too
                done = True
            with self._outbox_ready:
                self._writing = False
            if done:
                for message in messages:  # nobody waits forever for a big element
                    if isinstance(message, _Big) and message.written is not None:
                        message.written.set()
                return

    def _write(self, messages: list[_Outgoing | None]) -> bool:
        """Write `messages` in order; True once None (stop) is met. Consecutive small (or
        local) elements go as one message, and the messages between big payloads as one
        Bundle: one write here and one read in the front, not one per message (a cheap
        split's element and the report of the split before it go together)."""
        pending: list[Any] = []
        batch: list[tuple] = []
        batch_kind: type | None = None
        for message in messages:
            kind = _BATCHED.get(type(message))
            if batch and kind is not batch_kind:
                pending.append(batch_kind(batch))  # type: ignore[misc]
                batch = []
            if kind is not None:
                batch_kind = kind
                batch.append(message.item)  # type: ignore[union-attr]
                continue
            if message is None:
                self._send_pending(pending)
                return True
            if not isinstance(message, (_Segment, _Shared, _Big)):
                pending.append(message)
                continue
            self._send_pending(pending)  # a header goes alone: raw bytes or an fd follow it
            match message:
                case _Segment(header, fd):
                    try:
                        self._conn.send(header)
                        if fd is not None:
                            assert self._sock is not None  # set whenever segments are used
                            shm.send_fd(self._sock, fd)
                    finally:
                        if fd is not None:
                            os.close(fd)
                case _Shared(header, fds):
                    try:
                        self._conn.send(header)
                        assert self._sock is not None  # set whenever segments are used
                        shm.send_fds(self._sock, fds)
                    finally:
                        for fd in fds:
                            os.close(fd)
                case _Big(header, parts, written):  # its header, then its parts raw
                    self._conn.send(header)
                    # Raw writes of the encoded parts: no join here, no BytesIO on the other
                    # side.
                    for part in parts:
                        write_all(self._conn.fileno(), part)
                    if written is not None:
                        written.set()
        if batch:
            pending.append(batch_kind(batch))  # type: ignore[misc]
        self._send_pending(pending)
        return False

    def _send_pending(self, pending: list[Any]) -> None:
        """Send `pending` (and empty it): one message as it is, several as one Bundle."""
        if len(pending) == 1:
            self._conn.send(pending[0])
        elif pending:
            self._conn.send(Bundle(tuple(pending)))
        pending.clear()

    def forget(self, key: ReplicaKey) -> None:
        with self._lock:
            self._replicas.pop(key, None)

    def _start(self, start: Start) -> None:
        key, credits = start.key, start.credits
        try:
            with shared_objects.resolving(self._shared_object):
                pipeline = cloudpickle.loads(self._datasets[start.dataset_id])
            pipeline = start.plan.apply(pipeline)
        except BaseException as error:
            self.send(Failed(key, TaskError(*describe_exception(error))))
            return
        if self.local is not None:
            # Objects are counted by an estimate of their size, which can miss what an opaque
            # object holds (a C extension's buffer): bound their number more tightly too.
            credits = min(credits, LOCAL_CREDITS)
        replica = _Replica(self, key, pipeline, dataset_id=start.dataset_id,
                           compression=start.compression,
                           use_splits=start.plan.use_splits, credits=credits)
        with self._lock:
            self._replicas[key] = replica
        replica.thread.start()

    def _shared_object(self, dataset_id: str) -> Any:
        found = self._objects.get(dataset_id)
        if found is None:
            data = self._datasets.get(dataset_id)
            if data is None:
                raise LookupError(f"shared object {dataset_id!r} was not sent to this executor")
            found = self._objects[dataset_id] = cloudpickle.loads(data)
            del self._datasets[dataset_id]
        return found

    def _handle(self, message: ToExecutor) -> None:
        match message:
            case DatasetBytes(dataset_id, pipeline):
                self._datasets[dataset_id] = pipeline
            case Release(dataset_id):
                released = (self._datasets.pop(dataset_id, None),
                            self._objects.pop(dataset_id, None))
                del released
                trim_heap()
            case Start():
                self._start(message)
            case FreeSegment(segment):
                if self._segments is not None:
                    self._segments.release(segment)
            case Credit(key, n):
                if (replica := self._replica(key)) is not None:
                    replica.add_credits(n)
            case SplitReply(key):
                if (replica := self._replica(key)) is not None:
                    replica.deliver_split(message)
            case Stop(key):
                if (replica := self._replica(key)) is not None:
                    replica.stop()
            case _:
                logger.warning("executor: unknown message %r", type(message).__name__)

    def _replica(self, key: ReplicaKey) -> _Replica | None:
        with self._lock:
            return self._replicas.get(key)

    def run(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if type(message) is Shutdown:
                break
            self._handle(message)
        with self._lock:
            replicas = list(self._replicas.values())
        for replica in replicas:
            replica.stop()
        self.send(None)  # write what is queued, then stop the sender
        self._sender.join(timeout=5)
        if self._segments is not None:
            if self.local is None:
                collate.use_allocator(None)
            self._segments.close()
        if self._sock is not None:
            self._sock.close()


# Outbox entries the sender batches, and the message each batch goes as.
_BATCHED: dict[type, type] = {_Small: SmallElements, _Local: LocalElements}


def executor_main(conn: Connection, local: LocalChannel | None = None,
                  torch_threads: int | None = None, cache_dir: str | None = None) -> None:
    """Entry point of an executor process, or of a thread (num_processes=0) with `local`, the
    channel its elements reach the front on as objects; `cache_dir`: the worker's directory for
    `cache()` without a location (worker/cache_index.py). `torch_threads`: torch's intra-op
    threads here (WorkerConfig.executor_torch_threads; a process's cores are shared with the
    other executors, as torch's DataLoader sets one thread in its workers)."""
    logging.basicConfig(level=logging.WARNING)
    if cache_dir is not None and local is None:  # a process of its own: CachedDataset's
        cache.worker_cache_dir = cache_dir       # default store is the worker's
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    try:
        try:
            conn.send(Ready(os.getpid()))  # before the loop's sender thread writes anything
        except OSError:
            return  # the front is gone already
        ExecutorLoop(conn, local, cache_dir).run()
    finally:
        conn.close()
