"""WorkerTask (worker/task_state.py) event by event: no process, no thread, no sleep; the time
is a fake clock and the dispatcher a cursor the test answers for. The cases the multi-process
tests found are replayed here: an end believed too early, a split stranded at an epoch's end,
a replica holding several splits, an executor killed mid-split."""

from __future__ import annotations

import random
from collections import deque

import pytest

from torch_dataservice.proto import common_pb2
from torch_dataservice.wire.splits import HandedSplit, SplitKey
from torch_dataservice.worker.messages import Credit, FinishedSplit, SplitReply, Stop, TaskError
from torch_dataservice.worker.task_state import (
    BufferedElement,
    Deleted,
    ElementsArrived,
    ElementsTaken,
    ExecutorLost,
    FetchSplits,
    Handed,
    ReplicaEnded,
    ReportCompleted,
    SplitDone,
    SplitsAsked,
    SplitsFetched,
    Started,
    ToExecutor,
    Wake,
    WorkerTask,
    stock_depth,
)

pytestmark = pytest.mark.timeout(30)

TASK = 7


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Cursor:
    """The dispatcher: `num_splits` splits per repetition, handed in order; records every
    FetchSplits and the reports they carried."""

    def __init__(self, num_splits: int) -> None:
        self.num_splits = num_splits
        self.position = (0, 0)
        self.calls: list[FetchSplits] = []
        self.reported: list[FinishedSplit] = []
        self.requeued: list[HandedSplit] = []

    def answer(self, fetch: FetchSplits) -> list[HandedSplit]:
        self.calls.append(fetch)
        self.reported += fetch.finished
        granted, self.requeued = self.requeued[:fetch.max_splits], self.requeued[
            fetch.max_splits:]
        while len(granted) < fetch.max_splits:
            repetition, index = self.position
            if fetch.repetition < repetition:
                break
            if fetch.repetition > repetition:
                index = 0
            if index >= self.num_splits:
                self.position = (fetch.repetition, index)
                break
            self.position = (fetch.repetition, index + 1)
            granted.append(HandedSplit(SplitKey(fetch.repetition, index)))
        return granted


class Driver:
    """Feeds a task events and plays the shell: FetchSplits wait in `pending` until answered
    (at once with `eager`), after `latency_s` of the clock, each reply asking the stock to
    cover `cover_s` (as a big fleet's dispatcher does); SplitReplies are collected."""

    def __init__(self, task: WorkerTask, cursor: Cursor, clock: Clock, *,
                 eager: bool = True, latency_s: float = 0.0, cover_s: float = 0.0) -> None:
        self.task, self.cursor, self.clock = task, cursor, clock
        self.eager, self.latency_s, self.cover_s = eager, latency_s, cover_s
        self.pending: deque[FetchSplits] = deque()
        self.replies: dict[tuple[int, int], tuple[HandedSplit, ...]] = {}
        self.sent: list[ToExecutor] = []
        self.request_ids = iter(range(10**9))
        self.max_pending = 0
        self.reports_sent = 0
        self.early_ends: list[str] = []  # "no more" while a report sent was not out

    def event(self, event) -> list:
        instructions = self.task.handle(event)
        for instruction in instructions:
            if isinstance(instruction, FetchSplits):
                self.pending.append(instruction)
                self.max_pending = max(self.max_pending, len(self.pending))
            elif isinstance(instruction, ToExecutor):
                self.sent.append(instruction)
                if isinstance(instruction.message, SplitReply):
                    reply = instruction.message
                    self.replies[(reply.key[1], reply.request_id)] = reply.splits
                    if not reply.splits and len(self.cursor.reported) != self.reports_sent:
                        self.early_ends.append(f"{reply}: {len(self.cursor.reported)} of "
                                               f"{self.reports_sent} reports out")
        if self.eager:
            self.answer_all()
        return instructions

    def answer_one(self) -> None:
        fetch = self.pending.popleft()
        self.clock.now += self.latency_s
        self.event(SplitsFetched(fetch.repetition, self.cursor.answer(fetch),
                                 cover_s=self.cover_s))

    def answer_all(self) -> None:
        while self.pending:
            self.answer_one()

    def ask(self, replica: int, repetition: int, finished: FinishedSplit | None = None,
            want: int = 1) -> int:
        """A replica's ask; its request id (the reply, once there, is in `replies`)."""
        request_id = next(self.request_ids)
        self.reports_sent += finished is not None
        self.event(SplitsAsked(replica, request_id, repetition, finished, want))
        return request_id

    def take(self, replica: int, repetition: int, finished: FinishedSplit | None = None,
             want: int = 1) -> tuple[HandedSplit, ...]:
        """Ask and return the reply (which must have come)."""
        return self.replies.pop((replica, self.ask(replica, repetition, finished, want)))


