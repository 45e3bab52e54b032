"""An executor replica's split asks (worker/replica_splits.py), against a scripted front: how
many splits it asks for at once, where its reports go, and when it believes an end. The whole
path through real processes is covered by the DYNAMIC integration and exactly-once tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from torch_dataservice.observability import stages
from torch_dataservice.wire.splits import HandedSplit, SplitKey
from torch_dataservice.worker import replica_splits, split_budget
from torch_dataservice.worker.executor_process import _Replica
from torch_dataservice.worker.messages import FinishedSplit, SplitDone, SplitReply, SplitRequest

pytestmark = pytest.mark.timeout(30)

KEY = (7, 0)


@pytest.fixture(autouse=True)
def cheap_splits(monkeypatch) -> None:
    """Every split counts as cheap, whatever the machine's load (COVER_S of an hour, so the
    number held is MAX_HELD_SPLITS, and reports wait for the next write); the test of costly
    splits lowers it again."""
    monkeypatch.setattr(split_budget, "COVER_S", 3600.0)
    monkeypatch.setattr(replica_splits, "LAZY_REPORT_S", 3600.0)


class ScriptedFront:
    """Stands for the executor loop and the front: answers each SplitRequest at once with
    `answer(request)` (the split indexes handed, none for "no more"); records what is sent."""

    def __init__(self, answer: Callable[[SplitRequest], list[int]]) -> None:
        self.answer = answer
        self.sent: list[SplitRequest | SplitDone] = []
        self.clocks = stages.ExecutorClocks()
        self.local = None
        self.replica: _Replica | None = None

    def send(self, message: object, inline: bool = False, wake: bool = True) -> None:
        assert isinstance(message, (SplitRequest, SplitDone))
        self.sent.append(message)
        if isinstance(message, SplitRequest):
            assert inline and self.replica is not None
            splits = tuple(HandedSplit(SplitKey(message.repetition, index))
                           for index in self.answer(message))
            assert len(splits) <= message.want
            self.replica.deliver_split(SplitReply(KEY, message.request_id, splits))

    def flush(self) -> None:
        pass

    def forget(self, key: object) -> None:
        pass

    @property
    def requests(self) -> list[SplitRequest]:
        return [m for m in self.sent if isinstance(m, SplitRequest)]

    def reports(self) -> list[FinishedSplit]:
        """Every report, in the order it was sent (on an ask or on its own)."""
        return [m.finished for m in self.sent if m.finished is not None]


def replica_for(answer: Callable[[SplitRequest], list[int]],
                credits: int = 1024) -> tuple[_Replica, ScriptedFront]:
    front = ScriptedFront(answer)
    front.replica = _Replica(front, KEY, None, dataset_id="d", compression=None, use_splits=True,
                              credits=credits)
    return front.replica, front


def cursor(num_splits: int) -> Callable[[SplitRequest], list[int]]:
    """Hands splits 0.. in order, as many as asked for, then "no more"."""
    state = {"next": 0}

    def answer(request: SplitRequest) -> list[int]:
        first = state["next"]
        state["next"] = min(num_splits, first + request.want)
        return list(range(first, state["next"]))

    return answer


def test_cheap_splits_are_asked_for_several_at_once_and_each_reported_once() -> None:
    replica, front = replica_for(cursor(100))
    taken = [replica.get_split(0, 0) for _ in range(40)]
    assert taken == list(range(40))  # every split once, in hand-out order
    # The first ask is for one (a split's cost is not known yet), then many at once.
    assert front.requests[0].want == 1
    assert max(r.want for r in front.requests) == replica_splits.MAX_HELD_SPLITS
    assert len(front.requests) < 10
    assert front.reports() == [FinishedSplit(0, i, 0) for i in range(39)]  # once, in order


def test_the_end_is_believed_only_after_an_ask_that_follows_the_last_report() -> None:
    replica, front = replica_for(cursor(5))
    taken = []
    while (index := replica.get_split(0, 0)) is not None:
        taken.append(index)
    assert taken == list(range(5))
    assert front.reports() == [FinishedSplit(0, i, 0) for i in range(5)]
    # The answer believed ("no more") was to an ask sent after the last report went.
    last_report = max(i for i, m in enumerate(front.sent)
                      if m.finished == FinishedSplit(0, 4, 0))
    assert isinstance(front.sent[-1], SplitRequest) and len(front.sent) - 1 >= last_report


def test_an_end_while_splits_are_held_is_not_believed() -> None:
    # "No more" while split 3 is held, then a requeued split 9, then the end.
    answers = iter([[0], [1], [2, 3], [], [9], [], []])
    replica, front = replica_for(lambda request: next(answers))
    assert [replica.get_split(0, 0) for _ in range(5)] == [0, 1, 2, 3, 9]
    assert replica.get_split(0, 0) is None
    assert front.reports() == [FinishedSplit(0, i, 0) for i in (0, 1, 2, 3, 9)]
    # The end believed came in answer to an ask that carried the report of split 9.
    assert front.requests[-1].finished == FinishedSplit(0, 9, 0)


def test_a_repetition_ends_with_no_ask_left_and_the_next_one_asks_afresh() -> None:
    answers = iter([[0], [], [], [3], []])
    replica, front = replica_for(lambda request: next(answers))
    assert replica.get_split(0, 0) == 0
    # The ask ahead (sent before the report of split 0) said "no more": asked again, with it.
    assert replica.get_split(0, 0) is None
    assert front.requests[2].finished == FinishedSplit(0, 0, 0)
    assert replica.get_split(0, 1) == 3  # nothing of repetition 0 is still under way
    assert [r.repetition for r in front.requests[3:]] == [1, 1]


def test_costly_splits_are_asked_for_one_ahead(monkeypatch) -> None:
    monkeypatch.setattr(split_budget, "COVER_S", 0.001)
    replica, front = replica_for(cursor(100))
    for expected in range(4):
        assert replica.get_split(0, 0) == expected
        time.sleep(0.01)  # the split's work: longer than COVER_S
    assert all(r.want == 1 for r in front.requests)
    assert len(front.requests) == 4 + 1  # one ask under way beside the split read
    assert front.reports() == [FinishedSplit(0, i, 0) for i in range(3)]


def test_the_splits_held_leave_the_other_replicas_credits(monkeypatch) -> None:
    # Splits of 10 elements with 40 credits: at most half the credits' worth held (2 splits).
    replica, front = replica_for(cursor(100), credits=40)
    for expected in range(20):
        assert replica.get_split(0, 0) == expected
        replica._produced[replica._holding] = 10  # noqa: SLF001 - the split's elements
    assert max(r.want for r in front.requests) <= 2
