"""Short garbage-collector pauses for a long-lived server with a big heap.

CPython's full collection walks every tracked object in the old generation while holding the
GIL. A dispatcher of a thousand workers and thousands of readers holds a million objects or
more, almost all of them its state (long-lived), and each full collection stopped every
handler for 150 ms: eleven such pauses in a minute were the p99 of GetSplit
(benchmarks/dispatcher_capacity.py, 1,000 workers + 4,096 clients). Freezing (`gc.freeze`)
the survivors of each full collection left the objects promoted in between: the bookkeeping
of every split in flight (two sets each, alive for seconds) made 36,000-49,000 of them every
5-10 s, and each full collection still took 20-75 ms, one of the slowest GetSplits each time.
So the survivors of every collection of the middle generation are frozen as they are
promoted: the old generation stays empty, and CPython starts no full collection of its own
(freezing starts its counts again), so the sweep below is the only one.

Frozen objects are still freed by reference counting; only a cycle among them that dies
later waits, until the next sweep (`gc.unfreeze` and a full collection, one long pause) every
`sweep_every_s`. So garbage cycles are bounded by what a server makes in that time (the
dispatcher makes almost none: 88 objects in 15 s under `gc.DEBUG_SAVEALL` at that size), and
the long pauses come once per sweep instead of every few seconds.

Only for a process that is the server (the CLI's dispatcher): in a user's process the heap
and its collector are the user's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 600.0
_installed: GcPacing | None = None  # set while this process paces its collector


@contextlib.contextmanager
def bulk() -> Iterator[None]:
    """Around code that makes many long-lived objects at once (a compaction's copy of the
    state, with containers of tens of thousands of entries): no collection inside (each
    would walk what is being made), and what was made is frozen after, so that no young
    collection walks it either (10-26 ms each at 1,000 workers + 4,096 readers, in
    whichever handler allocated next). Only while a GcPacing is installed (this process is
    the server); elsewhere a no-op: the collector is the user's."""
    if _installed is None or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


class GcPacing:
    """Freeze the survivors of each collection of the older generations; sweep everything
    every `sweep_every_s`."""

    def __init__(self, sweep_every_s: float = SWEEP_EVERY_S) -> None:
        if not sweep_every_s > 0:
            raise ValueError(f"sweep_every_s must be > 0, got {sweep_every_s!r}")
        self.sweep_every_s = sweep_every_s
        self.freezes = 0
        self.sweeps = 0
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def install(self) -> GcPacing:
        global _installed
        _installed = self
        gc.callbacks.append(self._on_collection)
        self._sweeper = threading.Thread(target=self._sweep_loop, name="gc-sweep", daemon=True)
        self._sweeper.start()
        return self

    def uninstall(self) -> None:
        global _installed
        _installed = None
        self._stop.set()
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
        gc.unfreeze()

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # Runs on whichever thread collected, at the end of the collection: freezing only
        # moves the survivors' list, so it costs nothing like the walk just done. After a
        # collection of generation 1 or 2 the younger ones are empty: what is frozen is what
        # just survived it.
        if phase == "stop" and info["generation"] >= 1:
            gc.freeze()
            self.freezes += 1

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.sweep_every_s):
            self.sweep()

    def sweep(self) -> float:
        """Collect everything, the frozen objects too (then freeze the survivors again):
        seconds taken."""
        start = time.perf_counter()
        gc.unfreeze()
        gc.collect()  # its "stop" callback freezes what survived
        took = time.perf_counter() - start
        self.sweeps += 1
        logger.debug("full garbage collection took %.0f ms, %d objects now frozen",
                     took * 1000, gc.get_freeze_count())
        return took
