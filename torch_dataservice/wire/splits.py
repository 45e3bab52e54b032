"""The names of a DYNAMIC split inside a worker: one key, one handed-out shape.

The dispatcher's proto message (`common_pb2.SplitKey`) stays at the gRPC boundary; between a
worker's front and its executor processes, in its buffers and in its split order, a split is
this `SplitKey`. It is a NamedTuple, so it compares and hashes as the plain `(repetition,
index)` tuple and pickles almost as cheaply (elements are tagged with it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple


class SplitKey(NamedTuple):
    """A split of a repetition: what a replica's elements are tagged with."""

    repetition: int
    index: int  # type: ignore[assignment]  # the proto's name; hides tuple.index


class HandedSplit(NamedTuple):
    """A split handed to a replica: its key (a requeued split keeps its own, maybe older,
    repetition) and the offsets readers already received of it (a requeue after a death)."""

    key: SplitKey
    skip: tuple[int, ...] = ()


def index_ranges(indices: Iterable[int]) -> list[int]:
    """Indices as ascending disjoint [start, end) pairs, flat: [0, 1, 2, 5] -> [0, 3, 5, 6].
    How a worker's cached splits (HeldSplits.ranges) and a reader's acknowledged offsets
    (ReceivedSplit.offset_ranges) travel compactly. ValueError for a negative index."""
    flat: list[int] = []
    for index in sorted(set(indices)):
        if index < 0:
            raise ValueError(f"split index {index} is negative")
        if flat and flat[-1] == index:
            flat[-1] = index + 1
        else:
            flat += [index, index + 1]
    return flat


def range_indices(ranges: Sequence[int], limit: int) -> tuple[int, ...]:
    """The split indices below `limit` that flat [start, end) pairs name, ascending.
    ValueError unless the pairs are non-empty, ascending and disjoint."""
    if len(ranges) % 2:
        raise ValueError(f"split ranges have an odd length {len(ranges)}: they hold "
                         "[start, end) pairs")
    indices: list[int] = []
    end = 0
    for start, stop in zip(ranges[::2], ranges[1::2], strict=True):
        if not end <= start < stop:
            raise ValueError(f"split range [{start}, {stop}) is empty, negative or not "
                             f"after the previous one (ending at {end})")
        indices.extend(range(start, min(stop, limit)))
        end = stop
    return tuple(indices)
