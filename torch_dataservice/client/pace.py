"""How many elements a reader's fetch asks for: about PACE_S of what its consumer takes.

A reply may carry up to FETCH_MAX_ELEMENTS, so that tiny elements cost few round trips. But
what a reader fetched and has not consumed yet is no one else's: readers of one shared DYNAMIC
job that each asked for 512 at a time (with four fetches outstanding) left the first to ask
holding the epoch's elements while others got none, and the epoch lasted as long as the
slowest holder took to consume its hoard (64 readers taking 25 elements/s, 8,000 elements:
28 readers read nothing, one read 763 and the epoch took 31 s instead of 5 s). A fetch now
asks for what its consumer takes in PACE_S, between FETCH_MIN_ELEMENTS and
FETCH_MAX_ELEMENTS: a fast consumer still gets 512 a reply, and a slow one holds at most a
few of its own seconds. (tf.data service asks one element per request.)

Starting from the floor costs a fast consumer little: a starved consumer takes what arrives,
and `max_outstanding_requests` fetches of FETCH_MIN_ELEMENTS per round trip of a millisecond
bring tens of thousands a second, so the estimate climbs within a few updates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FETCH_MAX_ELEMENTS = 512
FETCH_MIN_ELEMENTS = 16  # the worker lingers for this many anyway (worker/flow.py)
PACE_S = 0.5  # a fetch asks for about this long of the consumer's takes
RATE_TAU_S = 1.0  # the consumer's rate is a moving average over about this long
_UPDATE_S = 0.05  # the rate is updated at most this often


class FetchPace:
    """The consumer's rate (`took`, from its thread) and the fetch size it warrants
    (`max_elements`, from any fetch thread)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._taken = 0  # written by the consumer's thread only
        self._counted = 0  # _taken at the last update
        self._at = clock()
        self.rate = 0.0  # elements a second

    def took(self) -> None:
        self._taken += 1

    def max_elements(self) -> int:
        now = self._clock()
        with self._lock:
            elapsed = now - self._at
            if elapsed >= _UPDATE_S:
                taken = self._taken
                weight = min(1.0, elapsed / RATE_TAU_S)
                self.rate += weight * ((taken - self._counted) / elapsed - self.rate)
                self._counted, self._at = taken, now
            rate = self.rate
        return int(min(FETCH_MAX_ELEMENTS, max(FETCH_MIN_ELEMENTS, rate * PACE_S)))
