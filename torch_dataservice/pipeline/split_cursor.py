"""The split cursor: which split of which repetition comes next.

One pure helper used by the dispatcher's DYNAMIC cursor semantics and by a worker that
divides a whole dataset among its executor processes (OFF): a request for an older
repetition than the cursor's gets nothing (that pass is drained), a newer one starts it.
"""

from __future__ import annotations

import threading


def next_split(
    cursor: tuple[int, int], repetition: int, num_splits: int
) -> tuple[int | None, tuple[int, int]]:
    """(split index or None for end of splits, new cursor) for a request of `repetition`."""
    cursor_repetition, index = cursor
    if repetition < cursor_repetition:
        return None, cursor
    if repetition > cursor_repetition:
        index = 0
    if index >= num_splits:
        return None, (repetition + 1, 0)
    return index, (repetition, index + 1)


class LocalSplitCursor:
    """Thread-safe cursor over one task's splits, served by the worker itself."""

    def __init__(self, num_splits: int) -> None:
        self._num_splits = num_splits
        self._cursor = (0, 0)
        self._lock = threading.Lock()

    def next(self, repetition: int) -> int | None:
        with self._lock:
            split, self._cursor = next_split(self._cursor, repetition, self._num_splits)
            return split
