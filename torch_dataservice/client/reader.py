"""The reader: one iteration of a job, pulled from its workers.

It composes one job each: its membership in the iteration (client/membership.py: joining,
heartbeats, the task table), how each task's worker is reached (client/transports.py),
exactly-once bookkeeping under DYNAMIC (client/delivery.py) and, for coordinated reads, the
rounds protocol (client/rounds.py). Here: fetch threads, at most `max_outstanding_requests`,
each take a task round-robin (local tasks first under target_workers "AUTO"), ask its worker
for a batch of elements (what the consumer takes in about half a second: client/pace.py) and
queue it; a slot is only freed when the consumer has taken the whole batch, so memory stays
bounded by `max_outstanding_requests` fetches. A task has one fetch in flight, or two once
the reply's header announces big payloads (PIPELINE_BYTES): the next request then travels
while the payloads stream in, and batches are handed on in the order their fetches started,
so a task's elements keep the worker's order. Elements are decoded in the consumer's thread.
Coordinated reads use the one rounds thread instead.

target_workers: "LOCAL" reads only workers on this host; "AUTO" means LOCAL under static
sharding (FILE, DATA, FILE_OR_DATA, HINT) and every worker otherwise; "ANY" reads every worker.
A worker in this process that runs its pipelines on threads (`num_processes=0`) hands its
elements over as the objects its pipeline produced, not encoded (wire/inprocess.py): the
consumer shares them with the pipeline, as with torch's DataLoader and `num_workers=0`.

Exactly-once DYNAMIC: an element is acknowledged when `__next__` returns it, and the
acknowledgements ride on the next heartbeat. After a pause (no heartbeat answered for PAUSE_S,
or two heartbeat intervals when the dispatcher stretched them: dispatcher/cadence.py)
`__next__` asks the dispatcher before it returns more; declared silent meanwhile, the reader
drops what it holds unacknowledged of the splits handed again to the job's other readers. So
the one at-least-once window is what it returned in its last heartbeat interval before the
pause, not yet reported.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from typing import Any

import grpc

from torch_dataservice.client import transports
from torch_dataservice.client.consumed import ConsumedSplits
from torch_dataservice.client.data_port import DataPortError, DataPortPool
from torch_dataservice.client.delivery import Batch, Delivery, split_tags
from torch_dataservice.client.figures import ReaderFigures
from torch_dataservice.client.membership import HEARTBEAT_INTERVAL_S, Membership, TaskState
from torch_dataservice.client.pace import FetchPace
from torch_dataservice.client.rounds import CoordinatedRounds
from torch_dataservice.client.transports import Transport
from torch_dataservice.errors import RemoteError, ServiceUnavailableError, is_retryable
from torch_dataservice.observability.client import ClientStats
from torch_dataservice.policies import STATIC_POLICIES, ShardingPolicy, TargetWorkers
from torch_dataservice.proto import common_pb2, worker_pb2
from torch_dataservice.rpc import rpc_error_to_exception
from torch_dataservice.serving import close_and_join
from torch_dataservice.wire import codec, inprocess
from torch_dataservice.wire.inprocess import LocalElement

logger = logging.getLogger(__name__)

FETCH_MAX_BYTES = 8 << 20
UNREACHABLE_BACKOFF_S = 0.2
# An in-process worker that does not know a task yet gets it from the dispatcher's push within
# milliseconds: retry soon, or every epoch's first batch waits a whole backoff.
UNKNOWN_TASK_BACKOFF_S = 0.02
# A fetch thread with no task free to read sleeps until a fetch ends or the task table changes
# (both notify), or a task's backoff is over: this is only a safety net.
IDLE_WAIT_S = 0.5
DEFAULT_MAX_OUTSTANDING = 4
PAUSE_S = 5 * HEARTBEAT_INTERVAL_S  # no heartbeat answered for this long: a pause
# A reply bringing this many payload bytes lets its task's next fetch start as soon as its
# header is in: a second request's round trip and the worker's take overlap the payloads'
# transfer (one fetch per task at a time left a 9.6 MB batch's link idle between replies).
PIPELINE_BYTES = 1 << 20


class IterationReader:
    """Iterator over one iteration of a job. Close it (or exhaust it) to release the worker."""

    def __init__(
        self,
        dispatcher_address: str,
        job_config: common_pb2.JobConfig,
        repetition: int,
        max_outstanding_requests: int | None,
        connect_timeout_s: float,
        trainer_id: str = "",
        consumer_index: int | None = None,
        at_least_latest: bool = False,
        stats: ClientStats | None = None,
        track_yielded: bool = False,
    ) -> None:
        target_workers = TargetWorkers(job_config.target_workers or TargetWorkers.AUTO)
        if target_workers == TargetWorkers.AUTO and job_config.sharding_policy in STATIC_POLICIES:
            target_workers = TargetWorkers.LOCAL  # static shards are read where they are made
        self._target_workers = target_workers
        num_consumers = (job_config.num_consumers
                         if job_config.HasField("num_consumers") else None)
        if (consumer_index is None) != (num_consumers is None):
            raise ValueError("coordinated reads need both consumer_index and num_consumers, got "
                             f"consumer_index={consumer_index!r}, "
                             f"num_consumers={num_consumers!r}")
        self._consumer_index = consumer_index
        self._trainer_id = trainer_id
        self._figures = ReaderFigures(dispatcher_address, stats)
        # Exactly-once DYNAMIC (dispatcher/splits.py, client/delivery.py).
        exactly_once = (job_config.sharding_policy == ShardingPolicy.DYNAMIC
                        and consumer_index is None)
        self._delivery = Delivery() if exactly_once else None
        self._membership = Membership(dispatcher_address, job_config, repetition,
                                      connect_timeout_s, target_workers, self._delivery,
                                      at_least_latest)
        self.repetition = self._membership.repetition
        self.created_iteration = self._membership.created_iteration
        self._membership.load = self._figures.load
        self._max_outstanding = max_outstanding_requests or DEFAULT_MAX_OUTSTANDING
        self._next_task = itertools.count()
        self._in_flight = 0
        self._results: queue.Queue[Batch] = queue.Queue()
        self._pace = FetchPace()  # how many elements a fetch asks for (client/pace.py)
        self._slots = threading.BoundedSemaphore(self._max_outstanding)
        self._current: Batch | None = None
        self._pause_checked = 0.0  # the answered_at a pause was checked at (_after_pause)
        self._data_ports = DataPortPool()
        self._transports: dict[int, Transport] = {}  # chosen once per task
        self._fallback = transports.FALLBACK  # shared: later readers skip a blocked port
        self._rounds: CoordinatedRounds | None = None
        # DYNAMIC: the split tag of the element `__next__` returned last, and, with
        # `track_yielded`, every element yielded so far (client/consumed.py; one small entry
        # per split, so not kept by default for long jobs): what a resume must not read again.
        self.last_tag: tuple[int, int, int] | None = None
        self.yielded = ConsumedSplits() if track_yielded else None
        self._threads = self._make_threads(consumer_index, connect_timeout_s)
        self._membership.heartbeat()
        _readers.add(self)
        for thread in self._threads:
            thread.start()

    def _make_threads(self, consumer_index: int | None,
                      connect_timeout_s: float) -> list[threading.Thread]:
        """The heartbeat thread, and the rounds thread (coordinated reads) or the fetch
        threads."""
        threads = [threading.Thread(target=self._heartbeat_loop, daemon=True,
                                    name=f"reader-heartbeat-{self.client_id}")]
        if consumer_index is not None:
            self._rounds = self._membership.rounds = CoordinatedRounds(
                consumer_index, self._membership, self._fetch, self._slots, self._begin_fetch,
                self._end_fetch, connect_timeout_s)
            threads.append(threading.Thread(
                target=self._rounds.run, daemon=True, name=f"reader-rounds-{self.client_id}"))
            return threads
        return threads + [threading.Thread(target=self._fetch_loop, daemon=True,
                                           name=f"reader-fetch-{self.client_id}-{i}")
                          for i in range(self._max_outstanding)]

    @property
    def iteration_id(self) -> int:
        return self._membership.iteration_id

    @property
    def client_id(self) -> int:  # changes if the reader joins its iteration again
        return self._membership.client_id

    # ------------------------------------------------------------------ observability
    def _heartbeat_loop(self) -> None:
        while not self._membership.closed.wait(self._membership.interval_s):
            self._membership.heartbeat()
            self._figures.report_wait(self._membership, self._target_workers)

    def stats(self) -> dict[str, Any]:
        """Batches, elements, bytes, seconds waiting, per worker (observability/client.py)."""
        return self._figures.stats.as_dict()

    # ------------------------------------------------------------------ fetching
    def _pick_task(self) -> TaskState | None:
        """A task to fetch from: round robin within the best group that has one free, else
        one whose fetch in flight brings big payloads (a second fetch, `_may_follow`)."""
        now = time.monotonic()
        start = next(self._next_task)
        for free in (True, False):
            for group in self._membership.task_order:
                for i in range(len(group)):
                    state = self._membership.tasks[group[(start + i) % len(group)]]
                    if (not state.ended and state.retry_at <= now
                            and (not state.in_use if free else _may_follow(state))):
                        return state
        return None

    def _fetch_loop(self) -> None:
        while not self._membership.closed.is_set():
            if not self._slots.acquire(timeout=0.2):
                continue
            with self._membership.lock:
                state = self._pick_task()
                if state is None:
                    self._membership.lock.wait(self._idle_wait_s())
                    self._slots.release()
                    continue
                state.in_use += 1
                ticket = state.started
                state.started += 1
                self._in_flight += 1
            batch: Batch | None = None
            try:
                batch = self._fetch(state, ticket=ticket)
            except Exception as error:  # raised by an in-process worker: the consumer's now
                self._membership.fail(error)
            finally:
                self._end_task_fetch(state, ticket, batch)

    def _end_task_fetch(self, state: TaskState, ticket: int, batch: Batch | None) -> None:
        """Hand fetch `ticket`'s batch on in the order the task's fetches started: one that
        ended before the fetch started ahead of it waits for that one."""
        with self._membership.lock:
            due = state.fetch_ended(ticket, batch)
        for each in due:
            self._end_fetch(each)

    def _header_came(self, state: TaskState, ticket: int,
                     header: worker_pb2.ElementBatchHeader) -> None:
        """Fetch `ticket`'s reply header is in: if it brings big payloads, the task's next
        fetch may start while they stream (the worker took its elements already, so order
        holds); one waiting fetch thread is woken for it."""
        if (header.end_of_sequence or header.has_error
                or sum(info.size for info in header.elements) < PIPELINE_BYTES):
            return
        with self._membership.lock:
            state.header_came = ticket
            self._membership.lock.notify()

    def _idle_wait_s(self) -> float:
        """How long a fetch thread that found no task waits (under the lock): until the first
        backoff ends, at most IDLE_WAIT_S. Polling instead woke every idle thread 20 times a
        second, and a fetch's end woke all of them (one task: three wake-ups per reply)."""
        now = time.monotonic()
        retry = min((state.retry_at for state in self._membership.tasks.values()
                     if not state.ended and state.retry_at > now), default=now + IDLE_WAIT_S)
        return min(IDLE_WAIT_S, max(retry - now, 0.001))

    def _begin_fetch(self) -> None:
        with self._membership.lock:
            self._in_flight += 1

    def _end_fetch(self, batch: Batch | None) -> None:
        """A fetch ended: queue what it brought, or give its slot back if it brought nothing."""
        with self._membership.lock:
            self._in_flight -= 1
            if batch is not None and batch.payloads:
                self._figures.received(self._membership.tasks[batch.task_id].info.worker_address,
                                       len(batch.payloads), batch.nbytes)
            if batch is not None and (batch.payloads or batch.error):
                self._results.put(batch)
            else:
                self._slots.release()
            self._membership.lock.notify()  # its task is free again: one waiter may take it

    def _fetch(self, state: TaskState, round_index: int | None = None,
               ticket: int | None = None) -> Batch | None:
        request = worker_pb2.GetElementsRequest(
            task_id=state.info.task_id, client_id=self.client_id,
            max_elements=self._pace.max_elements(), max_bytes=FETCH_MAX_BYTES,
            trainer_id=self._trainer_id)
        if round_index is not None:
            request.consumer_index = self._consumer_index
            request.round_index = round_index
            request.max_elements = 1
        address = state.info.worker_address
        transport = self._transports.get(state.info.task_id)
        if transport is None:
            transport = self._transports[state.info.task_id] = transports.choose(
                state.info, self._target_workers, self._data_ports, bool(self._trainer_id))
        try:
            if ticket is not None and isinstance(transport, transports.DataPortTransport):
                header, payloads = transport.fetch_pipelined(
                    request, functools.partial(self._header_came, state, ticket))
            else:
                header, payloads = transport.fetch(request)
        except grpc.RpcError as error:
            if is_retryable(error) or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                state.failures += 1
                state.retry_at = time.monotonic() + min(
                    UNREACHABLE_BACKOFF_S * state.failures, 2.0)
                return None
            self._membership.fail(rpc_error_to_exception(error, f"reading from worker {address}"))
            return None
        except LookupError:
            state.retry_at = time.monotonic() + UNKNOWN_TASK_BACKOFF_S
            return None
        except transports.WorkerGone:
            del self._transports[state.info.task_id]
            state.retry_at = time.monotonic() + UNREACHABLE_BACKOFF_S
            return None
        except (OSError, EOFError) as error:
            if not transport.network:
                raise  # from an in-process worker: not a connection problem
            refusal = transports.tls_refusal(error)
            if refusal is not None:  # retrying (or gRPC: the same check) cannot mend it
                self._membership.fail(
                    ServiceUnavailableError(f"reading from worker {address}: {refusal}"))
                return None
            # Unreachable, reset, timed out or not ready: like a retryable gRPC error.
            state.failures += 1
            replacement = self._fallback.replacement(transport, state.info, state.failures,
                                                     error)
            if replacement is not None:
                self._transports[state.info.task_id] = replacement
                state.failures = 0
            state.retry_at = time.monotonic() + min(UNREACHABLE_BACKOFF_S * state.failures, 2.0)
            return None
        except DataPortError as error:
            self._membership.fail(RuntimeError(f"reading from worker {address}: {error}"))
            return None
        state.failures = 0
        return self._batch_of(state, transport.borrow, header, payloads)

    def _batch_of(self, state: TaskState, borrow: bool, header: worker_pb2.ElementBatchHeader,
                  payloads: list) -> Batch:
        """A worker's reply as a Batch to queue (under DYNAMIC exactly-once: only the elements
        not received before); an empty reply at the end of the sequence ends its task."""
        if self._delivery is not None and payloads:
            batch = self._delivery.keep_new(state.info.task_id, header, payloads)
            batch.borrow = borrow
        else:
            batch = Batch(deque(payloads), borrow=borrow, task_id=state.info.task_id,
                          split_tags=deque(split_tags(header)))
        batch.nbytes = sum(inprocess.payload_nbytes(p) for p in batch.payloads)
        if header.has_error:
            batch.error = RemoteError(header.error.type, header.error.message,
                                      header.error.traceback)
        if header.end_of_sequence and not payloads:
            if header.dropped_at_end and not state.ended:
                self._figures.stats.dropped_at_end(header.dropped_at_end)
            state.ended = True
        return batch

    # ------------------------------------------------------------------ consuming
    def _done(self) -> bool:
        if self._in_flight or not self._results.empty():
            return False
        if self._rounds is not None:
            return self._rounds.finished
        if self._membership.skipped_tasks:
            # Tasks read elsewhere never finish here: done when every task we read ended.
            tasks = self._membership.tasks
            return bool(tasks) and all(s.ended for s in tasks.values())
        if not self._membership.iteration_finished:
            return False
        return all(state.ended or not state.in_use for state in self._membership.tasks.values())

    def __iter__(self) -> IterationReader:
        return self

    def __next__(self) -> Any:
        if self._delivery is not None:
            self._after_pause()
        blocked = None  # since when this call waits for a batch (stats: seconds waiting)
        try:
            while True:
                if self._membership.handed_again is not None:
                    self._drop_handed_again()
                batch = self._current
                if batch is not None:
                    if batch.payloads:
                        return self._take(batch)
                    self._current = None
                    self._slots.release()
                    if batch.error is not None:
                        self.close()
                        raise batch.error
                    continue  # its elements were dropped (_drop_handed_again)
                if blocked is None:
                    blocked = time.perf_counter()
                    self._figures.blocked_since = time.monotonic()  # a long wait is reported
                try:
                    self._current = self._results.get(timeout=0.05)
                    continue
                except queue.Empty:
                    pass
                with self._membership.lock:
                    if self._membership.fatal is not None:
                        fatal = self._membership.fatal
                        self.close()
                        raise fatal
                    if self._done() and self._results.empty():
                        self.close()
                        raise StopIteration
        finally:
            if blocked is not None:
                self._figures.waited(blocked)

    def _after_pause(self) -> None:
        """Exactly-once DYNAMIC: no heartbeat sent since PAUSE_S (or two intervals) ago was
        answered (this process was paused or starved): ask the dispatcher before yielding
        more, since it may have declared this reader silent and handed what it holds to the
        job's other readers (then `__next__` drops it: _drop_handed_again). Once per such
        gap: a dispatcher that is down does not stall every element; none while the
        dispatcher is known to be down (the gap is its, not a pause)."""
        answered_at = self._membership.answered_at
        # A stretched interval (dispatcher/cadence.py) is no pause: two of them are, still
        # well before the dispatcher takes the reader for silent (4 intervals at least).
        pause_s = max(PAUSE_S, 2 * self._membership.interval_s)
        if (time.monotonic() - answered_at > pause_s and answered_at != self._pause_checked
                and self._membership.down_since is None):
            self._pause_checked = answered_at
            self._membership.heartbeat()

    def _drop_handed_again(self) -> None:
        """This reader was declared silent (paused past worker_timeout_ms) and the dispatcher
        handed splits it holds elements of to the job's other readers: drop those, before
        anything more is yielded (they come again to whoever reads those splits)."""
        with self._membership.lock:
            keys, self._membership.handed_again = self._membership.handed_again, None
        dropped = self._delivery.drop_unacknowledged(keys or set())  # type: ignore[union-attr]
        logger.warning(
            "this reader (client %d of iteration %d) was silent for longer than the "
            "dispatcher's worker_timeout_ms (its process paused or starved?) and was taken "
            "for dead: it dropped %d element(s) it held of the %d split(s) handed meanwhile to "
            "the job's other readers; what it yielded in its last heartbeat interval before "
            "the silence may also be delivered twice", self.client_id, self.iteration_id,
            dropped, len(keys or ()))

    def _take(self, batch: Batch) -> Any:
        """The batch's next element, decoded (acknowledged under exactly-once)."""
        payload = batch.payloads.popleft()
        if batch.tags:
            self._delivery.acknowledge(batch)  # type: ignore[union-attr]
        tag = self.last_tag = batch.split_tags.popleft() if batch.split_tags else None
        if tag is not None and self.yielded is not None:
            self.yielded.add(*tag)
        if not batch.payloads and batch.error is None:
            self._current = None
            self._slots.release()
        self._figures.took()
        self._pace.took()
        if type(payload) is LocalElement:
            return payload.take()  # the object itself: no decode, no copy
        return codec.decode(payload, borrow=batch.borrow)

    def close(self) -> None:
        """Release the iteration; this reader's threads end on their own within about a second
        (fetches are long polls), and at interpreter exit `_close_readers` waits for them."""
        if self._membership.closed.is_set():
            return
        self._membership.closed.set()
        with self._membership.lock:
            self._membership.lock.notify_all()  # idle fetch threads see the close at once
        self._data_ports.close()
        self._membership.release()

    def join(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic) for this reader's threads to end."""
        for thread in self._threads:
            if thread is not threading.current_thread() and thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


EXIT_JOIN_S = 5.0
# Every reader whose threads may still run. At exit they are closed and their threads joined
# before the interpreter finalizes: a thread still inside a gRPC or socket call then can abort
# the process ("terminate called without an active exception"), e.g. after a training loop
# broke out of an epoch.
_readers: weakref.WeakSet[IterationReader] = weakref.WeakSet()


@atexit.register
def _close_readers() -> None:
    close_and_join(list(_readers), EXIT_JOIN_S)


def _may_follow(state: TaskState) -> bool:
    """A second fetch of `state`'s task may start: its one fetch in flight is the last one
    started, and its header said it brings big payloads (`IterationReader._header_came`)."""
    return state.in_use == 1 and state.header_came == state.started - 1
