"""Rates from running totals reported now and then (heartbeats): a short sliding window.

A heartbeat carries totals since the reporter started; a rate is the change of a total over
the window's span. Samples closer than `MIN_GAP_S` to the previous one replace it (clients
heartbeat every 0.1 s), so a window holds a bounded number of samples.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

WINDOW_S = 10.0
MIN_GAP_S = 0.5


def clean(value: float) -> float:
    """A reported figure as the dispatcher trusts it: finite and not negative."""
    return value if math.isfinite(value) and value > 0 else 0.0


class RateWindow:
    """Totals at recent times; `rate(i)` is total i's change per second over the window."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque()

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

    @property
    def latest(self) -> tuple[float, ...]:
        return self._samples[-1][1] if self._samples else ()

    def delta(self) -> tuple[float, tuple[float, ...]]:
        """(seconds spanned, change of each total) over the window; (0, zeros) with < 2."""
        if len(self._samples) < 2:
            return 0.0, tuple(0.0 for _ in self.latest)
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        return t1 - t0, tuple(b - a for a, b in zip(first, last, strict=True))

    def rate(self, index: int) -> float:
        span, change = self.delta()
        return change[index] / span if span > 0 else 0.0
