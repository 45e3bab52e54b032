"""How a map-style epoch's global order is dealt out to the ranks, whole or what remains of it.

Every rank draws the epoch's global order alike (a permutation of the samples, or a user
sampler's batches) and keeps its part, without talking. The part is DistributedSampler's
layout: the positions still to yield (all of them, or those no rank had yielded when a
resumed state was saved), cut or padded to a multiple of the world size as `even_batches`
says, then item i of that sequence to rank i % world_size. A fresh epoch dealt this way is
exactly `DistributedSampler(drop_last=True)` (or `drop_last=False` for "pad"); a resumed
epoch is the same rule applied to the remainder, so it works at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch_dataservice.torch import ranges
from torch_dataservice.torch.ranges import Range

DROP, PAD, UNEVEN = "drop", "pad", "uneven"


def even_policy(value: Any) -> str:
    """`even_batches` as one of DROP, PAD, UNEVEN (True is "drop", False "uneven")."""
    if value is True or (isinstance(value, str) and value == DROP):
        return DROP
    if isinstance(value, str) and value == PAD:
        return PAD
    if value is False:
        return UNEVEN
    raise ValueError(f"even_batches must be True, 'drop', 'pad' or False, got {value!r}")


@dataclass(frozen=True)
class Deal:
    """One epoch's global order of `length` positions dealt to `world_size` ranks, without the
    positions in `consumed` (a set of ranges: what a resumed state had yielded)."""

    length: int
    world_size: int
    policy: str
    consumed: tuple[Range, ...] = ()

    @cached_property
    def remaining(self) -> int:
        return self.length - ranges.size(self.consumed)

    @cached_property
    def sequence(self) -> list[Range]:
        """The positions dealt out, in dealing order (a padded one repeats its start)."""
        left = ranges.complement(list(self.consumed), self.length)
        world, count = self.world_size, self.remaining
        if world == 1 or self.policy == UNEVEN or count % world == 0:
            return left
        if self.policy == DROP:
            return ranges.take(left, 0, count - count % world)
        return left + ranges.repeat_to(left, world - count % world)

    @cached_property
    def dealt(self) -> int:
        return ranges.size(self.sequence)

    @property
    def dropped(self) -> int:
        """Positions left out so that every rank gets as many ("drop")."""
        return max(0, self.remaining - self.dealt)

    @property
    def padded(self) -> int:
        """Positions given twice so that every rank gets as many ("pad")."""
        return max(0, self.dealt - self.remaining)

    def count(self, rank: int) -> int:
        """How many positions rank `rank` gets."""
        return len(range(rank, self.dealt, self.world_size))

    def positions(self, rank: int) -> list[int]:
        """Rank `rank`'s positions of the global order, in the order it yields them."""
        return ranges.expand(self.sequence)[rank::self.world_size]

    def sequence_positions(self, indices: list[Range]) -> list[Range]:
        """The positions at the given ranges of sequence indices (what ranks yielded), as a set."""
        found: list[Range] = []
        for start, stop in indices:
            found += ranges.take(self.sequence, start, stop)
        return ranges.normalized(found)


def batch_count(entries: int, batch_size: int | None, drop_last: bool) -> int:
    """How many batches `entries` positions make (a user's batches: one per position)."""
    if batch_size is None:
        return entries
    return entries // batch_size if drop_last else -(-entries // batch_size)
