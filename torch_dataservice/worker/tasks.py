"""Tasks on a worker: the part of an iteration this worker runs.

A task is started lazily, on the first fetch (a task nobody reads costs nothing and takes no
splits). It runs as one or more replicas in the executor processes, as its sharding plan says
(pipeline/sharding.py); their encoded elements meet in one bounded buffer, in split order
(worker/reorder.py), which the task's runner (worker/runners.py) hands out. Every element
handed out returns a credit to the replica that made it, which is the back-pressure; credits
travel in batches and fetches wait a moment for fuller replies (worker/flow.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch_dataservice.observability.stages import StageTotals
from torch_dataservice.pipeline.sharding import plan_replicas
from torch_dataservice.pipeline.split_cursor import LocalSplitCursor
from torch_dataservice.proto import common_pb2, worker_pb2
from torch_dataservice.wire.inprocess import payload_nbytes
from torch_dataservice.worker.executor import Arrived, ExecutorPool
from torch_dataservice.worker.flow import LINGER_ELEMENTS, LINGER_S, Arrivals, CreditLedger
from torch_dataservice.worker.local import encode_elements
from torch_dataservice.worker.messages import (
    Credit,
    FinishedSplit,
    ReplicaKey,
    SplitKey,
    SplitReply,
    SplitRequest,
    Stop,
    TaskError,
)
from torch_dataservice.worker.reorder import SplitOrder
from torch_dataservice.worker.runners import Taken, TaskRunner, limits, make_runner
from torch_dataservice.worker.split_feed import Split, SplitFeed

logger = logging.getLogger(__name__)

# Elements a replica may have made and not yet handed out (the executor also caps their bytes):
# enough for several full fetches of tiny elements, so a fetch is not limited to a few of them.
CREDITS_PER_REPLICA = 1024
# A task keeps at most this part of a repetition's splits in stock (and hands at most as many
# to a replica at once): a worker that joins mid-epoch, or another at the epoch's end, finds
# splits left however cheap they were so far.
STOCK_EPOCH_PART = 1 / 16


def stock_depth(split_prefetch: int, num_splits: int) -> int:
    """The split feed's depth: WorkerConfig.split_prefetch, at most STOCK_EPOCH_PART of the
    repetition's splits (when known)."""
    if num_splits <= 0:
        return split_prefetch
    return min(split_prefetch, max(1, int(num_splits * STOCK_EPOCH_PART)))


@dataclass
class BufferedElement:
    payload: Any  # encoded bytes, or a LocalElement (an object: worker/local.py)
    split: SplitKey | None
    offset: int
    replica: int


@dataclass
class Task:
    definition: common_pb2.TaskDef
    replicas: list[int] = field(default_factory=list)  # executor slot of each replica
    buffer: deque[BufferedElement] = field(default_factory=deque)
    ended_replicas: set[int] = field(default_factory=set)
    error: TaskError | None = None
    local_cursor: LocalSplitCursor | None = None
    split_feed: SplitFeed | None = None  # DYNAMIC: the dispatcher's splits, asked ahead
    started: bool = False
    # The datasets its replicas were started from: its own and those it depends on.
    datasets: list[str] = field(default_factory=list)
    completed: bool = False  # end_of_sequence handed to a client
    last_fetch: float = 0.0  # time.monotonic() of the last fetch (a drain waits for readers)
    runner: TaskRunner | None = None  # see _runner
    order: SplitOrder = field(default_factory=SplitOrder)  # elements in split order
    credits: CreditLedger = field(default_factory=CreditLedger)
    arrivals: Arrivals = field(default_factory=Arrivals)
    # Buffer sizes fetches wait for: elements wake them only on reaching one (not each).
    wants: list[int] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def task_id(self) -> int:
        return self.definition.task_id

    def exhausted(self) -> bool:
        return self.started and len(self.ended_replicas) == len(self.replicas) and not self.buffer

    def running(self) -> bool:
        """Elements may still come: a replica runs and nothing failed."""
        return self.error is None and len(self.ended_replicas) < len(self.replicas)

    def wait(self, want: int, timeout_s: float) -> None:
        """Wait (under cond) until the buffer holds `want` elements, something ends, or
        `timeout_s` passed."""
        self.wants.append(want)
        try:
            self.cond.wait(timeout_s)
        finally:
            self.wants.remove(want)

    def wake(self) -> None:
        """Wake the fetches whose wait is over (under cond), after elements were added."""
        if self.wants and len(self.buffer) >= min(self.wants):
            self.cond.notify_all()


