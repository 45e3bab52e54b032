"""Where a worker's time goes: split wait, compute, encode and send, per executor process.

Measured inside the executor processes, where the work happens (the front only routes
bytes), with plain floats that one thread each writes: a replica thread sums its compute and
encode times in local variables (two clock reads per element) and publishes them to its own
`ReplicaClock` a few times a second; split waits, credit waits and big payloads' sends are
timed where they happen (not per small element); the executor's sender thread adds its write
time to its own float. No lock and no system call per element (time.perf_counter reads the
vDSO clock). The sender ships the executor's running totals with the messages it writes
anyway, at most every `SHIP_INTERVAL_S` and with every task end, and the front keeps the
latest totals per executor slot (`StageTotals`): a restarted executor starts from zero, so
the totals of a lost one are folded into `retired` and the worker's counters never go down.
"""

from __future__ import annotations

import threading

STAGES = ("split", "compute", "encode", "send")
SHIP_INTERVAL_S = 0.5
PUBLISH_S = 0.2  # how often a replica publishes its local sums

# Indexes into a ReplicaClock's `times`. Gross compute is the time between two elements'
# encodings, less encoding: split waits, credit waits and big sends fall in it and are
# subtracted (see `stages`).
SPLIT, GROSS_COMPUTE, ENCODE, SEND, BLOCKED = range(5)


class ReplicaClock:
    """One replica thread's running times (seconds) and element count; only it writes them."""

    __slots__ = ("times", "elements")

    def __init__(self) -> None:
        self.times = [0.0] * 5
        self.elements = 0

    def publish(self, compute: float, encode: float, elements: int) -> None:
        """Add a replica's local sums (its own thread only)."""
        t = self.times
        t[GROSS_COMPUTE] += compute
        t[ENCODE] += encode
        self.elements += elements

    def stages(self) -> tuple[float, float, float, float]:
        """(split, compute, encode, send): compute excludes split waits, credit waits
        (back-pressure, not work) and big payloads' sends."""
        t = self.times
        return (t[SPLIT], max(0.0, t[GROSS_COMPUTE] - t[SPLIT] - t[BLOCKED] - t[SEND]),
                t[ENCODE], t[SEND])


class ExecutorClocks:
    """The clocks of one executor's replicas, live and ended, plus its sender's write time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken when a replica starts or ends, never per element
        self._live: list[ReplicaClock] = []
        self._ended = [0.0, 0.0, 0.0, 0.0]
        self._ended_elements = 0
        self.write_seconds = 0.0  # the sender thread's own

    def new(self) -> ReplicaClock:
        clock = ReplicaClock()
        with self._lock:
            self._live.append(clock)
        return clock

    def end(self, clock: ReplicaClock) -> None:
        with self._lock:
            if clock in self._live:
                self._live.remove(clock)
                for i, value in enumerate(clock.stages()):
                    self._ended[i] += value
                self._ended_elements += clock.elements

    def totals(self) -> tuple[float, float, float, float, int]:
        """(split, compute, encode, send, elements) so far, for shipping to the front."""
        with self._lock:
            sums = list(self._ended)
            elements = self._ended_elements
            for clock in self._live:
                for i, value in enumerate(clock.stages()):
                    sums[i] += value
                elements += clock.elements
        return sums[0], sums[1], sums[2], sums[3] + self.write_seconds, elements


class StageTotals:
    """The worker front's view: the latest totals each executor slot shipped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_slot: dict[int, tuple[float, ...]] = {}
        self._retired = (0.0, 0.0, 0.0, 0.0, 0)

    def update(self, slot: int, totals: tuple[float, ...]) -> None:
        with self._lock:
            self._by_slot[slot] = tuple(totals)

    def lost(self, slot: int) -> None:
        """Slot `slot`'s executor died: keep what it had reported, its successor starts at 0."""
        with self._lock:
            last = self._by_slot.pop(slot, None)
            if last is not None:
                self._retired = tuple(a + b for a, b in zip(self._retired, last, strict=True))

    def totals(self) -> dict[str, float]:
        """Seconds per stage and elements produced, summed over the worker's executors."""
        with self._lock:
            rows = [self._retired, *self._by_slot.values()]
        sums = [sum(row[i] for row in rows) for i in range(5)]
        result = dict(zip(STAGES, sums[:4], strict=True))
        result["elements"] = sums[4]
        return result
