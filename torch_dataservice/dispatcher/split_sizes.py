"""SplitSizes: the element count of every split produced in an iteration, held as runs.

A DYNAMIC iteration keeps each produced split's count after it settles (GetSplitSizes: a
loader's state names the splits its trainer read whole). Kept as a dict, that grew by one entry
per split for the whole epoch: 2,000 splits a second at 1,000 workers made a state of hundreds
of thousands of entries within minutes, which every compaction copied under the dispatcher's
lock (60 ms at 200,000) and turned into a snapshot (1.2 s of a core, holding the GIL). Splits
are handed out in index order and most have the same count, so runs of consecutive indexes
with one count describe an epoch in a handful of entries, whatever its length.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping

Key = tuple[int, int]  # (repetition, split index)


class SplitSizes(Mapping[Key, int]):
    """(repetition, index) -> element count, stored as sorted runs [first, end) of one count.

    Setting a key costs O(log runs) plus a list insert or delete when a run starts or ends
    (C memmove over the runs of its repetition, which merge again as gaps fill).
    """

    def __init__(self, items: Mapping[Key, int] | None = None) -> None:
        # repetition -> (run starts, runs [first, end, count]) in index order, disjoint
        self._repetitions: dict[int, tuple[list[int], list[list[int]]]] = {}
        self._len = 0
        for key, count in (items or {}).items():
            self[key] = count

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Key]:
        for repetition, first, end, _ in self.runs():
            for index in range(first, end):
                yield repetition, index

    def __getitem__(self, key: Key) -> int:
        run = self._run_of(key)
        if run is None:
            raise KeyError(key)
        return run[2]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self._run_of(key) is not None

    def __repr__(self) -> str:
        return f"SplitSizes(runs={list(self.runs())})"

    def runs(self) -> Iterator[tuple[int, int, int, int]]:
        """(repetition, first index, end index, count) per run, in order."""
        for repetition in sorted(self._repetitions):
            for first, end, count in self._repetitions[repetition][1]:
                yield repetition, first, end, count

    def add_run(self, repetition: int, first: int, end: int, count: int) -> None:
        """Every index in [first, end) has `count` elements (a snapshot's run): appended as it
        is past the last run, index by index otherwise."""
        starts, runs = self._repetitions.setdefault(repetition, ([], []))
        if runs and first < runs[-1][1]:
            for index in range(first, end):
                self[repetition, index] = count
            return
        if first >= end:
            return
        if runs and runs[-1][1] == first and runs[-1][2] == count:
            runs[-1][1] = end
        else:
            starts.append(first)
            runs.append([first, end, count])
        self._len += end - first

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SplitSizes):  # runs are canonical: neighbours never share a count
            return list(self.runs()) == list(other.runs())
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def clear(self) -> None:
        self._repetitions.clear()
        self._len = 0

    def copy(self) -> SplitSizes:
        """An independent copy (runs copied, not shared)."""
        copied = SplitSizes()
        copied._repetitions = {repetition: (list(starts), [list(run) for run in runs])
                               for repetition, (starts, runs) in self._repetitions.items()}
        copied._len = self._len
        return copied

    def __setitem__(self, key: Key, count: int) -> None:
        repetition, index = key
        starts, runs = self._repetitions.setdefault(repetition, ([], []))
        at = bisect.bisect_right(starts, index) - 1  # the run starting at or before index
        if at >= 0 and index < runs[at][1]:
            if runs[at][2] == count:
                return
            self._cut(starts, runs, at, index)
            at = bisect.bisect_right(starts, index) - 1
        after = at + 1
        joins_before = at >= 0 and runs[at][1] == index and runs[at][2] == count
        joins_after = (after < len(runs) and runs[after][0] == index + 1
                       and runs[after][2] == count)
        if joins_before and joins_after:
            runs[at][1] = runs[after][1]
            del starts[after], runs[after]
        elif joins_before:
            runs[at][1] = index + 1
        elif joins_after:
            runs[after][0] = starts[after] = index
        else:
            starts.insert(after, index)
            runs.insert(after, [index, index + 1, count])
        self._len += 1

    def _run_of(self, key: Key) -> list[int] | None:
        entry = self._repetitions.get(key[0])
        if entry is None:
            return None
        starts, runs = entry
        at = bisect.bisect_right(starts, key[1]) - 1
        return runs[at] if at >= 0 and key[1] < runs[at][1] else None

    def _cut(self, starts: list[int], runs: list[list[int]], at: int, index: int) -> None:
        """Take `index` out of run `at` (its count changes): up to two runs remain."""
        first, end, count = runs[at]
        pieces = [[a, b, count] for a, b in ((first, index), (index + 1, end)) if a < b]
        starts[at:at + 1] = [piece[0] for piece in pieces]
        runs[at:at + 1] = pieces
        self._len -= 1
