"""SplitFeed on its own, against a fake dispatcher cursor (the real one is covered by the
DYNAMIC integration and exactly-once tests, which all run through the feed)."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.worker.split_feed import FEED_REPLICA, Split, SplitFeed

pytestmark = pytest.mark.timeout(30)


class FakeDispatcher:
    """`num_splits` splits per repetition; records every call; can fail."""

    def __init__(self, num_splits: int, delay_s: float = 0.0) -> None:
        self.num_splits = num_splits
        self.delay_s = delay_s
        self.cursor = (0, 0)
        self.calls: list[tuple[int, int, int, list, int]] = []
        self.reported: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()
        self.error: Exception | None = None
        self.in_flight = 0
        self.overlap = False

    def fetch(self, repetition: int, replica: int, request_id: int, finished: list,
              max_splits: int) -> list[Split]:
        with self.lock:
            self.overlap |= self.in_flight > 0
            self.in_flight += 1
            self.calls.append((repetition, replica, request_id, list(finished), max_splits))
        time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= 1
            if self.error is not None:
                raise self.error
            self.reported += finished
            granted = []
            for _ in range(max_splits):
                cursor_repetition, index = self.cursor
                if repetition < cursor_repetition:
                    break
                if repetition > cursor_repetition:
                    index = 0
                if index >= self.num_splits:
                    self.cursor = (repetition, index)
                    break
                self.cursor = (repetition, index + 1)
                granted.append(Split(index, (), repetition))
            return granted


def ask(feed: SplitFeed, repetition: int, finished=None, timeout: float = 10):
    answers: queue.Queue = queue.Queue()
    feed.request(repetition, finished, answers.put,
                 lambda kind, message: answers.put(RuntimeError(f"{kind}: {message}")))
    answer = answers.get(timeout=timeout)
    if isinstance(answer, Exception):
        raise answer
    return answer


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def test_asks_ahead_in_one_request_and_answers_from_stock(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=10)
    feed = SplitFeed(dispatcher.fetch, pool, depth=2)
    assert ask(feed, 0).index == 0
    # One request for the replica that asked and two more kept ahead of need.
    assert [(c[1], c[4]) for c in dispatcher.calls] == [(FEED_REPLICA, 3)]
    assert [ask(feed, 0).index for _ in range(2)] == [1, 2]  # from stock, in cursor order
    deadline = time.monotonic() + 5
    while len(dispatcher.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(dispatcher.calls) >= 2, "the stock was not refilled"


def test_depth_zero_fetches_only_on_demand(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=10)
    feed = SplitFeed(dispatcher.fetch, pool, depth=0)
    for expected in range(3):
        assert ask(feed, 0).index == expected
    time.sleep(0.1)
    assert [c[4] for c in dispatcher.calls] == [1, 1, 1]


def test_every_split_once_in_order_and_end_only_after_the_last_report(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=40, delay_s=0.002)
    feed = SplitFeed(dispatcher.fetch, pool, depth=3)
    got: list[list[int]] = [[], [], []]
    failures: list[str] = []

    def replica(i: int) -> None:
        finished = None
        while (split := ask(feed, 0, finished)) is not None:
            got[i].append(split.index)
            finished = (split.repetition, split.index, 7)
        with dispatcher.lock:  # told "no more" only once the dispatcher has every report
            if len(dispatcher.reported) != sum(len(g) for g in got):
                failures.append(f"replica {i} ended before every report was sent")

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not failures, failures
    assert sorted(i for g in got for i in g) == list(range(40))
    for g in got:  # each replica's splits come in cursor order
        assert g == sorted(g)
    assert sorted(index for _, index, _ in dispatcher.reported) == list(range(40))
    assert not dispatcher.overlap, "two requests in flight (a retry could misfire)"
    assert any(c[4] > 1 for c in dispatcher.calls), "never asked for several splits"
    # Request ids count up, so the dispatcher can recognise a retry.
    assert [c[2] for c in dispatcher.calls] == list(range(len(dispatcher.calls)))
    assert len(dispatcher.calls) < 40, "one request per split: nothing was batched"


def test_next_repetition_after_the_end_of_one(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=2)
    feed = SplitFeed(dispatcher.fetch, pool, depth=2)
    first = [ask(feed, 0), ask(feed, 0)]
    assert [s.index for s in first] == [0, 1]
    assert ask(feed, 0, (0, 1, 3)) is None
    second = [ask(feed, 1), ask(feed, 1)]
    assert [(s.repetition, s.index) for s in second] == [(1, 0), (1, 1)]
    assert ask(feed, 1, (1, 1, 3)) is None


def test_a_failed_fetch_fails_the_waiting_replica(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=5)
    dispatcher.error = ServiceUnavailableError("dispatcher gone")
    feed = SplitFeed(dispatcher.fetch, pool, depth=1)
    with pytest.raises(RuntimeError, match="ServiceUnavailableError: dispatcher gone"):
        ask(feed, 0)
    with pytest.raises(RuntimeError, match="dispatcher gone"):  # and later ones too
        ask(feed, 0)


def test_negative_depth_is_a_value_error(pool) -> None:
    with pytest.raises(ValueError, match="-1"):
        SplitFeed(lambda *a: [], pool, depth=-1)


def _consume(feed: SplitFeed, count: int, work_s: float) -> None:
    finished = None
    for _ in range(count):
        split = ask(feed, 0, finished)
        assert split is not None
        time.sleep(work_s)  # the split's work
        finished = (split.repetition, split.index, 1)


def test_the_stock_grows_for_cheap_splits_behind_a_slow_dispatcher(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=10_000, delay_s=0.02)
    feed = SplitFeed(dispatcher.fetch, pool, depth=16)
    _consume(feed, 150, work_s=0.001)
    # Requests take 20 ms and a split 1 ms: several splits per request, up to the depth.
    assert max(c[4] for c in dispatcher.calls) >= 8
    assert max(c[4] for c in dispatcher.calls) <= 16 + 1


def test_the_stock_stays_small_for_costly_splits(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=10_000, delay_s=0.001)
    feed = SplitFeed(dispatcher.fetch, pool, depth=16)
    _consume(feed, 30, work_s=0.02)
    # A split's work hides a request many times over: no need to hold many splits.
    assert max(c[4] for c in dispatcher.calls) <= 3


def ask_many(feed: SplitFeed, repetition: int, want: int, finished=None, timeout: float = 10):
    answers: queue.Queue = queue.Queue()
    feed.request_many(repetition, finished, answers.put,
                      lambda kind, message: answers.put(RuntimeError(f"{kind}: {message}")),
                      want)
    answer = answers.get(timeout=timeout)
    if isinstance(answer, Exception):
        raise answer
    return answer


def test_a_request_for_several_gets_up_to_that_many_numbered_in_order(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=10)
    feed = SplitFeed(dispatcher.fetch, pool, depth=4)
    first = ask_many(feed, 0, want=3)
    assert 1 <= len(first) <= 3 and [s.index for s in first] == list(range(len(first)))
    assert [s.handed for s in first] == list(range(len(first)))
    taken = list(first)
    while (splits := ask_many(feed, 0, want=3, finished=(0, taken[-1].index, 1))):
        assert len(splits) <= 3
        taken += splits
    assert [s.index for s in taken] == list(range(10))
    assert [s.handed for s in taken] == list(range(10))


def test_reports_on_their_own_reach_the_dispatcher_before_the_end(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=6, delay_s=0.002)
    feed = SplitFeed(dispatcher.fetch, pool, depth=2)
    held = []
    while len(held) < 6:
        held += ask_many(feed, 0, want=6)
    for split in held[:-1]:  # reported as read, with no ask
        feed.report((split.repetition, split.index, 2))
    # The end comes only in answer to the ask that carries the last report, after every one.
    assert ask(feed, 0, (0, held[-1].index, 2)) is None
    with dispatcher.lock:
        assert sorted(r[1] for r in dispatcher.reported) == list(range(6))


def test_a_reply_holds_no_more_than_the_depth(pool) -> None:
    dispatcher = FakeDispatcher(num_splits=100)
    feed = SplitFeed(dispatcher.fetch, pool, depth=4)
    assert len(ask_many(feed, 0, want=50)) <= 4
    assert max(c[4] for c in dispatcher.calls) <= 4 + 4


def test_the_stock_is_at_most_a_part_of_the_epoch() -> None:
    from torch_dataservice.worker.tasks import stock_depth

    assert stock_depth(64, 60) == 3  # 60 splits: a newcomer still finds most of them
    assert stock_depth(64, 4000) == 64
    assert stock_depth(64, 5) == 1
    assert stock_depth(0, 4000) == 0  # split_prefetch=0: only on demand
    assert stock_depth(64, 0) == 64  # the number of splits is not known
