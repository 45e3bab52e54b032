"""Rates from running totals reported now and then (heartbeats): a short sliding window.

A heartbeat carries totals since the reporter started; a rate is the change of a total over
the window's span. Samples closer than `MIN_GAP_S` to the previous one replace it (clients
heartbeat every 0.1 s), so a window holds a bounded number of samples.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

WINDOW_S = 10.0
MIN_GAP_S = 0.5


def clean(value: float) -> float:
    """A reported figure as the dispatcher trusts it: finite and not negative."""
    return value if math.isfinite(value) and value > 0 else 0.0


Sample = tuple[float, tuple[float, ...]]  # (when, totals)


class Ends(NamedTuple):
    """A window's oldest and newest samples: every figure comes from them. Immutable, so a
    reader may use them after letting go of the lock that guards the window (the dispatcher's
    status is built outside its lock: dispatcher/status.py)."""

    first: Sample
    last: Sample

    @property
    def latest(self) -> tuple[float, ...]:
        return self.last[1]

    def delta(self) -> tuple[float, tuple[float, ...]]:
        """(seconds spanned, change of each total); (0, zeros) with fewer than 2 samples."""
        (t0, first), (t1, last) = self
        return t1 - t0, tuple(b - a for a, b in zip(first, last, strict=True))

    def rate(self, index: int) -> float:
        span, change = self.delta()
        return change[index] / span if span > 0 else 0.0


NO_SAMPLES = Ends((0.0, ()), (0.0, ()))


class RateWindow:
    """Totals at recent times; `rate(i)` is total i's change per second over the window."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque()
        # Kept as samples come (a heartbeat's work): reading a window is then one attribute.
        self.ends = NO_SAMPLES

    def add(self, now: float, totals: Sequence[float]) -> None:
        values = tuple(clean(float(v)) for v in totals)
        samples = self._samples
        if samples and any(new < old for new, old in zip(values, samples[-1][1], strict=False)):
            samples.clear()  # the reporter restarted: its totals began again at 0
        if len(samples) >= 2 and now - samples[-2][0] < MIN_GAP_S:
            samples.pop()
        samples.append((now, values))
        while len(samples) > 2 and now - samples[1][0] >= self._window_s:
            samples.popleft()
        self.ends = Ends(samples[0], samples[-1])

    @property
    def latest(self) -> tuple[float, ...]:
        return self.ends.latest

    def delta(self) -> tuple[float, tuple[float, ...]]:
        """(seconds spanned, change of each total) over the window; (0, zeros) with < 2."""
        return self.ends.delta()

    def rate(self, index: int) -> float:
        return self.ends.rate(index)
