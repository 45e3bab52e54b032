"""An executor replica's DYNAMIC splits: asked of the front ahead of need, several at once while
they are cheap, each reported finished before the next one's elements.

A split of a few hundred tiny elements costs less than a round trip to the front per split
(pickling, two wake-ups, a wait), so a replica holds splits beyond the one it reads, as many
as worker/split_budget.py says for its splits' time (at most MAX_HELD_SPLITS, and splits worth
at most HELD_CREDITS_PART of its credits: another replica's elements wait for them in the
front's order, worker/reorder.py), asks for more in one message once it is down to half, and
reports each split it finished on its own (SplitDone) or on the ask it makes then. A costly
split (a DataLoader batch) is asked for one ahead: a worker holds no more of them at an
epoch's end than it must. The front answers from its task's split stock
(worker/task_state.py), which the dispatcher's requeue covers like any split the task holds.

An end ("no more splits") is believed by split_budget.end_believed: in answer to an ask sent
after the last report, in the same repetition, with nothing held.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any, Protocol

from torch_dataservice.wire.splits import HandedSplit
from torch_dataservice.worker.messages import (
    FinishedSplit,
    ReplicaKey,
    SplitDone,
    SplitReply,
    SplitRequest,
)
from torch_dataservice.worker.split_budget import SplitBudget, end_believed, ewma

MAX_HELD_SPLITS = 64
HELD_CREDITS_PART = 0.5
# A report of a split shorter than this waits for the replica's next write (its next element,
# ask or end), which comes soon: no wake-up of the sender for it.
LAZY_REPORT_S = 0.002


class Stopped(Exception):
    """The front stopped this replica (task deleted or the worker shuts down)."""


class Outbox(Protocol):
    """The executor loop's side the asks and reports go out through."""

    def send(self, message: Any, inline: bool = False, wake: bool = True) -> None: ...

    def flush(self) -> None: ...


class SplitAsker:
    """The replica thread's splits; `deliver` and `stop` come from the executor's receive
    loop."""

    def __init__(self, outbox: Outbox, key: ReplicaKey, credits: int) -> None:
        self._outbox = outbox
        self._key = key
        self._credit_limit = credits
        self._cond = threading.Condition()
        self._replies: dict[int, SplitReply] = {}
        self._stopped = False
        self._request_ids = itertools.count()
        # Splits handed and not started yet, in hand-out order; the ask under way, (repetition
        # asked, request id); whether a split was reported since that ask (an end it answers
        # may predate the report); whether an ask ahead came back with an end (no more asks
        # ahead until the splits held run out).
        self._held: deque[HandedSplit] = deque()
        self._asked: tuple[int, int] | None = None
        self._reported_since_ask = False
        self._end_ahead = False
        self._budget = SplitBudget(cap=MAX_HELD_SPLITS, least=1)  # by a split's duration
        self._split_elements: float | None = None  # moving average of a split's elements

    def deliver(self, reply: SplitReply) -> None:
        with self._cond:
            self._replies[reply.request_id] = reply
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def next(self, repetition: int, finished: FinishedSplit | None,
             split_s: float | None) -> HandedSplit | None:
        """The next split of `repetition` (None at a believable end), having finished
        `finished` in `split_s` (None: it took none before)."""
        if split_s is not None:
            self._budget.note_split(split_s)
        if finished is not None:
            self._split_elements = ewma(self._split_elements, finished.elements)
        self._take_arrived()
        if not self._held:
            if finished is not None and self._asked is not None:
                self._report(finished, wake=True)  # before waiting for the answer
                finished = None
            self._fill(repetition, finished)  # an ask it makes carries the report
            finished = None
        if not self._held:
            return None
        handed = self._held.popleft()
        self._ask_ahead(repetition, finished)
        return handed

    def _fill(self, repetition: int, finished: FinishedSplit | None) -> None:
        """Wait for splits (the ask under way, or one asked now carrying `finished`) until
        some are held or at a believable end (none held)."""
        while not self._held:
            if self._asked is None:
                self._asked = (repetition, self._ask(repetition, finished, 1))
                finished = None
            asked_repetition, request_id = self._asked
            reply = self._wait(request_id)
            self._asked = None
            self._end_ahead = False
            self._held.extend(reply.splits)
            if not reply.splits and end_believed(
                    ended_for=asked_repetition, repetition=repetition,
                    reports_pending=self._reported_since_ask):
                break

    def _take_arrived(self) -> None:
        """Take the answer to the ask under way if it came already (no wait)."""
        if self._asked is None:
            return
        with self._cond:
            reply = self._replies.pop(self._asked[1], None)
        if reply is None:
            return
        self._asked = None
        self._held.extend(reply.splits)
        # An end is not believed while splits are held (their reports follow): asked again
        # once they run out, not ahead.
        self._end_ahead = not reply.splits

    def _ask_ahead(self, repetition: int, finished: FinishedSplit | None) -> None:
        """Ask for more splits once those held are down to half the work to hold; the report
        of `finished` rides on that ask, or goes on its own."""
        per_split = max(1.0, self._split_elements or 1.0)
        target = self._budget.target(int(HELD_CREDITS_PART * self._credit_limit / per_split))
        split_s = self._budget.split_s
        if self._asked is None and not self._end_ahead and len(self._held) <= target // 2:
            self._asked = (repetition, self._ask(repetition, finished, target - len(self._held)))
        elif finished is not None:
            # While splits are short it need not go at once: this split's elements (or the
            # next ask, or the end) are written soon and carry it, in order.
            self._report(finished, wake=split_s is None or split_s >= LAZY_REPORT_S)

    def _report(self, finished: FinishedSplit, wake: bool) -> None:
        """Report `finished` on its own (without `wake`: with the next write)."""
        self._reported_since_ask = True
        self._outbox.send(SplitDone(self._key, finished), wake=wake)

    def _ask(self, repetition: int, finished: FinishedSplit | None, want: int) -> int:
        """Ask the front for up to `want` splits (written right away: the answer is awaited,
        with every report queued before it); its id."""
        request_id = next(self._request_ids)
        self._reported_since_ask = False
        self._outbox.send(SplitRequest(self._key, request_id, repetition, finished, want),
                          inline=True)
        return request_id

    def _wait(self, request_id: int) -> SplitReply:
        if request_id not in self._replies:
            self._outbox.flush()  # a report left for the next write goes before the wait
        with self._cond:
            while request_id not in self._replies:
                if self._stopped:
                    raise Stopped
                self._cond.wait(1.0)
            return self._replies.pop(request_id)

