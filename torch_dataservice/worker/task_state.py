"""A task on a worker, as state: changed only by `WorkerTask.handle(event)`, which returns the
instructions the shell (worker/tasks.py) carries out. No thread, no socket, and the time from
an injected clock: every interleaving the multi-process tests found replays here, event by
event (tests/worker/test_task_state.py).

Elements. The task's replicas (one per executor process, as its sharding plan says) send
their encoded elements to one bounded buffer, in split order (worker/reorder.py), which the
task's runner (worker/runners.py) hands out. Every element handed out returns a credit to the
replica that made it, which is the back-pressure; credits travel in batches (worker/flow.py).

Splits (DYNAMIC). The task keeps a stock of the dispatcher's splits, asked for ahead of need
and several at a time (`SplitStock`): without it a replica waits a whole GetSplit round trip
(and, fault-tolerant, the dispatcher's fsync) between two splits; with it a round trip and an
fsync are paid per batch of splits. The stock is sized by worker/split_budget.py. A replica
asks for up to `want` splits at once and gets up to that many, at least one; it reports each
split it finished (with its next ask, or on its own) before it asks again.

One request is in flight per task at a time, under the stock's own replica id
(FEED_REPLICA) with increasing request numbers, so a request retried after a lost reply gets
the same splits back (the dispatcher remembers its last answer per replica id). Reports ride
on the next request; a replica is told "no more splits" only by the rule of
split_budget.end_believed, so the end of a repetition is known to the dispatcher after every
report (dispatcher/splits.py, exactly-once). Splits are numbered in the order they are handed
to replicas and recorded in the split order at once.

Splits in stock are held by the task on the dispatcher like any other: if the worker dies
they are requeued, and a garbage-collected iteration hands them on. A task whose replicas stop
before the splits run out (a `take` after the source) leaves its stock unproduced, as the
cursor's remaining splits are: such a pipeline reads part of the data by design.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch_dataservice.pipeline.split_cursor import LocalSplitCursor
from torch_dataservice.proto import common_pb2
from torch_dataservice.wire.inprocess import payload_nbytes
from torch_dataservice.wire.splits import HandedSplit, SplitKey
from torch_dataservice.worker import messages
from torch_dataservice.worker.flow import Arrivals, CreditLedger
from torch_dataservice.worker.messages import Credit, FinishedSplit, SplitReply, Stop, TaskError
from torch_dataservice.worker.reorder import SplitOrder
from torch_dataservice.worker.split_budget import STOCK_COVER_S, SplitBudget, end_believed

Clock = Callable[[], float]

# The stock's replica id in GetSplit (executor replicas would use 0, 1, ...).
FEED_REPLICA = 1 << 20
# A task keeps at most this part of a repetition's splits in stock (and hands at most as many
# to a replica at once): a worker that joins mid-epoch, or another at the epoch's end, finds
# splits left however cheap they were so far.
STOCK_EPOCH_PART = 1 / 16


def stock_depth(split_prefetch: int, num_splits: int) -> int:
    """The split stock's depth: WorkerConfig.split_prefetch, at most STOCK_EPOCH_PART of the
    repetition's splits (when known)."""
    if num_splits <= 0:
        return split_prefetch
    return min(split_prefetch, max(1, int(num_splits * STOCK_EPOCH_PART)))


@dataclass
class BufferedElement:
    payload: Any  # encoded bytes, or a LocalElement (an object: wire/inprocess.py)
    split: SplitKey | None
    offset: int
    replica: int


# ------------------------------------------------------------------ events
class Started(NamedTuple):
    """The task's replicas run on these executor slots; it reads `local_splits` splits of its
    own (a LocalSplitCursor), or the dispatcher's through a stock of `stock_depth`, or none."""

    replicas: tuple[int, ...]
    local_splits: int | None = None
    stock_depth: int | None = None


class ElementsArrived(NamedTuple):
    """Elements from an executor (a message carries several)."""

    elements: list[BufferedElement]


class ElementsTaken(NamedTuple):
    """A reader takes up to `max_elements` (and about `max_bytes`) from the buffer."""

    max_elements: int
    max_bytes: int


class ReplicaBlocked(NamedTuple):
    """The replica waits for credits."""

    replica: int


class ReplicaEnded(NamedTuple):
    replica: int


class ReplicaFailed(NamedTuple):
    """A replica failed; `replica` None: the task failed outside its replicas (an element its
    readers cannot be sent)."""

    replica: int | None
    error: TaskError


class ExecutorLost(NamedTuple):
    """The executor process on `slot` died: its replicas of this task fail."""

    slot: int


class SplitsAsked(NamedTuple):
    """A replica wants up to `want` splits of `repetition`, having finished `finished`."""

    replica: int
    request_id: int
    repetition: int
    finished: FinishedSplit | None
    want: int = 1