def dynamic(depth: int, slots: tuple[int, ...] = (0,), **driver) -> Driver:
    clock = Clock()
    task = WorkerTask(common_pb2.TaskDef(task_id=TASK), clock)
    task.handle(Started(slots, stock_depth=depth))
    return Driver(task, Cursor(driver.pop("num_splits", 10)), clock, **driver)


def done(split: HandedSplit, elements: int = 1) -> FinishedSplit:
    return FinishedSplit(split.key.repetition, split.key.index, elements)


# ------------------------------------------------------------------ the split stock
def test_asks_ahead_in_one_request_and_answers_from_stock() -> None:
    d = dynamic(depth=2)
    assert [s.key.index for s in d.take(0, 0)] == [0]
    # One request for the replica that asked and two more kept ahead of need.
    assert [c.max_splits for c in d.cursor.calls] == [3]
    assert [d.take(0, 0)[0].key.index for _ in range(2)] == [1, 2]  # from stock, in order
    assert len(d.cursor.calls) >= 2, "the stock was not refilled"


def test_depth_zero_fetches_only_on_demand() -> None:
    d = dynamic(depth=0)
    for expected in range(3):
        assert d.take(0, 0)[0].key.index == expected
    assert [c.max_splits for c in d.cursor.calls] == [1, 1, 1]


@pytest.mark.parametrize("seed", range(5))
def test_every_split_once_in_order_and_end_only_after_the_last_report(seed: int) -> None:
    d = dynamic(depth=3, slots=(0, 1, 2), num_splits=40, eager=False, latency_s=0.002)
    rng = random.Random(seed)
    got: list[list[int]] = [[], [], []]
    asked: dict[int, int] = {}  # replica -> request id under way
    last: dict[int, HandedSplit] = {}
    ended: set[int] = set()
    while len(ended) < 3:
        d.clock.now += 0.0005
        if d.pending and rng.random() < 0.5:
            d.answer_one()
            continue
        replica = rng.choice([r for r in range(3) if r not in ended])
        if replica not in asked:
            finished = done(last.pop(replica), 7) if replica in last else None
            asked[replica] = d.ask(replica, 0, finished)
            continue
        reply = d.replies.pop((replica, asked[replica]), None)
        if reply is None:
            if d.pending:
                d.answer_one()
            continue
        del asked[replica]
        if not reply:
            ended.add(replica)
            continue
        (split,) = reply
        got[replica].append(split.key.index)
        last[replica] = split
    # Told "no more" only once the dispatcher had every report sent so far.
    assert not d.early_ends, d.early_ends
    assert sorted(i for g in got for i in g) == list(range(40))
    for g in got:  # each replica's splits come in cursor order
        assert g == sorted(g)
    assert sorted(r.index for r in d.cursor.reported) == list(range(40))
    assert d.max_pending == 1, "two requests in flight (a retry could misfire)"
    assert any(c.max_splits > 1 for c in d.cursor.calls), "never asked for several splits"
    # Request ids count up, so the dispatcher can recognise a retry.
    assert [c.request_id for c in d.cursor.calls] == list(range(len(d.cursor.calls)))
    assert len(d.cursor.calls) < 40, "one request per split: nothing was batched"


def test_next_repetition_after_the_end_of_one() -> None:
    d = dynamic(depth=2, num_splits=2)
    first = [d.take(0, 0)[0], d.take(0, 0)[0]]
    assert [s.key.index for s in first] == [0, 1]
    assert d.take(0, 0, done(first[1], 3)) == ()
    second = [d.take(0, 1)[0], d.take(0, 1)[0]]
    assert [s.key for s in second] == [(1, 0), (1, 1)]
    assert d.take(0, 1, done(second[1], 3)) == ()


def test_a_failed_fetch_fails_the_task_and_stops_its_replicas() -> None:
    d = dynamic(depth=1, eager=False)
    d.ask(0, 0)
    fetch = d.pending.popleft()
    instructions = d.event(SplitsFetched(fetch.repetition, [], ("ServiceUnavailableError",
                                                                "dispatcher gone")))
    assert d.task.error == TaskError("ServiceUnavailableError", "dispatcher gone", "")
    assert ToExecutor(0, Stop((TASK, 0))) in instructions
    assert Wake(0, everyone=True) in instructions
    # A later ask fails too, and asks the dispatcher nothing.
    assert ToExecutor(0, Stop((TASK, 0))) in d.event(SplitsAsked(0, 5, 0, None))
    assert not d.pending


def test_negative_depth_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="-1"):
        dynamic(depth=-1)


def _consume(d: Driver, count: int, work_s: float) -> None:
    finished = None
    for _ in range(count):
        (split,) = d.take(0, 0, finished)
        d.clock.now += work_s  # the split's work
        finished = done(split)


