"""What a running pipeline needs from whoever runs it: where its splits come from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class SplitProvider(Protocol):
    """Hands out the splits of a splittable source (the dispatcher under DYNAMIC sharding)."""

    def get_split(self, source_index: int, repetition: int) -> int | None:
        """Index of the next split of `repetition` of the source, or None when that repetition
        has no more splits."""
        ...


@dataclass
class ExecutionContext:
    """Per-run state shared by every node of one iteration of a chain.

    A worker creates one context per task; local iteration creates a fresh one per `iter()`.
    """

    #: None: sources produce all their elements (local iteration).
    split_provider: SplitProvider | None = None
    #: (source_index, repetition, split_index) of the split a split-driven source is reading, so
    #: the executor can tag output elements with where they came from. Buffering transforms
    #: (shuffle, batch, prefetch, parallel map, interleave) read ahead, so it may be ahead of the
    #: element being emitted.
    current_split: tuple[int, int, int] | None = None
    #: How many times each source (by source_index) has started iterating under this context;
    #: the i-th iteration of a source is its repetition i.
    source_iterations: dict[int, int] = field(default_factory=dict)
    #: The directory `cache()` without a location keeps its entries in: a worker's, in shared
    #: memory, which its executor processes share. None: this process's memory (local runs).
    cache_dir: str | None = None
    #: Told (directory, fingerprint) by a `cache()` that reads and writes entries split by
    #: split, so a worker knows which splits it holds (worker/cache_index.py).
    cache_used: Callable[[str, str], None] | None = None

    def next_repetition(self, source_index: int) -> int:
        """Claim the repetition number for a source that is starting a new pass."""
        repetition = self.source_iterations.get(source_index, 0)
        self.source_iterations[source_index] = repetition + 1
        return repetition
