"""SplitOrder on its own: elements leave split by split, in hand-out order, and the head split's
elements are never held (so its replica always gets its credits back)."""

from __future__ import annotations

import random

import pytest

from torch_dataservice.worker.reorder import SplitOrder

pytestmark = pytest.mark.timeout(30)


class Front:
    """What TaskManager does with a SplitOrder: admitted and released elements, in order."""

    def __init__(self) -> None:
        self.order = SplitOrder()
        self.out: list[str] = []

    def element(self, replica: int, split: object, name: str) -> None:
        if self.order.admit(replica, split, name):
            self.out.append(name)

    def ask(self, replica: int, split: object | None = None, number: int | None = None) -> None:
        self.out += self.order.finished(replica)
        if split is not None:
            self.order.handed(replica, split, number)


def test_a_later_split_waits_for_the_head_split() -> None:
    front = Front()
    front.ask(0, "a")
    front.ask(1, "b")
    front.element(1, "b", "b0")  # replica 1 is faster
    front.element(0, "a", "a0")
    front.element(1, "b", "b1")
    assert front.out == ["a0"] and front.order.held == 2
    front.ask(1, "c")  # replica 1 finished b and takes c: b still waits for a
    front.element(1, "c", "c0")
    front.element(0, "a", "a1")  # the head's elements go out at once
    assert front.out == ["a0", "a1"]
    front.ask(0)  # a finished (replica 0 asks, the answer comes later): b, then c so far
    assert front.out == ["a0", "a1", "b0", "b1", "c0"] and front.order.held == 0
    front.element(1, "c", "c1")  # c is the head now
    assert front.out[-1] == "c1"


def test_an_empty_split_and_an_ended_replica_finish_their_split() -> None:
    front = Front()
    front.ask(0, "a")  # replica 0's split yields nothing (a filter dropped it all)
    front.ask(1, "b")
    front.element(1, "b", "b0")
    assert front.out == []
    front.ask(0, "c")  # a finished, empty: b is the head
    assert front.out == ["b0"]
    front.element(0, "c", "c0")
    assert front.out == ["b0"]  # c waits for b
    front.out += front.order.finished(1)  # replica 1 ended
    assert front.out == ["b0", "c0"]


def test_elements_without_a_known_split_pass_through_and_flush_releases_all() -> None:
    front = Front()
    front.element(0, None, "static")  # a replica that reads no splits
    front.ask(0, "a")
    front.ask(1, "b")
    front.element(1, "b", "b0")
    front.element(1, "zzz", "unknown")
    assert front.out == ["static", "unknown"]
    assert front.order.flush() == ["b0"]  # the task failed: what was made goes out first
    front.element(1, "b", "b1")
    assert front.out[-1] == "b1"


def test_numbers_decided_elsewhere_order_splits_handed_on_racing_threads() -> None:
    front = Front()
    front.ask(1, "second", number=1)  # its reply's thread won the race
    front.element(1, "second", "s0")
    assert front.out == []  # split 0 was handed out first, even if not seen yet
    front.ask(0, "first", number=0)
    front.element(0, "first", "f0")
    front.ask(0)
    assert front.out == ["f0", "s0"]


def test_random_interleavings_release_every_element_in_split_order() -> None:
    rng = random.Random(7)
    for _ in range(50):
        front = Front()
        splits = [(s, rng.randrange(0, 4)) for s in range(30)]  # (split, elements)
        queues: dict[int, list] = {0: [], 1: [], 2: []}
        for split, count in splits:  # hand out in order, to a random replica
            queues[rng.randrange(3)].append((split, count))
        progress = {r: 0 for r in queues}  # elements of its current split emitted
        current: dict[int, int | None] = {r: None for r in queues}
        # Splits are handed out in split order: a replica takes its next one only in turn.
        pending = list(splits)
        while True:
            live = [r for r in queues if queues[r] or current[r] is not None]
            if not live:
                break
            r = rng.choice(live)
            if current[r] is None:
                if not queues[r] or pending[0][0] != queues[r][0][0]:
                    continue  # not this replica's turn to take a split
                split, count = queues[r].pop(0)
                pending.pop(0)
                front.ask(r, split)
                current[r], progress[r] = split, 0
            split = current[r]
            count = dict(splits)[split]
            if progress[r] < count:
                front.element(r, split, f"{split}.{progress[r]}")
                progress[r] += 1
            else:
                front.ask(r)
                current[r] = None
        expected = [f"{s}.{k}" for s, count in splits for k in range(count)]
        assert front.out == expected


def test_a_replica_asking_ahead_holds_two_splits_and_finishes_them_by_name() -> None:
    """A replica asks for its next split while it reads one (worker/executor_process.py):
    handing it the next finishes nothing; its report names the split it finished."""
    front = Front()
    front.order.handed(0, "a")
    front.order.handed(0, "b")  # asked ahead while reading a
    front.order.handed(1, "c")
    front.element(0, "a", "a0")
    front.element(1, "c", "c0")  # c waits for a and b
    assert front.out == ["a0"]
    front.out += front.order.finished(0, "a")  # replica 0 reports a finished, reads b
    front.element(0, "b", "b0")
    assert front.out == ["a0", "b0"]
    front.out += front.order.finished(0, "zzz")  # unknown split: nothing happens
    assert front.out == ["a0", "b0"]
    front.out += front.order.finished(0)  # replica 0 ended: every split it held finished
    assert front.out == ["a0", "b0", "c0"] and front.order.held == 0


def test_a_replica_holding_several_splits_releases_them_in_hand_out_order() -> None:
    """A replica of cheap splits gets several in one reply (worker/executor_process.py) and
    reports each as it finishes it: a later split of another replica waits for all of them,
    and an ended replica finishes those it never started."""
    front = Front()
    for number, split in enumerate("abc"):  # one reply to replica 0: a, b, c
        front.order.handed(0, split, number)
    front.order.handed(1, "d", 3)
    front.order.handed(0, "e", 4)
    front.element(1, "d", "d0")
    front.element(0, "a", "a0")
    front.out += front.order.finished(0, "a")
    front.element(0, "b", "b0")
    front.out += front.order.finished(0, "b")
    assert front.out == ["a0", "b0"] and front.order.held == 1
    front.out += front.order.finished(0, "c")  # c was empty
    assert front.out == ["a0", "b0", "d0"]
    front.element(0, "e", "e0")  # e waits for d
    assert front.out == ["a0", "b0", "d0"]
    front.out += front.order.finished(1)  # replica 1 ended
    assert front.out == ["a0", "b0", "d0", "e0"] and front.order.held == 0