def test_the_stock_grows_for_cheap_splits_behind_a_slow_dispatcher() -> None:
    d = dynamic(depth=16, num_splits=10_000, latency_s=0.02)
    _consume(d, 150, work_s=0.001)
    # Requests take 20 ms and a split 1 ms: several splits per request, up to the depth.
    assert max(c.max_splits for c in d.cursor.calls) >= 8
    assert max(c.max_splits for c in d.cursor.calls) <= 16 + 1


def test_the_stock_stays_small_for_costly_splits() -> None:
    d = dynamic(depth=16, num_splits=10_000, latency_s=0.001)
    _consume(d, 30, work_s=0.2)
    # A split's work hides a request many times over: no need to hold many splits.
    assert max(c.max_splits for c in d.cursor.calls) <= 3


def test_a_stock_of_splits_of_a_few_ms_asks_the_dispatcher_a_few_times_a_second() -> None:
    """A decoded image per split (5 ms): one GetSplit per split or two cost the dispatcher a
    tenth of the work it handed out; the stock covers STOCK_COVER_S (100 ms) instead."""
    d = dynamic(depth=64, num_splits=10_000, latency_s=0.001)
    _consume(d, 400, work_s=0.005)  # 2 s of work
    assert len(d.cursor.calls) <= 50, len(d.cursor.calls)


def test_a_stock_told_to_cover_more_asks_for_more_splits_less_often() -> None:
    """A big fleet's dispatcher tells each stock how much work to cover (GetSplitResponse
    .split_cover_ms): with 2 s told, half-second splits go several to a request."""
    asks = {}
    for cover_s in (0.0, 2.0):
        d = dynamic(depth=64, num_splits=10_000, latency_s=0.001, cover_s=cover_s)
        _consume(d, 60, work_s=0.5)
        asks[cover_s] = len(d.cursor.calls)
    assert asks[0.0] >= 50  # its own rule: a split or two per request
    assert asks[2.0] <= 60 / 2  # covering 4 splits, refilled at half: 2 or more a request


def test_a_request_for_several_gets_up_to_that_many_numbered_in_order() -> None:
    d = dynamic(depth=4, num_splits=10)
    taken = list(d.take(0, 0, want=3))
    assert 1 <= len(taken) <= 3 and [s.key.index for s in taken] == list(range(len(taken)))
    while splits := d.take(0, 0, done(taken[-1]), want=3):
        assert len(splits) <= 3
        taken += splits
    assert [s.key.index for s in taken] == list(range(10))
    # Numbered in hand-out order in the task's split order (worker/reorder.py).
    numbers = d.task.order._numbers  # noqa: SLF001 - the order's own record
    assert [numbers.get((0, s.key), n) for n, s in enumerate(taken)] == list(range(10))


def test_reports_on_their_own_reach_the_dispatcher_before_the_end() -> None:
    d = dynamic(depth=2, num_splits=6)
    held: list[HandedSplit] = []
    while len(held) < 6:
        held += d.take(0, 0, want=6)
    for split in held[:-1]:  # reported as read, with no ask
        d.reports_sent += 1
        d.event(SplitDone(0, done(split, 2)))
    # The end comes only in answer to the ask that carries the last report, after every one.
    assert d.take(0, 0, done(held[-1], 2)) == ()
    assert sorted(r.index for r in d.cursor.reported) == list(range(6))


def test_a_reply_holds_no_more_than_the_depth() -> None:
    d = dynamic(depth=4, num_splits=100)
    assert len(d.take(0, 0, want=50)) <= 4
    assert max(c.max_splits for c in d.cursor.calls) <= 4 + 4


def test_the_stock_is_at_most_a_part_of_the_epoch() -> None:
    assert stock_depth(64, 60) == 3  # 60 splits: a newcomer still finds most of them
    assert stock_depth(64, 4000) == 64
    assert stock_depth(64, 5) == 1
    assert stock_depth(0, 4000) == 0  # split_prefetch=0: only on demand
    assert stock_depth(64, 0) == 64  # the number of splits is not known


# ------------------------------------------------------------------ the cases tests found
def test_an_end_is_not_believed_while_a_report_is_not_out() -> None:
    """The dispatcher said "no more" to a request sent before split 0's report: a replica
    asking after that report waits for a request that carries it, then gets the end."""
    d = dynamic(depth=2, num_splits=2, eager=False)
    request = d.ask(0, 0, want=2)
    d.answer_one()
    held = d.replies.pop((0, request))
    assert [s.key.index for s in held] == [0, 1]
    assert d.pending, "the stock is empty: it refills"
    d.reports_sent += 1
    d.event(SplitDone(0, done(held[0])))  # reported while the refill is under way
    d.answer_one()  # ... which comes back empty: the end, but without split 0's report
    assert d.cursor.reported == []
    request = d.ask(0, 0, done(held[1]))
    d.answer_one()  # the request that carries split 0's report (not split 1's)
    assert (0, request) not in d.replies, "an end believed before the reports went out"
    d.answer_one()  # ... and the one that carries split 1's
    assert d.replies.pop((0, request)) == ()
    assert d.cursor.reported == [done(held[0]), done(held[1])]
    assert not d.early_ends


