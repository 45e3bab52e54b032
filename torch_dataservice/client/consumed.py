"""What a consumer took of an epoch's DYNAMIC splits, compactly: the base of a resume.

Workers tag each element with (split repetition, split index, offset in the split). A reader
(client/reader.py) and a `tds.DataLoader` (torch/iterable_state.py) record the tags of what
they *yielded* here. A split whose every element was consumed is complete (its element count
comes from the dispatcher, GetSplitSizes); complete splits are kept as index ranges, partly read
ones as a prefix count plus the few offsets beyond it (elements of a split arrive mostly in
order). So a state stays small whatever the epoch's size: a few ranges and one entry per split
in flight, not one entry per sample.

The same structure converts to plain JSON-able data (a loader's state_dict) and to the
`ConsumedSplits` message a resumed job is created with (dispatcher/resume.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch_dataservice.client.delivery import SplitReceived
from torch_dataservice.proto import common_pb2

Key = tuple[int, int]  # (split repetition, split index)


class ConsumedSplits:
    """Per split repetition: the complete split indices and the partly read splits."""

    def __init__(self) -> None:
        self._complete: dict[int, set[int]] = {}
        self._partial: dict[Key, SplitReceived] = {}

    # ------------------------------------------------------------------ recording
    def add(self, repetition: int, index: int, offset: int) -> None:
        """One element consumed (a repeated tag changes nothing)."""
        if index in self._complete.get(repetition, ()):
            return
        received = self._partial.get((repetition, index))
        if received is None:
            received = self._partial[(repetition, index)] = SplitReceived()
        received.add(offset)

    def partial_keys(self) -> list[Key]:
        """The splits read in part (or whole, with their size not yet known)."""
        return sorted(self._partial)

    def complete_with(self, sizes: Mapping[Key, int]) -> None:
        """Mark complete the partly read splits whose every offset below their size (the
        elements the split has) was consumed."""
        for key, size in sizes.items():
            received = self._partial.get(key)
            if received is not None and received.below >= size:
                del self._partial[key]
                self._complete.setdefault(key[0], set()).add(key[1])

    def update(self, other: ConsumedSplits) -> None:
        """Add what `other` consumed (another rank's share of the same epoch)."""
        for repetition, indices in other._complete.items():
            self._complete.setdefault(repetition, set()).update(indices)
            for index in indices:
                self._partial.pop((repetition, index), None)
        for (repetition, index), received in other._partial.items():
            if index in self._complete.get(repetition, ()):
                continue
            for offset in _offsets(received):
                self.add(repetition, index, offset)

    def copy(self) -> ConsumedSplits:
        copied = ConsumedSplits()
        copied.update(self)
        return copied

    def __len__(self) -> int:
        """Splits touched (complete or partly read)."""
        return sum(map(len, self._complete.values())) + len(self._partial)

    # ------------------------------------------------------------------ plain data
    def to_data(self) -> list[dict[str, Any]]:
        """JSON-able: `[{"repetition": r, "complete": [[start, end], ...],
        "partial": [[index, below, [extra offsets]], ...]}, ...]`, sorted."""
        repetitions = sorted(set(self._complete) | {r for r, _ in self._partial})
        data = []
        for repetition in repetitions:
            partial = sorted((i, p) for (r, i), p in self._partial.items() if r == repetition)
            data.append({
                "repetition": repetition,
                "complete": [list(r) for r in _ranges(self._complete.get(repetition, ()))],
                "partial": [[i, p.below, sorted(p.extra or ())] for i, p in partial],
            })
        return data

    @classmethod
    def from_data(cls, data: Any) -> ConsumedSplits:
        """The inverse of `to_data`, with a ValueError naming what is malformed."""
        consumed = cls()
        try:
            for entry in data:
                repetition = _int(entry["repetition"])
                for start, end in entry["complete"]:
                    if _int(end) < _int(start):
                        raise ValueError(f"range [{start}, {end})")
                    consumed._complete.setdefault(repetition, set()).update(range(start, end))
                for index, below, extra in entry["partial"]:
                    for offset in [*range(_int(below)), *map(_int, extra)]:
                        consumed.add(repetition, _int(index), offset)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"state 'consumed' is malformed: {error}") from None
        return consumed

    def to_proto(self) -> common_pb2.ConsumedSplits:
        message = common_pb2.ConsumedSplits()
        for entry in self.to_data():
            repetition = message.repetitions.add(repetition=entry["repetition"])
            for start, end in entry["complete"]:
                repetition.complete.add(start=start, end=end)
            for index, below, extra in entry["partial"]:
                repetition.partial.add(index=index, below=below, extra=extra)
        return message


def _offsets(received: SplitReceived) -> Iterable[int]:
    return [*range(received.below), *(received.extra or ())]


def _ranges(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted indices as [start, end) runs."""
    runs: list[tuple[int, int]] = []
    for index in sorted(indices):
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not an int >= 0")
    return value
