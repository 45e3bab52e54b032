"""Tasks on a worker: the shell around each task's state (worker/task_state.py).

A task is started lazily, on the first fetch (a task nobody reads costs nothing and takes no
splits). The shell owns what the pure state must not: the condition each task's events go
through, the executor pool its replicas run in (it is the pool's listener), the threads that
ask the dispatcher for splits, and the waits of fetches, which wait a moment for fuller
replies (worker/flow.py). An event goes to `WorkerTask.handle` under the task's condition;
the instructions it returns are carried out after, outside it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.observability.stages import StageTotals
from torch_dataservice.pipeline.sharding import ShardingPlan, plan_replicas
from torch_dataservice.proto import common_pb2, worker_pb2
from torch_dataservice.wire.inprocess import payload_nbytes
from torch_dataservice.wire.splits import HandedSplit
from torch_dataservice.worker import task_state as ts
from torch_dataservice.worker.cache_index import WorkerCache
from torch_dataservice.worker.executor import Arrived, ExecutorPool
from torch_dataservice.worker.flow import LINGER_ELEMENTS, LINGER_S
from torch_dataservice.worker.local import encode_elements
from torch_dataservice.worker.messages import (
    CacheCounts,
    CacheUsed,
    FinishedSplit,
    ReplicaKey,
    SplitRequest,
    TaskError,
)
from torch_dataservice.worker.runners import Taken, TaskRunner, limits, make_runner
from torch_dataservice.worker.task_state import BufferedElement, WorkerTask

logger = logging.getLogger(__name__)

# Elements a replica may have made and not yet handed out (the executor also caps their bytes):
# enough for several full fetches of tiny elements, so a fetch is not limited to a few of them.
CREDITS_PER_REPLICA = 1024


class Dispatcher(Protocol):
    """What tasks need of the dispatcher (worker/dispatcher_client.py)."""

    def dataset(self, dataset_id: str) -> common_pb2.DatasetDef: ...

    def pipeline(self, dataset_id: str) -> bytes: ...

    def forget_dataset(self, dataset_id: str) -> None: ...

    def get_split(self, task: common_pb2.TaskDef, *, repetition: int, replica: int,
                  request_id: int, finished: list[FinishedSplit],
                  max_splits: int = 1) -> list[HandedSplit]: ...

    def report_completed(self, task_id: int) -> None: ...

    # What the dispatcher's last GetSplit reply asked the split stocks to cover (0: their
    # own rule): a big fleet's workers ask for more splits at a time.
    split_cover_s: float

    @property
    def stopping(self) -> bool:
        """The worker is stopping: requests cut short by it are no failure of a task."""


@dataclass
class TaskShell:
    """A task's state with what the shell keeps beside it."""

    state: WorkerTask
    cond: threading.Condition = field(default_factory=threading.Condition)
    runner: TaskRunner | None = None  # see _runner
    datasets: list[str] = field(default_factory=list)  # its own and those it depends on
    last_fetch: float = 0.0  # time.monotonic() of the last fetch (a drain waits for readers)
    # (elements, bytes) each waiting fetch wants buffered, whichever comes first
    wants: list[tuple[int, int]] = field(default_factory=list)

    def wait_for_elements(self, want: int, max_bytes: int, wait_s: float) -> bool:
        """Under cond: wait up to `wait_s` for an element (or the end, or an error), then, if
        elements come steadily, up to LINGER_S more for a fuller reply: `want` elements or
        `max_bytes` of them, whichever comes first (a buffer holding a reply's bytes already
        has nothing to wait for: batches of big elements were each delayed a whole LINGER_S
        waiting for `want` of them). False: nothing came in time."""
        state = self.state
        self.last_fetch = time.monotonic()
        deadline = self.last_fetch + wait_s
        while not state.buffer and state.error is None and not state.exhausted():
            if not self._wait((1, 0), deadline - time.monotonic()):
                return False
        if not self._holds(want, max_bytes) and state.running() and state.arrivals.steady():
            deadline = min(deadline, time.monotonic() + LINGER_S)
            while not self._holds(want, max_bytes) and state.running():
                if not self._wait((want, max_bytes), deadline - time.monotonic()):
                    break
        return True

    def _holds(self, want: int, max_bytes: int) -> bool:
        """Under cond: the buffer holds `want` elements, or at least `max_bytes` in fewer
        (a fetch's `want` is at most LINGER_ELEMENTS: the sum is over a few elements)."""
        buffer = self.state.buffer
        if len(buffer) >= want:
            return True
        return bool(buffer) and sum(payload_nbytes(e.payload) for e in buffer) >= max_bytes

    def _wait(self, want: tuple[int, int], timeout_s: float) -> bool:
        """Under cond: wait until the buffer holds `want` (elements, bytes), something ends,
        or `timeout_s` passed. False: no time was left."""
        if timeout_s <= 0:
            return False
        self.wants.append(want)
        try:
            self.cond.wait(timeout_s)
        finally:
            self.wants.remove(want)
        return True

    def wake(self, instructions: list[ts.Instruction]) -> None:
        """Under cond: wake the fetches the Wake instructions among `instructions` are for."""
        for wake in instructions:
            if type(wake) is ts.Wake and (wake.everyone or any(
                    wake.buffered >= count or self._holds(count, size)
                    for count, size in self.wants)):
                self.cond.notify_all()
                return


