"""Tasks on a worker: the part of an iteration this worker runs, and who gets which element.

A task is started lazily, on the first fetch (a task nobody reads costs nothing and takes no
splits). It runs as one or more replicas in the executor processes; their encoded elements
meet in one bounded buffer that fetches drain first-come-first-served. Every element handed
out returns a credit to the replica that made it, which is the back-pressure.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch_dataservice.observability.stages import StageTotals
from torch_dataservice.pipeline.split_cursor import LocalSplitCursor
from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.proto import common_pb2
from torch_dataservice.wire.inprocess import payload_nbytes
from torch_dataservice.worker.executor import ExecutorPool
from torch_dataservice.worker.executor_process import ReplicaKey
from torch_dataservice.worker.local import encode_elements
from torch_dataservice.worker.runners import CachingRunner, RoundRobinRunner, TakeResult
from torch_dataservice.worker.split_feed import FinishedSplit, Split, SplitFeed

logger = logging.getLogger(__name__)

OFF, DYNAMIC, FILE, DATA, FILE_OR_DATA, HINT = (
    ShardingPolicy.OFF, ShardingPolicy.DYNAMIC, ShardingPolicy.FILE, ShardingPolicy.DATA,
    ShardingPolicy.FILE_OR_DATA, ShardingPolicy.HINT)
# Elements a replica may have made and not yet handed out (the executor also caps their bytes):
# enough for several full fetches of tiny elements, so a fetch is not limited to a few of them.
CREDITS_PER_REPLICA = 1024


@dataclass
class BufferedElement:
    payload: Any  # encoded bytes, or a LocalElement (an object: worker/local.py)
    split: tuple[int, int] | None
    offset: int
    replica: int


@dataclass
class ReplicaPlan:
    rewrites: list[tuple[str, int, int]]
    use_splits: bool


def plan_replicas(task: common_pb2.TaskDef, dataset: common_pb2.DatasetDef,
                  num_executors: int) -> tuple[list[ReplicaPlan], bool]:
    """How many copies of the pipeline run for `task`, each rewritten how.

    Returns (plans, local_splits): with local_splits the worker itself hands out the splits
    of the whole dataset to its replicas (OFF), otherwise replicas that use splits ask the
    dispatcher (DYNAMIC). Replicas run in parallel on different cores; only transformations
    that do not depend on an element's position in the stream allow that (see DatasetDef).
    """
    policy = task.sharding_policy
    if policy == FILE_OR_DATA:
        policy = FILE if dataset.file_based else DATA
    if policy == DYNAMIC:
        return [ReplicaPlan([], True) for _ in range(num_executors)], False
    if policy == OFF:
        if dataset.splittable and not dataset.order_sensitive and num_executors > 1:
            return [ReplicaPlan([], True) for _ in range(num_executors)], True
        return [ReplicaPlan([], False)], False
    n, i = task.num_workers, task.worker_index
    if policy == FILE:
        files_here = len(range(i, dataset.num_files, n))
        if dataset.order_sensitive:
            return [ReplicaPlan([("files", n, i)], False)], False
        count = max(1, min(num_executors, files_here))
        return [ReplicaPlan([("files", n, i), ("files", count, j)], False)
                for j in range(count)], False
    if policy == DATA:
        return [ReplicaPlan([("data", n, i)], False)], False
    if policy == HINT:
        return [ReplicaPlan([("hints", n, i)], False)], False
    raise ValueError(f"unknown sharding policy {policy}")


@dataclass
class Task:
    definition: common_pb2.TaskDef
    replicas: list[int] = field(default_factory=list)  # executor slot of each replica
    buffer: deque[BufferedElement] = field(default_factory=deque)
    ended_replicas: set[int] = field(default_factory=set)
    error: tuple[str, str, str] | None = None
    local_cursor: LocalSplitCursor | None = None
    split_feed: SplitFeed | None = None  # DYNAMIC: the dispatcher's splits, asked ahead
    started: bool = False
    # The datasets its replicas were started from: its own and those it depends on.
    datasets: list[str] = field(default_factory=list)
    completed: bool = False  # end_of_sequence handed to a client
    last_fetch: float = 0.0  # time.monotonic() of the last fetch (a drain waits for readers)
    runner: RoundRobinRunner | CachingRunner | None = None  # see _runner
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def task_id(self) -> int:
        return self.definition.task_id

    def exhausted(self) -> bool:
        return self.started and len(self.ended_replicas) == len(self.replicas) and not self.buffer


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
        split_prefetch: int = 16,  # WorkerConfig.split_prefetch
    ) -> None:
        self._get_dataset = get_dataset
        self._forget_dataset = forget_dataset
        self._get_split = get_split
        self._report_completed = report_completed
        self._lock = threading.Lock()
        self._tasks: dict[int, Task] = {}
        self._finished: set[int] = set()
        self._executors = ExecutorPool(num_executors, self)
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
            self._executors.send(slot, ("stop", (task.task_id, index)))

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

    def _ensure_started(self, task: Task) -> None:
        with task.cond:
            if task.started:
                return
            definition = task.definition
            dataset = self._get_dataset(definition.dataset_id)
            dependencies = self._dependencies(definition.dataset_id)
            task.datasets = [*dependencies, definition.dataset_id]
            plans, local_splits = plan_replicas(definition, dataset, self._executors.size)
            if local_splits:
                task.local_cursor = LocalSplitCursor(dataset.num_splits)
            elif any(plan.use_splits for plan in plans):
                task.split_feed = SplitFeed(
                    functools.partial(self._get_split, definition), self._split_pool,
                    self._split_prefetch)
            compression = "AUTO" if definition.compression else None
            task.replicas = [index % self._executors.size for index in range(len(plans))]
            task.started = True
            for index, plan in enumerate(plans):
                ok = self._executors.start_replica(
                    task.replicas[index], (task.task_id, index), definition.dataset_id,
                    lambda: dataset.pipeline, plan.rewrites, compression, plan.use_splits,
                    CREDITS_PER_REPLICA,
                    [(d, functools.partial(self._pipeline_bytes, d)) for d in dependencies])
                if not ok:
                    task.error = ("RuntimeError", "executor process unavailable", "")

    def _pipeline_bytes(self, dataset_id: str) -> bytes:
        return self._get_dataset(dataset_id).pipeline

    # ------------------------------------------------------------------ fetching
    def fetch(self, request: Any, wait_s: float) -> TakeResult:
        """The elements for one GetElements request, through the task's runner.

        Coordinated reads (num_consumers) and the cross-trainer cache have their own runner
        (worker/runners.py) on top of the first-come-first-served buffer; other tasks read it
        directly.
        """
        max_elements = max(1, request.max_elements or 1)
        max_bytes = request.max_bytes or (64 << 20)
        task = self.get(request.task_id)
        runner = self._runner(task) if task is not None else None
        if isinstance(runner, RoundRobinRunner):
            if not request.HasField("consumer_index") or not request.HasField("round_index"):
                raise ValueError(
                    f"task {request.task_id} serves coordinated reads: a request needs "
                    "consumer_index and round_index")
            return runner.get(request.consumer_index, request.round_index, wait_s)
        if isinstance(runner, CachingRunner):
            return runner.get(request.trainer_id, max_elements, max_bytes, wait_s)
        return self.get_elements(request.task_id, max_elements, max_bytes, wait_s)

    def _runner(self, task: Task) -> RoundRobinRunner | CachingRunner | None:
        definition = task.definition
        if not definition.HasField("num_consumers") and not definition.cross_trainer_cache:
            return None
        with task.cond:
            if task.runner is None:
                def take(max_elements: int, max_bytes: int, wait_s: float) -> TakeResult:
                    return self.get_elements(task.task_id, max_elements, max_bytes, wait_s)

                def take_encoded(max_elements: int, max_bytes: int,
                                 wait_s: float) -> TakeResult:
                    # The cache serves an element to several trainers, which must not share
                    # one object: it keeps payloads, and each reader decodes its own copy.
                    elements, end, error = take(max_elements, max_bytes, wait_s)
                    failed = encode_elements(elements)
                    if failed is not None:
                        self.fail(task.task_id, failed)
                        return elements, False, failed
                    return elements, end, error

                if definition.HasField("num_consumers"):
                    task.runner = RoundRobinRunner(definition.num_consumers, take)
                else:
                    task.runner = CachingRunner(self.cross_trainer_cache_bytes, take_encoded)
            return task.runner

    def get_elements(self, task_id: int, max_elements: int, max_bytes: int,
                     wait_s: float) -> tuple[list[BufferedElement], bool, tuple | None]:
        """Up to `max_elements` (and about `max_bytes`) elements; waits up to `wait_s` for one.

        Returns (elements, end_of_sequence, error). An unknown task that finished here is at
        its end; one never seen is 'not ready yet' (the heartbeat may not have delivered it).
        """
        task = self.get(task_id)
        if task is None:
            with self._lock:
                finished = task_id in self._finished
            if finished:
                return [], True, None
            raise LookupError(task_id)
        self._ensure_started(task)
        task.last_fetch = time.monotonic()
        deadline = task.last_fetch + wait_s
        taken: list[BufferedElement] = []
        with task.cond:
            while not task.buffer and task.error is None and not task.exhausted():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return [], False, None
                task.cond.wait(remaining)
            size = 0
            while task.buffer and len(taken) < max_elements and (not taken or size < max_bytes):
                element = task.buffer.popleft()
                taken.append(element)
                size += payload_nbytes(element.payload)
            error = task.error if not task.buffer else None
            end = task.exhausted() and error is None
            first_completion = end and not task.completed
            if end:
                task.completed = True
        credits: dict[int, int] = {}
        for element in taken:
            credits[element.replica] = credits.get(element.replica, 0) + 1
        for replica, n in credits.items():
            if replica not in task.ended_replicas:
                self._executors.send(task.replicas[replica], ("credit", (task_id, replica), n))
        if first_completion:
            self._report_completed(task_id)
        return taken, end and not taken, error

    # ------------------------------------------------------------------ executor listener
    def _task_for(self, key: ReplicaKey) -> Task | None:
        return self.get(key[0])

    def on_element(self, key: ReplicaKey, split: tuple[int, int] | None, offset: int,
                   payload: Any) -> None:
        task = self._task_for(key)
        if task is None:
            return
        with task.cond:
            task.buffer.append(BufferedElement(payload, split, offset, key[1]))
            task.cond.notify_all()

    def on_end(self, key: ReplicaKey) -> None:
        task = self._task_for(key)
        if task is None:
            return
        with task.cond:
            task.ended_replicas.add(key[1])
            task.cond.notify_all()

    def on_error(self, key: ReplicaKey, remote_type: str, message: str, tb: str) -> None:
        task = self._task_for(key)
        if task is None:
            return
        logger.warning("task %d failed: %s: %s", key[0], remote_type, message)
        with task.cond:
            if task.error is None:
                task.error = (remote_type, message, tb)
            task.ended_replicas.add(key[1])
            task.cond.notify_all()
        self._stop_replicas(task)

    def fail(self, task_id: int, error: tuple[str, str, str]) -> None:
        """The task failed outside its replicas (an element its readers cannot be sent): every
        reader gets `error` once the buffer is drained, and the replicas stop."""
        task = self.get(task_id)
        if task is None:
            return
        logger.warning("task %d failed: %s: %s", task_id, error[0], error[1])
        with task.cond:
            if task.error is None:
                task.error = error
            task.cond.notify_all()
        self._stop_replicas(task)

    def on_get_split(self, key: ReplicaKey, request_id: int, repetition: int,
                     finished: tuple[int, int, int] | None = None) -> None:
        task = self._task_for(key)
        if task is None:
            return
        slot = task.replicas[key[1]]
        if task.local_cursor is not None:
            index = task.local_cursor.next(repetition)
            self._executors.send(slot, ("split", key, request_id, index, 0))
            return
        if task.split_feed is None:
            self.on_error(key, "RuntimeError", "this task takes no splits", "")
            return

        def reply(split: Split | None) -> None:
            if split is None:
                self._executors.send(slot, ("split", key, request_id, None, (), repetition))
            else:
                self._executors.send(slot, ("split", key, request_id, split.index, split.skip,
                                            split.repetition))

        task.split_feed.request(repetition, finished, reply,
                                lambda kind, message: self.on_error(key, kind, message, ""))

    def on_stages(self, slot: int, totals: tuple[float, ...]) -> None:
        self.stages.update(slot, totals)

    def on_executor_lost(self, slot: int) -> None:
        self.stages.lost(slot)
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            for index, replica_slot in enumerate(task.replicas):
                if replica_slot == slot and index not in task.ended_replicas:
                    self.on_error((task.task_id, index), "RuntimeError",
                                  "the executor process running this task died", "")
