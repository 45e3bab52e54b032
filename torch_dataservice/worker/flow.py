"""Flow control between a task's buffer and its replicas, paid per batch of elements.

Credits: every element a reader takes returns a credit to the replica that made it. Sent one
message per fetch, a slow pipeline (one element per fetch) would cost a message and a wake-up
of the executor per element; `CreditLedger` keeps them until a replica has `batch` of them (or
`batch_bytes` worth), and sends at once to a replica that said it is blocked (the `Blocked`
message of worker/messages.py): a replica that runs out is never kept waiting, so batching
cannot deadlock, and the bound on what a replica has in flight is the same.

Lingering: a fetch that found fewer elements than it may take waits a few milliseconds more
when elements arrive steadily (`Arrivals`), so replies carry several elements and the per-reply
costs (the RPC, the header, a credit) are shared; a pipeline too slow to add an element in that
time is not delayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CREDIT_BATCH = 32  # credits a replica is sent at once (unless it is blocked)
CREDIT_BATCH_BYTES = 8 << 20  # ... or once its elements taken add up to this many bytes
LINGER_S = 0.005  # at most this long a fetch waits for more elements after the first
LINGER_ELEMENTS = 16  # ... or until this many are buffered


@dataclass
class CreditLedger:
    """Credits owed to each replica of a task. Not thread-safe: the task's lock guards it."""

    batch: int = field(default_factory=lambda: CREDIT_BATCH)
    batch_bytes: int = field(default_factory=lambda: CREDIT_BATCH_BYTES)
    _owed: dict[int, int] = field(default_factory=dict)
    _owed_bytes: dict[int, int] = field(default_factory=dict)
    _blocked: set[int] = field(default_factory=set)

    def taken(self, replica: int, size: int) -> None:
        """A reader took an element of `replica` of `size` bytes."""
        self._owed[replica] = self._owed.get(replica, 0) + 1
        self._owed_bytes[replica] = self._owed_bytes.get(replica, 0) + size

    def due(self) -> list[tuple[int, int]]:
        """(replica, credits) to send now; forgotten here once returned."""
        due = [(replica, n) for replica, n in self._owed.items()
               if n >= self.batch or self._owed_bytes[replica] >= self.batch_bytes
               or replica in self._blocked]
        for replica, _ in due:
            self._forget(replica)
        return due

    def blocked(self, replica: int) -> int:
        """`replica` waits for credits: what it is owed, to send now, or 0 (then it is sent
        its next credit at once)."""
        n = self._owed.get(replica, 0)
        if n:
            self._forget(replica)
        else:
            self._blocked.add(replica)
        return n

    def ended(self, replica: int) -> None:
        """`replica` makes nothing more: it needs no credits."""
        self._forget(replica)

    def _forget(self, replica: int) -> None:
        self._owed.pop(replica, None)
        self._owed_bytes.pop(replica, None)
        self._blocked.discard(replica)


@dataclass
class Arrivals:
    """How steadily elements reach a task's buffer (moving average of the interval)."""

    interval_s: float | None = None
    last: float | None = None

    def note(self, now: float) -> None:
        if self.last is not None:
            sample = now - self.last
            self.interval_s = sample if self.interval_s is None else (
                self.interval_s + 0.2 * (sample - self.interval_s))
        self.last = now

    def steady(self) -> bool:
        """Elements come fast enough for a linger to gather more than one."""
        return self.interval_s is not None and self.interval_s < LINGER_S
