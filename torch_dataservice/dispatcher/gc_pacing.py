"""Short garbage-collector pauses for a long-lived server with a big heap.

CPython's full collection walks every tracked object while holding the GIL. A dispatcher of a
thousand workers and thousands of readers holds a million objects or more, almost all of them
its state (long-lived), and each full collection stopped every handler for 150 ms: eleven
such pauses in a minute were the p99 of GetSplit (benchmarks/dispatcher_capacity.py, 1,000
workers + 4,096 clients). So after each full collection the survivors are frozen
(`gc.freeze`): later collections walk only what came after them. (Those still take 20-75 ms
there, every 3-10 s: each split in flight keeps two sets for seconds, and they are promoted
in between. Freezing the survivors of every middle-generation collection as well removed
those, but cost a small fleet a fifth of its DYNAMIC throughput, `throughput.py` row (e), in
10 alternated pairs of 11: not kept.)

Frozen objects are still freed by reference counting; only a cycle among them that dies
later waits, until the next sweep (`gc.unfreeze` and a full collection, one long pause) every
`sweep_every_s`. So garbage cycles are bounded by what a server makes in that time, and the
long pauses come once per sweep instead of every few seconds.

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
    """Freeze the survivors of each full collection; sweep everything every `sweep_every_s`."""

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
        # moves the survivors' list, so it costs nothing like the walk just done.
        if phase == "stop" and info["generation"] == 2:
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
