"""prefetch: order, exceptions across the thread, and no leaked threads."""

from __future__ import annotations

import threading
import time

import pytest

from torch_dataservice.pipeline import Pipeline


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tds-prefetch"]


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_prefetch_preserves_elements_and_order() -> None:
    assert list(Pipeline.range(100).prefetch(3)) == list(range(100))
    assert list(Pipeline.range(10).prefetch(0)) == list(range(10))
    assert list(Pipeline.range(3).prefetch(1).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert wait_for(lambda: not prefetch_threads())


def test_prefetch_runs_ahead_of_the_consumer() -> None:
    produced: list[int] = []
    iterator = iter(Pipeline.range(10).map(lambda x: produced.append(x) or x).prefetch(4))
    assert next(iterator) == 0
    assert wait_for(lambda: len(produced) >= 5)
    iterator.close()


def test_prefetch_ships_upstream_exceptions() -> None:
    def fail(x: int) -> int:
        if x == 2:
            raise RuntimeError(f"bad element {x}")
        return x

    seen: list[int] = []
    with pytest.raises(RuntimeError, match="bad element 2"):
        for element in Pipeline.range(5).map(fail).prefetch(2):
            seen.append(element)
    assert seen == [0, 1]
    assert wait_for(lambda: not prefetch_threads())


def test_abandoned_prefetch_stops_its_thread_and_closes_upstream() -> None:
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    iterator = iter(Pipeline.from_iterable(endless).prefetch(2).map(lambda x: x))
    assert [next(iterator) for _ in range(3)] == [0, 1, 2]
    assert len(prefetch_threads()) == 1
    iterator.close()
    assert not prefetch_threads()
    assert closed.is_set()


def test_take_after_prefetch_ends_the_thread() -> None:
    assert list(Pipeline.range(10**9).prefetch(8).take(5)) == [0, 1, 2, 3, 4]
    assert not prefetch_threads()


def test_nested_prefetch_stops_every_thread() -> None:
    iterator = iter(Pipeline.range(10**9).prefetch(2).map(lambda x: x + 1).prefetch(2))
    assert next(iterator) == 1
    iterator.close()
    assert not prefetch_threads()
