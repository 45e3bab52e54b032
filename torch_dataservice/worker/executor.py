"""The front's side of the executor processes: start them, route messages, notice deaths.

Executor processes are forked from a preloaded fork server (worker/launch.py: milliseconds each,
torch's pages shared) or, as a fallback, started as fresh interpreters; either way they never
re-import the user's `__main__` (a script without an `if __name__ == "__main__"` guard still
works) and never inherit gRPC's threads. Each is connected by a socketpair and says `Ready`
first: `start()` returns once all did. With `num_processes=0` the same executor loop runs on a
thread of this process (for debugging, or to hand elements to in-process readers as the objects
themselves: `LocalElement`, wire/inprocess.py; the GIL then limits a CPU-bound map to one core).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Protocol

import numpy as np

from torch_dataservice.pipeline.sharding import ReplicaPlan
from torch_dataservice.wire.inprocess import LocalElement
from torch_dataservice.wire.splits import SplitKey
from torch_dataservice.worker import launch, shm
from torch_dataservice.worker.executor_process import executor_main
from torch_dataservice.worker.local import LocalChannel
from torch_dataservice.worker.messages import (
    BigElement,
    Blocked,
    Bundle,
    CacheCounts,
    CacheUsed,
    DatasetBytes,
    End,
    Failed,
    FinishedSplit,
    FreeSegment,
    FromExecutor,
    LocalElements,
    Ready,
    Release,
    ReplicaKey,
    SegmentElement,
    SharedElement,
    Shutdown,
    SmallElements,
    SplitDone,
    SplitRequest,
    Stages,
    Start,
    TaskError,
    ToExecutor,
    read_exactly,
)

logger = logging.getLogger(__name__)

# How long start() waits for every executor's Ready: the first fork waits for the fork server's
# imports (seconds; much longer on an overloaded host).
READY_TIMEOUT_S = launch.FORK_TIMEOUT_S


Arrived = tuple[ReplicaKey, SplitKey | None, int,
                bytes | memoryview | np.ndarray | shm.PiecedPayload | LocalElement]


class ExecutorListener(Protocol):
    def on_elements(self, items: Iterable[Arrived]) -> None:
        """Elements (key, split, offset, payload) in the order the executor made them; one
        call per message, so that the listener locks and wakes once for several."""


    def on_end(self, key: ReplicaKey) -> None: ...

    def on_error(self, key: ReplicaKey, error: TaskError) -> None: ...

    def on_get_split(self, request: SplitRequest) -> None: ...

    def on_split_done(self, key: ReplicaKey, finished: FinishedSplit) -> None: ...

    def on_blocked(self, key: ReplicaKey) -> None: ...

    def on_executor_lost(self, slot: int) -> None: ...

    def on_stages(self, slot: int, totals: tuple[float, ...]) -> None: ...

    def on_cache(self, report: CacheCounts | CacheUsed) -> None: ...


RECEIVER_JOIN_S = 5.0


class _Slot:
    """One executor (process or thread) and the connection to it."""

    def __init__(self, index: int, use_process: bool, torch_threads: int | None,
                 cache_dir: str | None) -> None:
        self.index = index
        self.conn: Connection
        self.process: launch.ExecutorProcess | None = None
        self.thread: threading.Thread | None = None
        self.ready = threading.Event()  # the executor said Ready (or died before it)
        self.send_lock = threading.Lock()
        self.datasets: set[str] = set()
        self.alive = True
        self.receiver: threading.Thread | None = None  # the front's receive loop for it
        # An executor thread's elements, as objects (None for a process: they come encoded).
        self.local: LocalChannel | None = None
        if use_process:
            ours_sock, theirs_sock = socket.socketpair()
            self.conn = Connection(ours_sock.detach())
            try:
                self.process = launch.start_executor(theirs_sock.fileno(), torch_threads,
                                                     cache_dir)
            except BaseException:
                self.conn.close()
                raise
            finally:
                theirs_sock.close()
        else:
            ours, theirs = multiprocessing.Pipe(duplex=True)
            self.conn = ours
            self.local = LocalChannel()
            self.thread = threading.Thread(
                target=executor_main, args=(theirs, self.local),
                kwargs={"cache_dir": cache_dir}, name=f"tds-executor-{index}", daemon=True
            )
            self.thread.start()
        # The same socket, for the file descriptors of shared-memory segments (worker/shm.py).
        self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self.segments = shm.SegmentMap(self._free_segment)
        self._freed: deque[int] = deque()

    def stop_receiver(self) -> None:
        """End the receive loop, then close the connection. Closed first, its descriptor
        number could be reused (a restarted worker's new executor in this process) while the
        loop still reads it: that loop then took the new executor's messages, and the new
        worker hung. A shutdown wakes a loop blocked in recv (EOF) on every copy of the fd."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already disconnected
        receiver = self.receiver
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(timeout=RECEIVER_JOIN_S)
            if receiver.is_alive():  # leave the fds open rather than let them be reused
                logger.warning("executor %d: its receive loop did not end within %.0f s; "
                               "its connection is left open", self.index, RECEIVER_JOIN_S)
                return
        self.conn.close()
        self.sock.close()

    def _free_segment(self, segment: int) -> None:
        # Runs wherever the payload's last reference went, maybe under send_lock already (a
        # garbage collection inside a send): never block on it; the next send flushes.
        self._freed.append(segment)
        if self.send_lock.acquire(blocking=False):
            try:
                self._flush_freed()
            finally:
                self.send_lock.release()

    def _flush_freed(self) -> None:
        while self._freed:
            if not self.send_locked(FreeSegment(self._freed.popleft())):
                self._freed.clear()
                return

    def send(self, message: ToExecutor) -> bool:
        """Send a message of worker/messages.py; False if the executor is gone."""
        with self.send_lock:
            ok = self.send_locked(message)
            if self._freed:
                self._flush_freed()
            return ok

    def send_locked(self, message: ToExecutor) -> bool:
        """`send`, for a caller that holds `send_lock`."""
        try:
            self.conn.send(message)
            return True
        except (OSError, ValueError, BrokenPipeError):
            return False


class ExecutorPool:
    def __init__(self, num_processes: int, listener: ExecutorListener,
                 torch_threads: int | None = 1, cache_dir: str | None = None) -> None:
        self._use_processes = num_processes > 0
        # Set in executor processes only: a thread executor shares this process's torch.
        self._torch_threads = torch_threads
        self._cache_dir = cache_dir  # the worker's cache directory (worker/cache_index.py)
        self._size = max(1, num_processes)
        self._listener = listener
        self._slots: list[_Slot] = []
        self._closed = threading.Event()
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start the executors; return once each said Ready. An executor that dies first or
        a silent one past `timeout` fails the start, naming it (its stderr says why)."""
        for index in range(self._size):
            self._start_slot(index)
        with self._lock:
            slots = list(self._slots)
        if not self._use_processes:
            return  # an executor thread runs in this process: nothing to import or fork
        deadline = time.monotonic() + timeout
        for slot in slots:
            if not slot.ready.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    f"executor {slot.index} (pid {getattr(slot.process, 'pid', None)}) did not "
                    f"report ready within {timeout:.0f}s of the worker's start (start method: "
                    f"{launch.start_method() if self._use_processes else 'thread'})")
            if not slot.alive:
                raise RuntimeError(f"executor {slot.index} (pid "
                                   f"{getattr(slot.process, 'pid', None)}) exited before it "
                                   "was ready: its stderr says why")

    def _start_slot(self, index: int) -> None:
        slot = _Slot(index, self._use_processes, self._torch_threads, self._cache_dir)
        with self._lock:
            if index < len(self._slots):
                self._slots[index] = slot
            else:
                self._slots.append(slot)
        slot.receiver = threading.Thread(target=self._receive, args=(slot,),
                                         name=f"executor-rx-{index}", daemon=True)
        slot.receiver.start()

    def _receive(self, slot: _Slot) -> None:
        while True:
            try:
                self._handle(slot, slot.conn.recv())
            except (EOFError, OSError):
                break
            except Exception:
                logger.exception("executor message handling failed")
        slot.alive = False
        slot.ready.set()  # nobody waits for a dead executor
        if self._closed.is_set():
            return
        logger.error("executor %d died; restarting it", slot.index)
        with slot.send_lock:
            slot.datasets.clear()
        self._listener.on_executor_lost(slot.index)
        if not self._closed.is_set():
            self._start_slot(slot.index)

    def _handle(self, slot: _Slot, message: FromExecutor) -> None:
        listener = self._listener
        match message:
            case SmallElements(items):  # several per message
                listener.on_elements(items)
            case LocalElements(items):  # objects of an executor thread, by token
                assert slot.local is not None
                local = slot.local
                listener.on_elements([(key, split, offset, local.pop(token))
                                      for key, split, offset, token in items])
            case SegmentElement(key, split, offset, size, segment, capacity, start):  # shm
                if capacity:  # a new segment: its fd follows
                    slot.segments.add(segment, shm.recv_fd(slot.sock), capacity)
                listener.on_elements(
                    ((key, split, offset, slot.segments.payload(segment, size, start)),))
            case SharedElement(key, split, offset, size, pieces, files):  # fds follow
                payload = shm.pieced_payload(pieces, shm.recv_fds(slot.sock, files), size)
                listener.on_elements(((key, split, offset, payload),))
            case BigElement(key, split, offset, size):  # its payload follows as raw bytes
                listener.on_elements(
                    ((key, split, offset, read_exactly(slot.conn.fileno(), size)),))
            case End(key):
                listener.on_end(key)
            case Failed(key, error):
                listener.on_error(key, error)
            case SplitRequest():
                listener.on_get_split(message)
            case SplitDone(key, finished):
                listener.on_split_done(key, finished)
            case Blocked(key):
                listener.on_blocked(key)
            case Stages(totals):  # the executor's stage times (observability/stages.py)
                listener.on_stages(slot.index, totals)
            case CacheCounts() | CacheUsed():  # its cache() steps (worker/cache_index.py)
                listener.on_cache(message)
            case Ready():
                slot.ready.set()
            case Bundle(messages):  # what the executor had queued, in order
                for bundled in messages:
                    try:  # each on its own, as if it came alone (see _receive)
                        self._handle(slot, bundled)
                    except Exception:
                        logger.exception("executor message handling failed")
            case _:
                logger.warning("unknown message from executor %d: %r", slot.index,
                               type(message).__name__)

    def _slot(self, index: int) -> _Slot:
        with self._lock:
            return self._slots[index % self._size]

    def _live_slot(self, index: int, timeout_s: float = READY_TIMEOUT_S) -> _Slot:
        """Slot `index`, or once its executor died, the replacement its receive loop starts
        (within `timeout_s`): a task started in between would otherwise fail for an executor
        that is coming back (the next epoch's, right after a crash)."""
        deadline = time.monotonic() + timeout_s
        slot = self._slot(index)
        while not slot.alive and not self._closed.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
            slot = self._slot(index)
        return slot

    def start_replica(self, slot_index: int, key: ReplicaKey, dataset_id: str, *,
                      pipeline: Callable[[str], bytes], plan: ReplicaPlan,
                      compression: str | None, credits: int,
                      dependencies: Sequence[str] = ()) -> bool:
        """Start a replica of `dataset_id`, first sending the executor the datasets it does not
        have yet: `dependencies` (pipeline/shared_objects.py), then the pipeline itself
        (`pipeline(dataset_id)`: its bytes, asked for only when the executor lacks them)."""
        slot = self._live_slot(slot_index)
        # All under the slot's send lock: a release_dataset cannot fall between a dataset and
        # the start that needs it.
        with slot.send_lock:
            for needed in (*dependencies, dataset_id):
                if needed not in slot.datasets:
                    if not slot.send_locked(DatasetBytes(needed, pipeline(needed))):
                        return False
                    slot.datasets.add(needed)
            return slot.send_locked(Start(key, dataset_id, plan, compression, credits))

    def release_dataset(self, dataset_id: str) -> None:
        """Executors drop `dataset_id` (its bytes and unpickled shared object); sent again if a
        replica of it starts later."""
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            with slot.send_lock:
                if dataset_id in slot.datasets:
                    slot.datasets.discard(dataset_id)
                    slot.send_locked(Release(dataset_id))

    def send(self, slot_index: int, message: ToExecutor) -> None:
        self._slot(slot_index).send(message)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            slot.send(Shutdown())
        for slot in slots:
            if slot.process is not None:
                if not slot.process.wait(timeout=5):
                    slot.process.kill()
                    slot.process.wait(timeout=5)
            elif slot.thread is not None:
                slot.thread.join(timeout=5)
            slot.stop_receiver()
            slot.segments.close()
            if slot.local is not None:
                slot.local.clear()
