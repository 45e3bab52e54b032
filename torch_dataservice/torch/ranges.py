"""Sets and sequences of epoch positions as half-open ranges `[start, end)`.

A global loader state names the positions of an epoch's order that some rank had yielded. In
the common case (ranks in step, in order) that is one range whatever the epoch's size, so the
state of a million-sample epoch stays a few numbers; out-of-order reads add a few more.

Two shapes, both lists of `(start, end)` pairs:
- a *set*: sorted, disjoint, not touching (`normalized`): what was consumed, what remains;
- a *sequence*: ranges read one after the other, possibly overlapping (a padded remainder
  repeats its first positions): what is dealt out to the ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Range = tuple[int, int]


def normalized(ranges: Iterable[Range]) -> list[Range]:
    """The set covered by `ranges` (any order, overlapping or empty ones allowed)."""
    merged: list[Range] = []
    for start, end in sorted(r for r in ranges if r[0] < r[1]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def from_positions(positions: Iterable[int]) -> list[Range]:
    """The set of `positions` as ranges (runs of consecutive positions become one range)."""
    return normalized((p, p + 1) for p in positions)


def size(ranges: Iterable[Range]) -> int:
    """How many positions a set (or a sequence) holds."""
    return sum(end - start for start, end in ranges)


def complement(ranges: list[Range], length: int) -> list[Range]:
    """The positions of `[0, length)` not in the set `ranges`."""
    out: list[Range] = []
    at = 0
    for start, end in ranges:
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < length:
        out.append((at, length))
    return out


def take(sequence: list[Range], start: int, stop: int) -> list[Range]:
    """Items `start` to `stop - 1` of the sequence, as ranges."""
    out: list[Range] = []
    index = 0  # sequence index of the current range's first item
    for begin, end in sequence:
        count = end - begin
        lo, hi = max(start, index), min(stop, index + count)
        if lo < hi:
            out.append((begin + lo - index, begin + hi - index))
        index += count
        if index >= stop:
            break
    return out


def repeat_to(sequence: list[Range], count: int) -> list[Range]:
    """The first `count` items of the sequence repeated over and over (a padding)."""
    total = size(sequence)
    if count <= 0 or total == 0:
        return []
    out: list[Range] = []
    while count > 0:
        part = take(sequence, 0, min(count, total))
        out += part
        count -= size(part)
    return out


def expand(sequence: list[Range]) -> list[int]:
    """Every position of the sequence, in order (only for what a rank draws anyway)."""
    return [p for start, end in sequence for p in range(start, end)]


def encode(ranges: list[Range]) -> list[list[int]]:
    """Plain JSON: `[[start, end], ...]`."""
    return [[start, end] for start, end in ranges]


def decode(data: Any, length: int, what: str = "consumed_ranges") -> list[Range]:
    """A set of ranges read back, checked to lie in `[0, length)`, sorted and disjoint."""
    if not isinstance(data, list | tuple):
        raise ValueError(f"state {what!r} must be a list of [start, end] ranges, got "
                         f"{data!r:.80}")
    out: list[Range] = []
    for item in data:
        if (not isinstance(item, list | tuple) or len(item) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in item)):
            raise ValueError(f"state {what!r}: {item!r:.80} is not a [start, end] pair of ints")
        start, end = int(item[0]), int(item[1])
        if not 0 <= start < end <= length:
            raise ValueError(f"state {what!r}: range [{start}, {end}) is not within an epoch "
                             f"of {length} positions")
        if out and start <= out[-1][1]:
            raise ValueError(f"state {what!r}: ranges must be sorted and apart, got "
                             f"[{out[-1][0]}, {out[-1][1]}) then [{start}, {end})")
        out.append((start, end))
    return out
