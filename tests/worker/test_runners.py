"""The worker's task runners on their own, over a fake task buffer (the servers' side is covered
by the coordinated-reads and cross-trainer-cache integration tests)."""

from __future__ import annotations

import pytest

from torch_dataservice.proto import common_pb2, worker_pb2
from torch_dataservice.worker.runners import (
    MAX_HELD_ROUNDS,
    CachingRunner,
    FirstComeFirstServedRunner,
    RoundAlreadyServedError,
    RoundRobinRunner,
    Taken,
    make_runner,
)

pytestmark = pytest.mark.timeout(30)


class FakeBuffer:
    """A task buffer holding 0 .. end-1 (None: endless)."""

    def __init__(self, end: int | None = None) -> None:
        self.next = 0
        self.end = end
        self.asked: list[tuple[int, int]] = []

    def __call__(self, max_elements: int, max_bytes: int, *, wait_s: float) -> Taken:
        self.asked.append((max_elements, max_bytes))
        if self.end is not None and self.next >= self.end:
            return Taken([], True, None)
        stop = self.next + max_elements if self.end is None else min(
            self.next + max_elements, self.end)
        out = list(range(self.next, stop))
        self.next = stop
        return Taken(out, False, None)


class FakeSource:
    """A task buffer producing 0, 1, 2, ... (each element once) with 10-byte payloads."""

    def __init__(self, end: int | None = None) -> None:
        self.produced = 0
        self.end = end

    def __call__(self, max_elements: int, max_bytes: int, *, wait_s: float) -> Taken:
        if self.end is not None and self.produced >= self.end:
            return Taken([], True, None)
        count = max_elements if self.end is None else min(max_elements, self.end - self.produced)
        out = [Element(self.produced + k) for k in range(count)]
        self.produced += count
        return Taken(out, False, None)


class Element:
    def __init__(self, value: int) -> None:
        self.value = value
        self.payload = b"x" * 10


def values(result: Taken) -> list[int]:
    return [e.value for e in result.elements]


# ---------------------------------------------------------------------- one interface
def test_make_runner_picks_the_runner_from_the_task_definition() -> None:
    fcfs, encoded = FakeBuffer(), FakeBuffer()
    plain = common_pb2.TaskDef(task_id=1)
    coordinated = common_pb2.TaskDef(task_id=2, num_consumers=2)
    cached = common_pb2.TaskDef(task_id=3, cross_trainer_cache=True)
    assert isinstance(make_runner(plain, fcfs, encoded, cache_bytes=100),
                      FirstComeFirstServedRunner)
    assert isinstance(make_runner(coordinated, fcfs, encoded, cache_bytes=100), RoundRobinRunner)
    assert isinstance(make_runner(cached, fcfs, encoded, cache_bytes=100), CachingRunner)


def test_every_runner_answers_a_request() -> None:
    buffer = FakeBuffer()
    fcfs = FirstComeFirstServedRunner(buffer)
    assert fcfs.get(worker_pb2.GetElementsRequest(max_elements=3, max_bytes=7), 0.1) == (
        [0, 1, 2], False, None)
    assert fcfs.get(worker_pb2.GetElementsRequest(), 0.1).elements == [3]  # defaults: one
    assert buffer.asked[-1] == (1, 64 << 20)

    rounds = RoundRobinRunner(2, FakeBuffer())
    request = worker_pb2.GetElementsRequest(task_id=5, consumer_index=1, round_index=0)
    assert rounds.get(request, 0.1) == ([1], False, None)
    with pytest.raises(ValueError, match="consumer_index and round_index"):
        rounds.get(worker_pb2.GetElementsRequest(task_id=5), 0.1)

    cache = CachingRunner(10**6, FakeSource())
    request = worker_pb2.GetElementsRequest(trainer_id="a", max_elements=2)
    assert values(cache.get(request, 0.1)) == [0, 1]


# ---------------------------------------------------------------------- round robin
def test_runner_drops_an_incomplete_last_round_for_everyone() -> None:
    runner = RoundRobinRunner(3, FakeBuffer(end=7))
    for round_index, base in ((0, 0), (2, 3)):  # this task serves rounds 0, 2, 4, ...
        for consumer in range(3):
            assert runner.get_round(consumer, round_index, 0.1) == ([base + consumer], False,
                                                                    None)
    assert runner.dropped_at_end == 0  # not ended yet
    for consumer in range(3):
        assert runner.get_round(consumer, 4, 0.1) == ([], True, None)
        assert runner.get_round(consumer, 6, 0.1) == ([], True, None)
    assert runner.dropped_at_end == 1  # element 6: the end replies say so (worker/service.py)


def test_runner_keeps_a_round_until_every_consumer_took_it() -> None:
    runner = RoundRobinRunner(2, FakeBuffer())
    # Consumer 0 runs ahead; it may hold at most MAX_HELD_ROUNDS rounds unread by consumer 1.
    for r in range(MAX_HELD_ROUNDS):
        assert runner.get_round(0, r, 0.1) == ([2 * r], False, None)
    assert runner.get_round(0, MAX_HELD_ROUNDS, 0.05) == ([], False, None)  # waits for 1
    assert runner.get_round(1, 0, 0.1) == ([1], False, None)  # round 0 complete: dropped
    with pytest.raises(RoundAlreadyServedError):
        runner.get_round(1, 0, 0.1)
    assert runner.get_round(0, MAX_HELD_ROUNDS, 0.1) == ([2 * MAX_HELD_ROUNDS], False, None)


# ---------------------------------------------------------------------- the cache
def test_the_cache_computes_each_element_once_for_all_trainers() -> None:
    source = FakeSource()
    cache = CachingRunner(10**6, source)
    a = [v for _ in range(10) for v in values(cache.get_for("a", 10, 10**6, wait_s=0.1))]
    b = [v for _ in range(10) for v in values(cache.get_for("b", 10, 10**6, wait_s=0.1))]
    assert a == b == list(range(100))
    assert source.produced == 100


def test_the_cache_window_is_bounded_in_bytes_and_slow_trainers_jump() -> None:
    source = FakeSource()
    cache = CachingRunner(100, source)  # 10 elements of 10 bytes
    assert values(cache.get_for("slow", 5, 10**6, wait_s=0.1)) == [0, 1, 2, 3, 4]
    fast = [v for _ in range(10) for v in values(cache.get_for("fast", 5, 10**6, wait_s=0.1))]
    assert fast == list(range(50))
    start, length, size = cache.window
    assert size <= 100 and (start, length) == (40, 10)
    assert values(cache.get_for("slow", 5, 10**6, wait_s=0.1)) == [40, 41, 42, 43, 44]
    assert values(cache.get_for("new", 3, 10**6, wait_s=0.1)) == [40, 41, 42]


def test_the_end_of_a_cached_input_is_an_error_for_every_trainer() -> None:
    cache = CachingRunner(10**6, FakeSource(end=3))
    assert values(cache.get_for("a", 10, 10**6, wait_s=0.1)) == [0, 1, 2]
    for trainer_id in ("a", "b"):
        got = cache.get_for(trainer_id, 10, 10**6, wait_s=0.1)
        if trainer_id == "b":
            assert values(got) == [0, 1, 2]
            got = cache.get_for(trainer_id, 10, 10**6, wait_s=0.1)
        assert got.error is not None and "infinite" in got.error.message