class TaskManager:
    """All tasks of this worker; implements the executor pool's listener."""

    def __init__(
        self,
        get_dataset: Callable[[str], common_pb2.DatasetDef],
        # (task, repetition, replica, request id, finished splits, max splits)
        #   -> the splits handed out, in order (none: end of the repetition's splits)
        get_split: Callable[[common_pb2.TaskDef, int, int, int, list[FinishedSplit], int],
                            list[Split]],
        report_completed: Callable[[int], None],
        num_executors: int,
        # The front's cache of dataset definitions: drop one (see _release_unused).
        forget_dataset: Callable[[str], None] = lambda dataset_id: None,
        split_prefetch: int = 64,  # WorkerConfig.split_prefetch
        executor_torch_threads: int | None = 1,  # WorkerConfig.executor_torch_threads
    ) -> None:
        self._get_dataset = get_dataset
        self._forget_dataset = forget_dataset
        self._get_split = get_split
        self._report_completed = report_completed
        self._lock = threading.Lock()
        self._tasks: dict[int, Task] = {}
        self._finished: set[int] = set()
        self._executors = ExecutorPool(num_executors, self, executor_torch_threads)
        self._split_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="get-split")
        self._split_prefetch = split_prefetch
        self._accepting = True  # False while the worker drains: no new task
        self.cross_trainer_cache_bytes = 1 << 30  # WorkerConfig.cross_trainer_cache_bytes
        self.stages = StageTotals()  # the executors' stage times (observability/stages.py)

    def start(self) -> None:
        self._executors.start()

    def close(self) -> None:
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            self._stop_replicas(task)
        self._executors.close()
        self._split_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ task set
    def task_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._tasks)

    def add(self, definition: common_pb2.TaskDef) -> None:
        """Idempotent: a task id already known is ignored (so is any while draining)."""
        with self._lock:
            if (self._accepting and definition.task_id not in self._tasks
                    and definition.task_id not in self._finished):
                self._tasks[definition.task_id] = Task(definition)

    def stop_accepting(self) -> None:
        """The worker drains: tasks the dispatcher assigns from now on are not taken."""
        with self._lock:
            self._accepting = False

    def serving(self, idle_s: float) -> list[int]:
        """The tasks a drain waits for: started, not at their end, and read within `idle_s`
        (a task nobody reads any more holds nothing a reader waits for)."""
        now = time.monotonic()
        with self._lock:
            tasks = list(self._tasks.values())
        return [t.task_id for t in tasks if t.started and not t.completed and t.error is None
                and now - t.last_fetch < idle_s]

    def delete(self, task_id: int) -> None:
        with self._lock:
            task = self._tasks.pop(task_id, None)
            self._finished.discard(task_id)
        if task is not None:
            self._stop_replicas(task)
            if task.split_feed is not None:
                task.split_feed.close()
            with task.cond:
                task.buffer.clear()
                task.cond.notify_all()
            self._release_unused(task.datasets or [task.definition.dataset_id])

    def _dependencies(self, dataset_id: str) -> list[str]:
        """The datasets `dataset_id` refers to, recursively, each before what needs it."""
        order: list[str] = []

        def visit(needed: str, path: tuple[str, ...]) -> None:
            if needed in path:
                raise ValueError(f"datasets refer to each other in a cycle: {path + (needed,)}")
            for dependency in self._get_dataset(needed).depends_on:
                visit(dependency, path + (needed,))
            if needed not in order:
                order.append(needed)

        visit(dataset_id, ())
        return order[:-1]

    def _release_unused(self, candidates: list[str]) -> None:
        """Free the datasets among `candidates` that no task of this worker needs any more:
        the front's definitions and the executors' bytes and shared objects.

        Tasks stay here until their iteration is garbage-collected (job_gc_timeout_ms after
        its last reader left), so a DataLoader's dataset, which every epoch's task refers to,
        is not sent and unpickled again for each epoch.
        """
        with self._lock:
            needed: set[str] = set()
            for task in self._tasks.values():
                needed.update(task.datasets or [task.definition.dataset_id])
        for dataset_id in candidates:
            if dataset_id not in needed:
                self._executors.release_dataset(dataset_id)
                self._forget_dataset(dataset_id)

    def _stop_replicas(self, task: Task) -> None:
        for index, slot in enumerate(task.replicas):
            self._executors.send(slot, Stop((task.task_id, index)))

    def get(self, task_id: int) -> Task | None:
        with self._lock:
            return self._tasks.get(task_id)

    @property
    def num_executors(self) -> int:
        return self._executors.size

    def buffered_elements(self) -> int:
        """Elements made and not yet handed out, over every task (metrics, status)."""
        with self._lock:
            return sum(len(task.buffer) for task in self._tasks.values())

    def on_stages(self, slot: int, totals: tuple[float, ...]) -> None:
        self.stages.update(slot, totals)

    def _ensure_started(self, task: Task) -> None:
        with task.cond:
            if task.started:
                return
            definition = task.definition
            dataset = self._get_dataset(definition.dataset_id)
            dependencies = self._dependencies(definition.dataset_id)
            task.datasets = [*dependencies, definition.dataset_id]
            plan = plan_replicas(definition, dataset, self._executors.size)
            if plan.local_splits:
                task.local_cursor = LocalSplitCursor(dataset.num_splits)
            elif plan.use_splits:
                task.split_feed = SplitFeed(
                    functools.partial(self._get_split, definition), self._split_pool,
                    stock_depth(self._split_prefetch, dataset.num_splits))
            compression = "AUTO" if definition.compression else None
            task.replicas = [index % self._executors.size
                             for index in range(len(plan.replicas))]
            task.started = True
            for index, replica in enumerate(plan.replicas):
                ok = self._executors.start_replica(
                    task.replicas[index], (task.task_id, index), definition.dataset_id,
                    lambda: dataset.pipeline, replica, compression, CREDITS_PER_REPLICA,
                    [(d, functools.partial(self._pipeline_bytes, d)) for d in dependencies])
                if not ok:
                    task.error = TaskError("RuntimeError", "executor process unavailable", "")

    def _pipeline_bytes(self, dataset_id: str) -> bytes:
        return self._get_dataset(dataset_id).pipeline

    # ------------------------------------------------------------------ fetching
    def fetch(self, request: worker_pb2.GetElementsRequest, wait_s: float) -> Taken:
        """The elements for one GetElements request, through the task's runner."""
        task = self.get(request.task_id)
        if task is None:  # finished here, or not known yet (get_elements tells which)
            return self.get_elements(request.task_id, *limits(request), wait_s)
        return self._runner(task).get(request, wait_s)

    def dropped_at_end(self, task_id: int) -> int:
        """Elements of the task its runner dropped at the end (coordinated reads)."""
        task = self.get(task_id)
        return task.runner.dropped_at_end if task is not None and task.runner else 0

    def _runner(self, task: Task) -> TaskRunner:
        with task.cond:
            if task.runner is None:
                def take(max_elements: int, max_bytes: int, wait_s: float) -> Taken:
                    return self.get_elements(task.task_id, max_elements, max_bytes, wait_s)

                def take_encoded(max_elements: int, max_bytes: int, wait_s: float) -> Taken:
                    # The cache serves an element to several trainers, which must not share
                    # one object: it keeps payloads, and each reader decodes its own copy.
                    elements, end, error = take(max_elements, max_bytes, wait_s)
                    failed = encode_elements(elements)
                    if failed is not None:
                        self.fail(task.task_id, failed)
                        return Taken(elements, False, failed)
                    return Taken(elements, end, error)

                task.runner = make_runner(task.definition, take, take_encoded,
                                          self.cross_trainer_cache_bytes)
            return task.runner

    def get_elements(self, task_id: int, max_elements: int, max_bytes: int,
                     wait_s: float) -> Taken:
        """Up to `max_elements` (and about `max_bytes`) elements; waits up to `wait_s` for one.

        Returns (elements, end_of_sequence, error). An unknown task that finished here is at
        its end; one never seen is 'not ready yet' (the heartbeat may not have delivered it).
        """
        task = self.get(task_id)
        if task is None:
            with self._lock:
                finished = task_id in self._finished
            if finished:
                return Taken([], True, None)
            raise LookupError(task_id)
        self._ensure_started(task)
        with task.cond:
            if not self._wait_for_elements(task, min(max_elements, LINGER_ELEMENTS), wait_s):
                return Taken([], False, None)
            taken: list[BufferedElement] = []
            size = 0
            while task.buffer and len(taken) < max_elements and (not taken or size < max_bytes):
                element = task.buffer.popleft()
                taken.append(element)
                element_size = payload_nbytes(element.payload)
                size += element_size
                if element.replica not in task.ended_replicas:
                    task.credits.taken(element.replica, element_size)
            error = task.error if not task.buffer else None
            end = task.exhausted() and error is None
            first_completion = end and not task.completed
            if end:
                task.completed = True
            due = task.credits.due()
        for replica, n in due:
            self._executors.send(task.replicas[replica], Credit((task_id, replica), n))
        if first_completion:
            self._report_completed(task_id)
        return Taken(taken, end and not taken, error)

    @staticmethod
    def _wait_for_elements(task: Task, want: int, wait_s: float) -> bool:
        """Under task.cond: wait up to `wait_s` for an element (or the end, or an error), then,
        if elements come steadily, up to LINGER_S more for `want` of them (a fuller reply).
        False: nothing came in time."""
        task.last_fetch = time.monotonic()
        deadline = task.last_fetch + wait_s
        while not task.buffer and task.error is None and not task.exhausted():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            task.wait(1, remaining)
        if len(task.buffer) < want and task.running() and task.arrivals.steady():
            deadline = min(deadline, time.monotonic() + LINGER_S)
            while len(task.buffer) < want and task.running():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                task.wait(want, remaining)
        return True

    # ------------------------------------------------------------------ executor listener
    def _task_for(self, key: ReplicaKey) -> Task | None:
        return self.get(key[0])

    def on_elements(self, items: Iterable[Arrived]) -> None:
        """Buffer elements from an executor: one lock and one wake-up per run of one replica's
        elements (a message carries several), not per element."""
        task = None
        key: ReplicaKey | None = None
        admitted: list[BufferedElement] = []
        for item_key, split, offset, payload in items:
            if item_key != key:
                self._buffer(task, admitted)
                key, admitted = item_key, []
                task = self._task_for(item_key)
            if task is not None:
                admitted.append(BufferedElement(payload, split, offset, item_key[1]))
        self._buffer(task, admitted)

    @staticmethod
    def _buffer(task: Task | None, elements: list[BufferedElement]) -> None:
        if task is None or not elements:
            return
        now = time.monotonic()
        order = task.order
        with task.cond:
            for element in elements:
                task.arrivals.note(now)
                if order.admit(element.replica, element.split, element):
                    task.buffer.append(element)
            task.wake()

    @staticmethod
    def _release(task: Task, elements: list[BufferedElement]) -> None:
        """Elements `task.order` let go, to the buffer (under task.cond)."""
        if elements:
            task.buffer.extend(elements)
            task.wake()

    def on_blocked(self, key: ReplicaKey) -> None:
        """A replica waits for credits: it gets those it is owed now, or its next one."""
        task = self._task_for(key)
        if task is None:
            return
        with task.cond:
            n = task.credits.blocked(key[1])
        if n:
            self._executors.send(task.replicas[key[1]], Credit(key, n))

    def on_end(self, key: ReplicaKey) -> None:
        task = self._task_for(key)
        if task is None:
            return
        with task.cond:
            self._release(task, task.order.finished(key[1]))
            task.ended_replicas.add(key[1])
            task.credits.ended(key[1])
            task.cond.notify_all()

    def on_error(self, key: ReplicaKey, error: TaskError) -> None:
        task = self._task_for(key)
        if task is None:
            return
        logger.warning("task %d failed: %s: %s", key[0], error.type, error.message)
        with task.cond:
            if task.error is None:
                task.error = error
            self._release(task, task.order.flush())
            task.ended_replicas.add(key[1])
            task.credits.ended(key[1])
            task.cond.notify_all()
        self._stop_replicas(task)

    def fail(self, task_id: int, error: TaskError) -> None:
        """The task failed outside its replicas (an element its readers cannot be sent): every
        reader gets `error` once the buffer is drained, and the replicas stop."""
        task = self.get(task_id)
        if task is None:
            return
        logger.warning("task %d failed: %s: %s", task_id, error.type, error.message)
        with task.cond:
            if task.error is None:
                task.error = error
            self._release(task, task.order.flush())
            task.cond.notify_all()
        self._stop_replicas(task)

    def on_get_split(self, request: SplitRequest) -> None:
        key, request_id, repetition = request.key, request.request_id, request.repetition
        task = self._task_for(key)
        if task is None:
            return
        replica, slot = key[1], task.replicas[key[1]]
        finished = request.finished
        with task.cond:  # it reports a split finished once it emitted all of it
            if finished is not None:
                self._release(task, task.order.finished(
                    replica, (finished.repetition, finished.index)))
            if task.local_cursor is not None:  # taken and numbered at once: in cursor order
                index = task.local_cursor.next(repetition)
                if index is not None:
                    task.order.handed(replica, (repetition, index))
        if task.local_cursor is not None:
            self._executors.send(slot, SplitReply(
                key, request_id, () if index is None else ((index, (), repetition),)))
            return
        if task.split_feed is None:
            self.on_error(key, TaskError("RuntimeError", "this task takes no splits", ""))
            return

        def reply(splits: list[Split]) -> None:
            if splits:
                with task.cond:  # numbered by the feed, which decides the hand-out order
                    for split in splits:
                        task.order.handed(replica, (split.repetition, split.index),
                                          split.handed)
            self._executors.send(slot, SplitReply(key, request_id, tuple(
                (split.index, split.skip, split.repetition) for split in splits)))

        task.split_feed.request_many(
            repetition, finished, reply,
            lambda kind, message: self.on_error(key, TaskError(kind, message, "")),
            request.want)

    def on_split_done(self, key: ReplicaKey, finished: FinishedSplit) -> None:
        """A replica finished a split and reads the next one it holds: the order moves on and
        the report goes to the dispatcher with the feed's next request."""
        task = self._task_for(key)
        if task is None:
            return
        with task.cond:
            self._release(task, task.order.finished(
                key[1], (finished.repetition, finished.index)))
        if task.split_feed is not None:
            task.split_feed.report(finished)

    def on_executor_lost(self, slot: int) -> None:
        self.stages.lost(slot)
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            for index, replica_slot in enumerate(task.replicas):
                if replica_slot == slot and index not in task.ended_replicas:
                    self.on_error((task.task_id, index), TaskError(
                        "RuntimeError", "the executor process running this task died", ""))