class SplitDone(NamedTuple):
    """A replica finished a split and reads the next one it holds (no ask)."""

    replica: int
    finished: FinishedSplit


class SplitsFetched(NamedTuple):
    """The answer to FetchSplits: the splits (none: the end of `repetition`), or an error
    (type, message)."""

    repetition: int
    splits: list[HandedSplit]
    error: tuple[str, str] | None = None
    cover_s: float = 0.0  # what the dispatcher asked the stock to cover (0: its own rule)


class Deleted(NamedTuple):
    """The dispatcher deleted the task: its replicas stop, waiting replicas get no answer."""


Event = (Started | ElementsArrived | ElementsTaken | ReplicaBlocked | ReplicaEnded
         | ReplicaFailed | ExecutorLost | SplitsAsked | SplitDone | SplitsFetched | Deleted)


# ------------------------------------------------------------------ instructions
class ToExecutor(NamedTuple):
    slot: int
    message: messages.ToExecutor


class FetchSplits(NamedTuple):
    """Ask the dispatcher for up to `max_splits` splits of `repetition` (GetSplit under
    FEED_REPLICA, `request_id`), reporting `finished`; answer with SplitsFetched."""

    repetition: int
    request_id: int
    finished: list[FinishedSplit]
    max_splits: int


class ReportCompleted(NamedTuple):
    """The task's end went to a reader: tell the dispatcher."""

    task_id: int


class Wake(NamedTuple):
    """Wake the fetches waiting for `buffered` elements or fewer (`everyone`: all of them,
    something ended)."""

    buffered: int
    everyone: bool = False


class Handed(NamedTuple):
    """What ElementsTaken took: the reader's reply."""

    elements: list[BufferedElement]
    end_of_sequence: bool
    error: TaskError | None


Instruction = ToExecutor | FetchSplits | ReportCompleted | Wake | Handed


