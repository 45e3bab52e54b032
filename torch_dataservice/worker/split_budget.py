"""How many DYNAMIC splits to hold ahead of need, and when "no more splits" is believed.

Splits wait in two places on a worker: the task's stock in the front (worker/task_state.py,
asked of the dispatcher) and each replica's hold in its executor (worker/replica_splits.py,
asked of the front). Both size themselves with this one policy: hold enough splits to cover
COVER_S of the replicas' work, or twice the time it takes to get more if that is longer, at
most a cap. Cheap splits are then asked for many at a time (the round trip, the fsync, the
wake-ups are shared), costly ones (a DataLoader batch) one or two ahead, so a worker does not
sit on work another could do, above all at an epoch's end.

The end of a repetition is believed by the same rule in both places (`end_believed`).
"""

from __future__ import annotations

import math

# The splits held cover at least this much of the replicas' work, however fast more come: a
# split of a few hundred tiny elements costs less than a round trip, and a hold this short is
# no work another worker misses.
COVER_S = 0.02
# ... and a task's stock, which asks the dispatcher, at least this much: a GetSplit costs the
# dispatcher about half a millisecond of CPU (gRPC's share is most of it), so one per 5-ms
# split (a decoded image) cost it a tenth of the work it handed out; covering 100 ms, a task
# asks at most about 20 times a second, and holds no more than that at an epoch's end.
STOCK_COVER_S = 0.1


def end_believed(*, ended_for: int, repetition: int, reports_pending: bool) -> bool:
    """The end-of-repetition rule, for every tier: "no more splits" for `repetition` is
    believed only as the answer to an ask for `repetition` (or a later one, `ended_for`) that
    carried every report so far (none pending), and only by a reader that holds no split
    (the caller's condition). Then the dispatcher knew every split finished in the repetition
    when it said so, which exactly-once needs (dispatcher/splits.py)."""
    return ended_for >= repetition and not reports_pending


def ewma(average: float | None, sample: float, weight: float = 0.2) -> float:
    """Exponential moving average: `sample` moves `average` by `weight` of the difference."""
    return sample if average is None else average + weight * (sample - average)


class SplitBudget:
    """Splits to hold: ceil(cover / a split's time) + `ahead`, at least `least`, at most the
    cap; `unknown` (capped) until a split's time was measured. Not thread-safe."""

    def __init__(self, *, cap: int, ahead: int = 0, least: int = 0, unknown: int = 1,
                 cover_s: float | None = None) -> None:
        if cap < 0:
            raise ValueError(f"split budget cap must be >= 0, got {cap!r}")
        self._cap = cap
        self._ahead = ahead
        self._least = least
        self._unknown = unknown
        self._cover_s = COVER_S if cover_s is None else cover_s
        # What the dispatcher asked the worker's stock to cover (dispatcher/cadence.py
        # split_cover_ms): more than its own rule in a fleet too big for one split per ask.
        self.told_cover_s = 0.0
        self._split_s: float | None = None  # moving average: one split's time
        self._latency_s: float | None = None  # moving average: the time to get more splits

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def split_s(self) -> float | None:
        """A split's time, as measured so far."""
        return self._split_s

    def note_split(self, seconds: float) -> None:
        """One split took `seconds` of the readers' time (or came that long after the last)."""
        self._split_s = ewma(self._split_s, seconds)

    def note_latency(self, seconds: float) -> None:
        """Getting more splits took `seconds`."""
        self._latency_s = ewma(self._latency_s, seconds)

    def target(self, cap: int | None = None) -> int:
        """Splits to hold now (`cap`: a lower cap for this once)."""
        cap = self._cap if cap is None else min(cap, self._cap)
        if not self._split_s:
            return max(self._least, min(cap, self._unknown))
        cover_s = max(2 * (self._latency_s or 0.0), self._cover_s, self.told_cover_s)
        need = math.ceil(cover_s / self._split_s) + self._ahead
        return max(self._least, min(cap, need))
