"""The names of a DYNAMIC split inside a worker: one key, one handed-out shape.

The dispatcher's proto message (`common_pb2.SplitKey`) stays at the gRPC boundary; between a
worker's front and its executor processes, in its buffers and in its split order, a split is
this `SplitKey`. It is a NamedTuple, so it compares and hashes as the plain `(repetition,
index)` tuple and pickles almost as cheaply (elements are tagged with it).
"""

from __future__ import annotations

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