class WorkerTask:
    """One task's replicas, buffer, split order, credits and split stock. Not thread-safe:
    the shell serialises `handle`."""

    def __init__(self, definition: common_pb2.TaskDef, clock: Clock) -> None:
        self.definition = definition
        self._clock = clock
        self.replicas: tuple[int, ...] = ()  # executor slot of each replica
        self.buffer: deque[BufferedElement] = deque()
        self.ended_replicas: set[int] = set()
        self.error: TaskError | None = None
        self.started = False
        self.completed = False  # end_of_sequence handed to a reader
        self.order = SplitOrder()  # elements in split order
        self.credits = CreditLedger()
        self.arrivals = Arrivals()
        self.local_cursor: LocalSplitCursor | None = None
        self.stock: SplitStock | None = None  # DYNAMIC: the dispatcher's splits, asked ahead

    @property
    def task_id(self) -> int:
        return self.definition.task_id

    def exhausted(self) -> bool:
        return self.started and len(self.ended_replicas) == len(self.replicas) and not self.buffer

    def running(self) -> bool:
        """Elements may still come: a replica runs and nothing failed."""
        return self.error is None and len(self.ended_replicas) < len(self.replicas)

    def stops(self) -> list[Instruction]:
        """Stop every replica."""
        return [ToExecutor(slot, Stop((self.task_id, index)))
                for index, slot in enumerate(self.replicas)]

    def handle(self, event: Event) -> list[Instruction]:
        match event:
            case ElementsArrived(elements):
                return self._arrived(elements)
            case ElementsTaken(max_elements, max_bytes):
                return self._taken(max_elements, max_bytes)
            case ReplicaBlocked(replica):
                n = self.credits.blocked(replica)
                return [ToExecutor(self.replicas[replica], Credit((self.task_id, replica), n))
                        ] if n else []
            case ReplicaEnded(replica):
                return self._ended(replica)
            case ReplicaFailed(replica, error):
                return self._failed(replica, error)
            case ExecutorLost(slot):
                return self._lost(slot)
            case SplitsAsked():
                return self._asked(event)
            case SplitDone(replica, finished):
                return self._done(replica, finished)
            case SplitsFetched(repetition, splits, error, cover_s):
                if self.stock is None:
                    return []
                self.stock.budget.told_cover_s = cover_s
                self.stock.fetched(repetition, splits, error, now=self._clock())
                return self._answer_waiters()
            case Started():
                return self._started(event)
            case Deleted():
                if self.stock is not None:
                    self.stock.close()
                self.buffer.clear()
                return [*self.stops(), Wake(0, everyone=True)]
        raise TypeError(f"not a task event: {event!r}")

    def _started(self, started: Started) -> list[Instruction]:
        self.replicas, self.started = started.replicas, True
        if started.local_splits is not None:
            self.local_cursor = LocalSplitCursor(started.local_splits)
        elif started.stock_depth is not None:
            self.stock = SplitStock(started.stock_depth)
        return []

    # ------------------------------------------------------------------ elements
    def _arrived(self, elements: list[BufferedElement]) -> list[Instruction]:
        now = self._clock()
        note, admit, append = self.arrivals.note, self.order.admit, self.buffer.append
        for element in elements:  # per element: names bound once
            note(now)
            if admit(element.replica, element.split, element):
                append(element)
        return [Wake(len(self.buffer))]

    def _taken(self, max_elements: int, max_bytes: int) -> list[Instruction]:
        taken: list[BufferedElement] = []
        size = 0
        buffer, ended, credit = self.buffer, self.ended_replicas, self.credits.taken
        while buffer and len(taken) < max_elements and (not taken or size < max_bytes):
            element = buffer.popleft()
            taken.append(element)
            element_size = payload_nbytes(element.payload)
            size += element_size
            if element.replica not in ended:
                credit(element.replica, element_size)
        error = self.error if not buffer else None
        end = self.exhausted() and error is None
        out: list[Instruction] = [Handed(taken, end and not taken, error)]
        out += [ToExecutor(self.replicas[replica], Credit((self.task_id, replica), n))
                for replica, n in self.credits.due()]
        if end and not self.completed:
            self.completed = True
            out.append(ReportCompleted(self.task_id))
        return out

    def _ended(self, replica: int) -> list[Instruction]:
        self._release(self.order.finished(replica))
        self.ended_replicas.add(replica)
        self.credits.ended(replica)
        return [Wake(len(self.buffer), everyone=True)]

    def _lost(self, slot: int) -> list[Instruction]:
        lost = TaskError("RuntimeError", "the executor process running this task died", "")
        return [instruction for index, replica_slot in enumerate(self.replicas)
                if replica_slot == slot and index not in self.ended_replicas
                for instruction in self._failed(index, lost)]

    def _release(self, elements: list[BufferedElement]) -> None:
        """Elements the split order let go, to the buffer."""
        self.buffer.extend(elements)

    def _failed(self, replica: int | None, error: TaskError) -> list[Instruction]:
        """Every reader gets `error` once the buffer is drained; the replicas stop."""
        if self.error is None:
            self.error = error
        self._release(self.order.flush())
        if replica is not None:
            self.ended_replicas.add(replica)
            self.credits.ended(replica)
        return [Wake(len(self.buffer), everyone=True), *self.stops()]

    # ------------------------------------------------------------------ splits
    def _asked(self, ask: SplitsAsked) -> list[Instruction]:
        replica = ask.replica
        out: list[Instruction] = []
        if ask.finished is not None:  # reported once the replica emitted all of it
            self._release(self.order.finished(replica, _key(ask.finished)))
            out.append(Wake(len(self.buffer)))
        if self.local_cursor is not None:  # taken and numbered at once: in cursor order
            index = self.local_cursor.next(ask.repetition)
            splits: tuple[HandedSplit, ...] = ()
            if index is not None:
                key = SplitKey(ask.repetition, index)
                self.order.handed(replica, key)
                splits = (HandedSplit(key),)
            return [*out, ToExecutor(self.replicas[replica], SplitReply(
                (self.task_id, replica), ask.request_id, splits))]
        if self.stock is None:
            return out + self._failed(replica, TaskError(
                "RuntimeError", "this task takes no splits", ""))
        self.stock.ask(_Waiter(replica, ask.request_id, ask.repetition, ask.want),
                       ask.finished, self._clock())
        return out + self._answer_waiters()

    def _done(self, replica: int, finished: FinishedSplit) -> list[Instruction]:
        self._release(self.order.finished(replica, _key(finished)))
        out: list[Instruction] = [Wake(len(self.buffer))]
        if self.stock is not None:
            self.stock.report(finished)
            out += self._answer_waiters()
        return out

    def _answer_waiters(self) -> list[Instruction]:
        """Answer the replicas the stock can answer (recording the hand-out order before they
        can see their splits), fail those it cannot, and fetch what is missing."""
        assert self.stock is not None
        answered, failed, fetch = self.stock.answer_waiters(self._clock())
        out: list[Instruction] = []
        for waiter, numbered in answered:
            for number, split in numbered:
                self.order.handed(waiter.replica, split.key, number)
            out.append(ToExecutor(self.replicas[waiter.replica], SplitReply(
                (self.task_id, waiter.replica), waiter.request_id,
                tuple(split for _, split in numbered))))
        for waiter, (kind, message) in failed:
            out += self._failed(waiter.replica, TaskError(kind, message, ""))
        if fetch is not None:
            out.append(fetch)
        return out


def _key(finished: FinishedSplit) -> SplitKey:
    return SplitKey(finished.repetition, finished.index)


@dataclass
class _Waiter:
    replica: int
    request_id: int
    repetition: int
    want: int