class TaskManager:
    """All tasks of this worker; implements the executor pool's listener."""

    def __init__(self, dispatcher: Dispatcher, num_executors: int, *,
                 split_prefetch: int = 64, executor_torch_threads: int | None = 1,
                 cross_trainer_cache_bytes: int = 1 << 30) -> None:
        self._dispatcher = dispatcher
        self._lock = threading.Lock()
        self._tasks: dict[int, TaskShell] = {}
        self._finished: set[int] = set()
        # cache(): its store, figures and which splits it holds (worker/cache_index.py).
        self.cache = WorkerCache()
        self._executors = ExecutorPool(num_executors, self, executor_torch_threads,
                                       cache_dir=self.cache.directory)
        self._split_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="get-split")
        self._split_prefetch = split_prefetch  # WorkerConfig.split_prefetch
        self._accepting = True  # False while the worker drains: no new task
        self._cache_bytes = cross_trainer_cache_bytes  # WorkerConfig's
        self.stages = StageTotals()  # the executors' stage times (observability/stages.py)

    def start(self) -> None:
        self._executors.start()

    def close(self) -> None:
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            self._carry_out(task, task.state.stops())
        self._executors.close()
        self._split_pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()

    # ------------------------------------------------------------------ task set
    def task_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._tasks)

    def add(self, definition: common_pb2.TaskDef) -> None:
        """Idempotent: a task id already known is ignored (so is any while draining)."""
        with self._lock:
            if (self._accepting and definition.task_id not in self._tasks
                    and definition.task_id not in self._finished):
                self._tasks[definition.task_id] = TaskShell(WorkerTask(definition,
                                                                       time.monotonic))

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
        return [t.state.task_id for t in tasks if t.state.started and not t.state.completed
                and t.state.error is None and now - t.last_fetch < idle_s]

    def delete(self, task_id: int) -> None:
        with self._lock:
            task = self._tasks.pop(task_id, None)
            self._finished.discard(task_id)
        if task is not None:
            self._event(task, ts.Deleted())
            self._release_unused(task.datasets or [task.state.definition.dataset_id])

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
                needed.update(task.datasets or [task.state.definition.dataset_id])
        for dataset_id in candidates:
            if dataset_id not in needed:
                self._executors.release_dataset(dataset_id)
                self._dispatcher.forget_dataset(dataset_id)

    def get(self, task_id: int) -> TaskShell | None:
        with self._lock:
            return self._tasks.get(task_id)

    @property
    def num_executors(self) -> int:
        return self._executors.size

    def buffered_elements(self) -> int:
        """Elements made and not yet handed out, over every task (metrics, status)."""
        with self._lock:
            return sum(len(task.state.buffer) for task in self._tasks.values())

    def on_stages(self, slot: int, totals: tuple[float, ...]) -> None:
        self.stages.update(slot, totals)

    def on_cache(self, report: CacheCounts | CacheUsed) -> None:
        self.cache.on_report(report)

    def _ensure_started(self, task: TaskShell) -> None:
        with task.cond:
            if task.state.started:
                return
            definition = task.state.definition
            dataset = self._dispatcher.dataset(definition.dataset_id)
            dependencies = _dependencies(self._dispatcher, definition.dataset_id)
            task.datasets = [*dependencies, definition.dataset_id]
            plan = plan_replicas(definition, dataset, self._executors.size)
            slots = tuple(index % self._executors.size for index in range(len(plan.replicas)))
            task.state.handle(_started(slots, plan, dataset, split_prefetch=self._split_prefetch))
            compression = "AUTO" if definition.compression else None
            failed: list[ts.Instruction] = []
            for index, replica in enumerate(plan.replicas):
                if not self._executors.start_replica(
                        slots[index], (definition.task_id, index), definition.dataset_id,
                        pipeline=self._dispatcher.pipeline, plan=replica,
                        compression=compression, credits=CREDITS_PER_REPLICA,
                        dependencies=dependencies):
                    failed += task.state.handle(ts.ReplicaFailed(index, TaskError(
                        "RuntimeError", "executor process unavailable", "")))
        self._carry_out(task, failed)

    # ------------------------------------------------------------------ events, instructions
    def _event(self, task: TaskShell, event: ts.Event) -> None:
        """`event` to the task's state, waking the fetches it asks to; its other
        instructions carried out (outside the task's condition)."""
        with task.cond:
            instructions = task.state.handle(event)
            task.wake(instructions)
        self._carry_out(task, instructions)

    def _fetched(self, task: TaskShell, fetch: ts.FetchSplits) -> None:
        fetched = _get_splits(self._dispatcher, task.state.definition, fetch)
        if fetched is not None:
            self._event(task, fetched)

    def _carry_out(self, task: TaskShell, instructions: list[ts.Instruction]) -> None:
        for instruction in instructions:
            match instruction:
                case ts.ToExecutor(slot, message):
                    self._executors.send(slot, message)
                case ts.FetchSplits():
                    try:
                        self._split_pool.submit(self._fetched, task, instruction)
                    except RuntimeError:  # the pool is shut down: the worker is stopping
                        pass
                case ts.ReportCompleted(task_id):
                    self._dispatcher.report_completed(task_id)

    # ------------------------------------------------------------------ fetching
    def fetch(self, request: worker_pb2.GetElementsRequest, wait_s: float) -> Taken:
        """The elements for one GetElements request, through the task's runner."""
        task = self.get(request.task_id)
        if task is None:  # finished here, or not known yet (get_elements tells which)
            return self.get_elements(request.task_id, *limits(request), wait_s=wait_s)
        return self._runner(task).get(request, wait_s)

    def dropped_at_end(self, task_id: int) -> int:
        """Elements of the task its runner dropped at the end (coordinated reads)."""
        task = self.get(task_id)
        return task.runner.dropped_at_end if task is not None and task.runner else 0

    def _runner(self, task: TaskShell) -> TaskRunner:
        with task.cond:
            if task.runner is None:
                task_id = task.state.task_id
                task.runner = make_runner(
                    task.state.definition, functools.partial(self.get_elements, task_id),
                    functools.partial(self._take_encoded, task_id),
                    cache_bytes=self._cache_bytes)
            return task.runner

    def _take_encoded(self, task_id: int, max_elements: int, max_bytes: int, *,
                      wait_s: float) -> Taken:
        """get_elements with payloads encoded: the cache serves an element to several
        trainers, which must not share one object, so each reader decodes its own copy."""
        elements, end, error = self.get_elements(task_id, max_elements, max_bytes,
                                                 wait_s=wait_s)
        failed = encode_elements(elements)
        if failed is not None:
            self.fail(task_id, failed)
            return Taken(elements, False, failed)
        return Taken(elements, end, error)

    def get_elements(self, task_id: int, max_elements: int, max_bytes: int, *,
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
            if not task.wait_for_elements(min(max_elements, LINGER_ELEMENTS), max_bytes,
                                          wait_s):
                return Taken([], False, None)
            instructions = task.state.handle(ts.ElementsTaken(max_elements, max_bytes))
        self._carry_out(task, instructions)
        handed = instructions[0]
        assert type(handed) is ts.Handed
        return Taken(handed.elements, handed.end_of_sequence, handed.error)

    # ------------------------------------------------------------------ executor listener
    def on_elements(self, items: Iterable[Arrived]) -> None:
        """Buffer elements from an executor: one lock and one wake-up per run of one replica's
        elements (a message carries several), not per element."""
        for task_id, elements in _runs(items):
            self._on(task_id, ts.ElementsArrived(elements))

    def _on(self, task_id: int, event: ts.Event) -> None:
        task = self.get(task_id)
        if task is not None:
            self._event(task, event)

    def on_blocked(self, key: ReplicaKey) -> None:
        """A replica waits for credits: it gets those it is owed now, or its next one."""
        self._on(key[0], ts.ReplicaBlocked(key[1]))

    def on_end(self, key: ReplicaKey) -> None:
        self._on(key[0], ts.ReplicaEnded(key[1]))

    def on_error(self, key: ReplicaKey, error: TaskError) -> None:
        logger.warning("task %d failed: %s: %s", key[0], error.type, error.message)
        self._on(key[0], ts.ReplicaFailed(key[1], error))

    def fail(self, task_id: int, error: TaskError) -> None:
        """The task failed outside its replicas (an element its readers cannot be sent): every
        reader gets `error` once the buffer is drained, and the replicas stop."""
        logger.warning("task %d failed: %s: %s", task_id, error.type, error.message)
        self._on(task_id, ts.ReplicaFailed(None, error))

    def on_get_split(self, request: SplitRequest) -> None:
        self._on(request.key[0], ts.SplitsAsked(request.key[1], request.request_id,
                                                 request.repetition, request.finished,
                                                 request.want))

    def on_split_done(self, key: ReplicaKey, finished: FinishedSplit) -> None:
        """A replica finished a split and reads the next one it holds."""
        self._on(key[0], ts.SplitDone(key[1], finished))

    def on_executor_lost(self, slot: int) -> None:
        logger.warning("executor %d died: its replicas' tasks fail", slot)
        self.stages.lost(slot)
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            self._event(task, ts.ExecutorLost(slot))


def _started(slots: tuple[int, ...], plan: ShardingPlan, dataset: common_pb2.DatasetDef, *,
             split_prefetch: int) -> ts.Started:
    """Where the task's replicas run and where their splits come from."""
    if plan.local_splits:
        return ts.Started(slots, local_splits=dataset.num_splits)
    depth = ts.stock_depth(split_prefetch, dataset.num_splits) if plan.use_splits else None
    return ts.Started(slots, stock_depth=depth)


def _dependencies(dispatcher: Dispatcher, dataset_id: str) -> list[str]:
    """The datasets `dataset_id` refers to, recursively, each before what needs it."""
    order: list[str] = []

    def visit(needed: str, path: tuple[str, ...]) -> None:
        if needed in path:
            raise ValueError(f"datasets refer to each other in a cycle: {path + (needed,)}")
        for dependency in dispatcher.dataset(needed).depends_on:
            visit(dependency, path + (needed,))
        if needed not in order:
            order.append(needed)

    visit(dataset_id, ())
    return order[:-1]


def _get_splits(dispatcher: Dispatcher, definition: common_pb2.TaskDef,
                fetch: ts.FetchSplits) -> ts.SplitsFetched | None:
    """Carry out `fetch` (on a thread of the split pool): its answer, or the error to fail
    the replicas that wait with; None if the worker's own stop cut it short: its readers see
    the worker go, as they see any worker leave (the dispatcher hands its splits again), not
    an error of the task."""
    try:
        splits = dispatcher.get_split(
            definition, repetition=fetch.repetition, replica=ts.FEED_REPLICA,
            request_id=fetch.request_id, finished=fetch.finished, max_splits=fetch.max_splits)
        return ts.SplitsFetched(fetch.repetition, splits, cover_s=dispatcher.split_cover_s)
    except ServiceUnavailableError as exc:
        if dispatcher.stopping:
            return None
        return ts.SplitsFetched(fetch.repetition, [], ("ServiceUnavailableError", str(exc)))
    except Exception as exc:  # noqa: BLE001 - reported to the replicas that wait
        logger.warning("GetSplit failed: %s: %s", type(exc).__name__, exc)
        return ts.SplitsFetched(fetch.repetition, [],
                                (type(exc).__name__, f"GetSplit failed: {exc}"))


def _runs(items: Iterable[Arrived]) -> Iterator[tuple[int, list[BufferedElement]]]:
    """`items` as runs of one replica's elements: (task id, its elements)."""
    key: ReplicaKey | None = None
    run: list[BufferedElement] = []
    for item_key, split, offset, payload in items:
        if item_key != key:
            if key is not None and run:
                yield key[0], run
            key, run = item_key, []
        run.append(BufferedElement(payload, split, offset, item_key[1]))
    if run and key is not None:
        yield key[0], run