def test_a_split_of_a_newer_repetition_is_not_stranded_with_a_reader_of_an_ended_one() -> None:
    """Repetition 0 ended; a requeued split of it goes to anyone, a split of repetition 1
    never to a reader still in repetition 0 (which is told "no more" instead)."""
    d = dynamic(depth=2, slots=(0, 1), num_splits=1)
    (first,) = d.take(0, 0)
    assert d.take(0, 0, done(first)) == ()  # repetition 0 ended
    (newer,) = d.take(1, 1)  # replica 1 reads repetition 1
    assert newer.key == (1, 0)
    d.cursor.requeued = [HandedSplit(SplitKey(0, 5), (0, 1))]  # a dead worker's split
    assert d.take(1, 1, done(newer)) == (HandedSplit(SplitKey(0, 5), (0, 1)),)
    assert d.take(0, 0) == ()  # nothing of repetition 1 for a reader of repetition 0


def element(replica: int, split: SplitKey | None, offset: int = 0) -> BufferedElement:
    return BufferedElement(f"{replica}:{split}:{offset}".encode(), split, offset, replica)


def taken(d: Driver, n: int = 100) -> Handed:
    handed = d.event(ElementsTaken(n, 1 << 30))[0]
    assert isinstance(handed, Handed)
    return handed


def test_a_replica_holding_several_splits_releases_them_in_hand_out_order() -> None:
    d = dynamic(depth=4, slots=(0, 1), num_splits=10)
    a, b = d.take(0, 0, want=2)  # replica 0 holds two splits
    (c,) = d.take(1, 0)  # handed after them
    d.event(ElementsArrived([element(1, c.key)]))
    d.event(ElementsArrived([element(0, b.key)]))
    assert taken(d).elements == [], "a later split's elements went out first"
    d.event(ElementsArrived([element(0, a.key)]))
    assert [e.split for e in taken(d).elements] == [a.key]
    d.event(SplitDone(0, done(a)))  # b is the head now; c still waits for b
    assert [e.split for e in taken(d).elements] == [b.key]
    d.event(ReplicaEnded(0))  # every split replica 0 held is finished
    assert [e.split for e in taken(d).elements] == [c.key]


def test_an_executor_killed_mid_split_fails_the_task_after_what_was_made() -> None:
    d = dynamic(depth=4, slots=(0, 1), num_splits=10)
    (a,) = d.take(0, 0)
    (b,) = d.take(1, 0)
    d.event(ElementsArrived([element(0, a.key), element(1, b.key, 0)]))
    d.event(ElementsArrived([element(1, b.key, 1)]))
    instructions = d.event(ExecutorLost(1))
    assert ToExecutor(0, Stop((TASK, 0))) in instructions  # the task's replicas stop
    assert d.task.ended_replicas == {1}
    first = taken(d, 2)  # what was made before goes out, then the error, once
    assert [e.offset for e in first.elements] == [0, 0] and first.error is None
    last = taken(d)
    assert [e.offset for e in last.elements] == [1]
    assert last.error == TaskError("RuntimeError",
                                   "the executor process running this task died", "")
    assert not last.end_of_sequence
    assert d.event(ExecutorLost(1)) == [], "a replica failed twice"


def test_credits_go_back_in_batches_and_the_end_is_reported_once() -> None:
    clock = Clock()
    task = WorkerTask(common_pb2.TaskDef(task_id=TASK), clock)
    task.handle(Started((3,)))
    task.handle(ElementsArrived([element(0, None, i) for i in range(40)]))
    out = task.handle(ElementsTaken(40, 1 << 30))
    assert out[1:] == [ToExecutor(3, Credit((TASK, 0), 40))]
    task.handle(ReplicaEnded(0))
    end = task.handle(ElementsTaken(10, 1 << 30))
    assert end == [Handed([], True, None), ReportCompleted(TASK)]
    assert task.handle(ElementsTaken(10, 1 << 30)) == [Handed([], True, None)]


def test_a_deleted_task_stops_and_answers_no_waiting_replica() -> None:
    d = dynamic(depth=1, eager=False)
    request = d.ask(0, 0)
    assert d.event(Deleted()) == [ToExecutor(0, Stop((TASK, 0))), Wake(0, everyone=True)]
    d.answer_all()
    assert (0, request) not in d.replies
