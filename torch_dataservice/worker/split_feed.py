"""A task's DYNAMIC splits, asked of the dispatcher ahead of need and several at a time.

Without it a replica waits a whole GetSplit round trip (and, in fault-tolerant mode, the
dispatcher's fsync) between two splits. The feed keeps a stock of splits per task and, once it
is down to half, refills it with one GetSplit for as many splits as are missing
(`max_splits`): the dispatcher hands them in cursor order under one journal sync, so a round
trip and an fsync are paid per batch of splits, not per split, and one task's splits are still
produced in the order the cursor hands them out. The stock is sized to what the replicas use
while a request is under way (twice the measured GetSplit latency over the measured interval
between the splits they take, and at least MIN_STOCK_S of their work), at most `depth`: cheap
splits are asked for many at a time, costly ones (a DataLoader batch) one or two ahead, so a
worker does not sit on work another could do.

A replica may ask for several splits at once (`want`: cheap splits, worker/executor_process.py)
and gets up to that many from the stock in one reply, at least one. It reports each split it
finished, with its next ask or on its own (`report`); either way before it asks again.

One request is in flight per task at a time, under the feed's own replica id with increasing
request numbers, so a request retried after a lost reply gets the same splits back (the
dispatcher remembers its last answer per replica id). Splits a replica finished are reported
with the next request; a replica is told "no more splits" only after a request that carried
every report so far came back with end of splits, so the end of a repetition is known to the
dispatcher exactly as it was without the feed (see dispatcher/splits.py, exactly-once).

Splits are numbered in the order they are handed to replicas (`Split.handed`, decided under the
feed's lock although replies go out on several threads), so the task releases their elements in
that order (worker/reorder.py).

Splits in stock are held by the task on the dispatcher like any other: if the worker dies
they are requeued, and a garbage-collected iteration hands them on. A task whose replicas stop
before the splits run out (a `take` after the source) leaves its stock unproduced, as the
cursor's remaining splits are: such a pipeline reads part of the data by design.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.worker.messages import FinishedSplit

logger = logging.getLogger(__name__)

# The feed's replica id in GetSplit (executor replicas would use 0, 1, ...).
FEED_REPLICA = 1 << 20
# The stock covers at least this much of the replicas' work, however fast the dispatcher
# answers: cheap splits (a few hundred tiny elements, under a millisecond) then come many per
# GetSplit, whose cost (a gRPC call on both sides, a lock, a journal sync) they share; a stock
# this short is no work another worker misses.
MIN_STOCK_S = 0.02


@dataclass(frozen=True)
class Split:
    index: int
    skip: tuple[int, ...]
    repetition: int
    handed: int = field(default=-1, compare=False)  # splits of the task handed out before it


# (repetition asked for, replica id, request id, finished splits, max splits)
#   -> the splits handed out, in order; empty at the end of the repetition's splits
FetchSplits = Callable[[int, int, int, list[FinishedSplit], int], "list[Split]"]
# Reply to a replica's request: a split, or None for "no more splits in its repetition".
Reply = Callable[["Split | None"], None]
# Reply to a replica's request for several: up to that many splits, none for "no more".
ReplyMany = Callable[["list[Split]"], None]
# The feed failed (the dispatcher stayed unreachable, or refused): (type, message)
Fail = Callable[[str, str], None]


@dataclass
class _Waiter:
    repetition: int
    reply: ReplyMany
    fail: Fail
    want: int = 1


class SplitFeed:
    def __init__(self, fetch: FetchSplits, pool: Executor, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"split prefetch depth must be >= 0, got {depth!r}")
        self._fetch = fetch
        self._pool = pool
        self._depth = depth
        # Exponential moving averages (seconds): GetSplit latency and the interval between
        # replicas' requests; they size the stock (see the module docstring).
        self._latency_s: float | None = None
        self._interval_s: float | None = None
        self._last_request = 0.0
        self._last_want = 1
        self._lock = threading.Lock()
        self._stock: deque[Split] = deque()
        self._waiters: deque[_Waiter] = deque()
        self._reports: list[FinishedSplit] = []
        self._request_id = -1
        self._handed = 0  # splits handed to replicas so far
        self._in_flight = False
        self._wanted_repetition = 0  # the newest repetition any replica asked for
        self._ended_repetition = -1  # the dispatcher said "no more splits" up to this one
        self._error: tuple[str, str] | None = None
        self._closed = False

    def request(self, repetition: int, finished: FinishedSplit | None,
                reply: Reply, fail: Fail) -> None:
        """A replica wants its next split of `repetition`, having finished `finished`."""
        self.request_many(repetition, finished,
                          lambda splits: reply(splits[0] if splits else None), fail)

    def request_many(self, repetition: int, finished: FinishedSplit | None,
                     reply: ReplyMany, fail: Fail, want: int = 1) -> None:
        """A replica wants up to `want` next splits of `repetition` (one reply with at least
        one, or none at the end), having finished `finished`."""
        now = time.monotonic()
        with self._lock:
            if self._last_request:  # per split: the last request asked for _last_want
                self._interval_s = _ewma(self._interval_s,
                                         (now - self._last_request) / self._last_want)
            want = max(1, min(want, self._depth))  # a replica holds no more than the stock
            self._last_request, self._last_want = now, want
            if finished is not None:
                self._reports.append(finished)
            self._wanted_repetition = max(self._wanted_repetition, repetition)
            self._waiters.append(_Waiter(repetition, reply, fail, want))
            actions = self._settle_locked()
        _run(actions)

    def report(self, finished: FinishedSplit) -> None:
        """A replica finished `finished` and goes on with a split it holds (no ask): the report
        rides on the next fetch (or goes at once after the end, for the waiters)."""
        with self._lock:
            self._reports.append(finished)
            actions = self._settle_locked()
        _run(actions)

    def close(self) -> None:
        """Stop asking for splits (the task is deleted); waiting replicas are not answered."""
        with self._lock:
            self._closed = True
            self._waiters.clear()

    # ------------------------------------------------------------------ under the lock
    def _settle_locked(self) -> list[Callable[[], None]]:
        """Answer the waiters that can be answered, then start the fetch still needed."""
        actions: list[Callable[[], None]] = []
        if self._closed:
            return actions
        if self._error is not None:
            kind, message = self._error
            while self._waiters:
                waiter = self._waiters.popleft()
                actions.append(functools.partial(waiter.fail, kind, message))
            return actions
        while self._waiters:
            waiter = self._waiters[0]
            splits: list[Split] = []
            while len(splits) < waiter.want and (
                    split := self._take_for(waiter.repetition)) is not None:
                splits.append(Split(split.index, split.skip, split.repetition, self._handed))
                self._handed += 1
            if not splits and not (self._ended_repetition >= waiter.repetition
                                   and not self._reports and not self._in_flight):
                break
            actions.append(functools.partial(waiter.reply, splits))
            self._waiters.popleft()
        if self._in_flight:
            return actions
        # A waiter whose repetition has ended is answered "no more" once reports are out.
        ended = self._ended_repetition >= min(
            [self._wanted_repetition, *(w.repetition for w in self._waiters)])
        target = self._target_stock()
        missing = sum(w.want for w in self._waiters) + target - len(self._stock)
        # Refill once the stock is down to half, for all that is missing: each request then
        # carries several splits (fewer round trips and fsyncs), and waiters (only left when
        # the stock has nothing for them) are always asked for.
        refill = missing > 0 and (len(self._stock) <= target // 2 or bool(self._waiters))
        # Before the end, reports ride on the next fetch (a replica that reports also asks,
        # so one comes soon). After it they still go out, with a request the dispatcher
        # answers with end again (or a requeued split); waiters wait for that.
        if (not ended and refill) or (ended and self._reports):
            self._in_flight = True
            self._request_id += 1
            reports, self._reports = self._reports, []
            actions.append(functools.partial(
                self._submit, self._wanted_repetition, self._request_id, reports,
                max(1, missing)))
        return actions

    def _take_for(self, repetition: int) -> Split | None:
        """The first split in stock for a replica in `repetition`: not one of a newer
        repetition once its own has ended (a requeued older one is fine for anyone)."""
        for i, split in enumerate(self._stock):
            if split.repetition <= repetition or self._ended_repetition < repetition:
                del self._stock[i]
                return split
        return None

    def _target_stock(self) -> int:
        """Splits to keep in stock: enough for twice a request's latency and at least
        MIN_STOCK_S of the replicas' work, at most `depth`."""
        if self._latency_s is None or not self._interval_s:
            return min(self._depth, 2)
        need = math.ceil(max(2 * self._latency_s, MIN_STOCK_S) / self._interval_s) + 1
        return max(0, min(self._depth, need))

    # ------------------------------------------------------------------ fetching
    def _submit(self, repetition: int, request_id: int, reports: list[FinishedSplit],
                max_splits: int) -> None:
        try:
            self._pool.submit(self._run_fetch, repetition, request_id, reports, max_splits)
        except RuntimeError:  # the pool is shut down: the worker is stopping
            with self._lock:
                self._in_flight = False

    def _run_fetch(self, repetition: int, request_id: int, reports: list[FinishedSplit],
                   max_splits: int) -> None:
        error: tuple[str, str] | None = None
        splits: list[Split] = []
        started = time.monotonic()
        try:
            splits = self._fetch(repetition, FEED_REPLICA, request_id, reports, max_splits)
        except ServiceUnavailableError as exc:
            error = ("ServiceUnavailableError", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the replicas that wait
            logger.warning("GetSplit failed: %s: %s", type(exc).__name__, exc)
            error = (type(exc).__name__, f"GetSplit failed: {exc}")
        with self._lock:
            self._in_flight = False
            self._latency_s = _ewma(self._latency_s, time.monotonic() - started)
            if error is not None:
                self._error = self._error or error
            elif not splits:
                self._ended_repetition = max(self._ended_repetition, repetition)
            else:
                self._stock.extend(splits)
            actions = self._settle_locked()
        _run(actions)


def _ewma(average: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if average is None else average + weight * (sample - average)


def _run(actions: list[Callable[[], None]]) -> None:
    for action in actions:
        action()
