"""A fetch asks for about half a second of what the consumer takes (client/pace.py)."""

from __future__ import annotations

import pytest

from torch_dataservice.client.pace import FETCH_MAX_ELEMENTS, FETCH_MIN_ELEMENTS, FetchPace

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def consume(pace: FetchPace, clock: Clock, per_s: float, seconds: float) -> int:
    """The consumer takes `per_s` elements a second for `seconds`, a fetch asking every 50 ms;
    the last fetch's size."""
    size = pace.max_elements()
    for _ in range(round(seconds / 0.05)):
        clock.now += 0.05
        for _ in range(round(per_s * 0.05)):
            pace.took()
        size = pace.max_elements()
    return size


def test_a_new_reader_asks_for_the_floor() -> None:
    assert FetchPace(Clock()).max_elements() == FETCH_MIN_ELEMENTS


def test_a_slow_consumer_asks_for_the_floor_and_a_fast_one_for_the_ceiling() -> None:
    clock = Clock()
    slow = FetchPace(clock)
    assert consume(slow, clock, per_s=20, seconds=5) == FETCH_MIN_ELEMENTS
    fast = FetchPace(clock)
    assert consume(fast, clock, per_s=20_000, seconds=0.1) == FETCH_MAX_ELEMENTS


def test_the_size_follows_the_consumer_s_pace() -> None:
    clock = Clock()
    pace = FetchPace(clock)
    assert consume(pace, clock, per_s=400, seconds=5) in range(190, 201)  # half a second's
    assert consume(pace, clock, per_s=0, seconds=5) == FETCH_MIN_ELEMENTS  # it stopped
    assert consume(pace, clock, per_s=100_000, seconds=0.2) == FETCH_MAX_ELEMENTS