class SplitStock:
    """A DYNAMIC task's splits asked ahead (see the module docstring); part of WorkerTask."""

    def __init__(self, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"split prefetch depth must be >= 0, got {depth!r}")
        # Split time: the interval between the replicas' asks (per split asked for); latency:
        # a GetSplit's. Two splits until they are known.
        self.budget = SplitBudget(cap=depth, ahead=1, unknown=2, cover_s=STOCK_COVER_S)
        self._last_ask: float | None = None
        self._last_want = 1
        self._stock: deque[HandedSplit] = deque()
        self._waiters: deque[_Waiter] = deque()
        self._reports: list[FinishedSplit] = []
        self._request_id = -1
        self._handed = 0  # splits handed to replicas so far
        self._in_flight = False
        self._fetch_started = 0.0
        self._wanted_repetition = 0  # the newest repetition any replica asked for
        self._ended_repetition = -1  # the dispatcher said "no more splits" up to this one
        self._error: tuple[str, str] | None = None
        self._closed = False

    def ask(self, waiter: _Waiter, finished: FinishedSplit | None, now: float) -> None:
        if self._last_ask is not None:  # per split: the last ask was for _last_want
            self.budget.note_split((now - self._last_ask) / self._last_want)
        waiter.want = max(1, min(waiter.want, self.budget.cap))  # no more than the stock
        self._last_ask, self._last_want = now, waiter.want
        if finished is not None:
            self._reports.append(finished)
        self._wanted_repetition = max(self._wanted_repetition, waiter.repetition)
        self._waiters.append(waiter)

    def report(self, finished: FinishedSplit) -> None:
        """It rides on the next fetch (or goes at once after the end, for the waiters)."""
        self._reports.append(finished)

    def fetched(self, repetition: int, splits: list[HandedSplit],
                error: tuple[str, str] | None, *, now: float) -> None:
        self._in_flight = False
        self.budget.note_latency(now - self._fetch_started)
        if error is not None:
            self._error = self._error or error
        elif not splits:
            self._ended_repetition = max(self._ended_repetition, repetition)
        else:
            self._stock.extend(splits)

    def close(self) -> None:
        self._closed = True
        self._waiters.clear()

    def answer_waiters(self, now: float) -> tuple[
            list[tuple[_Waiter, list[tuple[int, HandedSplit]]]],
            list[tuple[_Waiter, tuple[str, str]]],
            FetchSplits | None]:
        """The waiters answered (with their splits, numbered in hand-out order), those failed,
        and the fetch still needed."""
        if self._closed:
            return [], [], None
        if self._error is not None:
            failed = [(waiter, self._error) for waiter in self._waiters]
            self._waiters.clear()
            return [], failed, None
        answered = []
        while self._waiters:
            waiter = self._waiters[0]
            splits: list[tuple[int, HandedSplit]] = []
            while len(splits) < waiter.want and (
                    split := self._take_for(waiter.repetition)) is not None:
                splits.append((self._handed, split))
                self._handed += 1
            if not splits and not end_believed(
                    ended_for=self._ended_repetition, repetition=waiter.repetition,
                    reports_pending=bool(self._reports) or self._in_flight):
                break
            answered.append((waiter, splits))
            self._waiters.popleft()
        return answered, [], None if self._in_flight else self._fetch(now)

    def _fetch(self, now: float) -> FetchSplits | None:
        # A waiter whose repetition has ended is answered "no more" once reports are out.
        ended = self._ended_repetition >= min(
            [self._wanted_repetition, *(w.repetition for w in self._waiters)])
        target = self.budget.target()
        missing = sum(w.want for w in self._waiters) + target - len(self._stock)
        # Refill once the stock is down to half, for all that is missing: each request then
        # carries several splits (fewer round trips and fsyncs), and waiters (only left when
        # the stock has nothing for them) are always asked for.
        refill = missing > 0 and (len(self._stock) <= target // 2 or bool(self._waiters))
        # Before the end, reports ride on the next fetch (a replica that reports also asks,
        # so one comes soon). After it they still go out, with a request the dispatcher
        # answers with end again (or a requeued split); waiters wait for that.
        if not ((not ended and refill) or (ended and self._reports)):
            return None
        self._in_flight, self._fetch_started = True, now
        self._request_id += 1
        reports, self._reports = self._reports, []
        return FetchSplits(self._wanted_repetition, self._request_id, reports, max(1, missing))

    def _take_for(self, repetition: int) -> HandedSplit | None:
        """The first split in stock for a replica in `repetition`: not one of a newer
        repetition once its own has ended (a requeued older one is fine for anyone)."""
        for i, split in enumerate(self._stock):
            if split.key.repetition <= repetition or self._ended_repetition < repetition:
                del self._stock[i]
                return split
        return None
