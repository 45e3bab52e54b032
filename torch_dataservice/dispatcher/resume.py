"""DYNAMIC resume: a job that starts where a trainer's checkpoint left an epoch. Pure.

A job created with `JobConfig.resume` (a `ConsumedSplits`: per split repetition, ranges of
splits read whole and, for partly read ones, the offsets read) hands out only the remainder of
the epoch: the split cursor steps over the complete splits, and a partly read split is handed
with its consumed offsets as already delivered, so the replica skips them exactly as it skips
what clients received of a requeued split (dispatcher/splits.py). The description travels in
the job's config, so the journal's CreateJob record (and a snapshot's job) carries it across a
dispatcher restart with nothing else to persist.

It is what the trainer had *yielded* when the loader's state was taken (torch/iterable_state.py
builds it), never how far the service had produced: the service may have run far ahead.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.proto import common_pb2, dispatcher_pb2


def _repetition(config: common_pb2.JobConfig,
                repetition: int) -> common_pb2.ConsumedRepetition | None:
    if not config.HasField("resume"):
        return None
    for consumed in config.resume.repetitions:
        if consumed.repetition == repetition:
            return consumed
    return None


def first_unconsumed(config: common_pb2.JobConfig, repetition: int, index: int) -> int:
    """The first split index >= `index` of `repetition` not read whole before the resume (it
    may be past the last split: the cursor then reports the end of the splits)."""
    consumed = _repetition(config, repetition)
    if consumed is None:
        return index
    starts = [r.start for r in consumed.complete]
    i = bisect.bisect_right(starts, index) - 1
    if i >= 0 and index < consumed.complete[i].end:
        return consumed.complete[i].end
    return index


def consumed_offsets(config: common_pb2.JobConfig, repetition: int, index: int) -> set[int]:
    """The offsets of split (`repetition`, `index`) read before the resume: they count as
    delivered, so the worker skips them and the split settles without them."""
    consumed = _repetition(config, repetition)
    if consumed is None:
        return set()
    for partial in consumed.partial:
        if partial.index == index:
            return set(range(partial.below)) | set(partial.extra)
    return set()


# The offsets of a partly read split become a set when it is handed (as a requeued split's
# delivered offsets): a description naming more is refused rather than exhausting memory.
MAX_PARTIAL_OFFSETS = 1 << 24


def check(config: common_pb2.JobConfig, dataset: common_pb2.DatasetDef) -> None:
    """A resume description is for DYNAMIC jobs over a splittable dataset, well formed:
    ascending disjoint ranges within the splits, partial splits outside
    them. Raises ValueError (INVALID_ARGUMENT) naming the problem."""
    if not config.HasField("resume"):
        return
    if config.sharding_policy != ShardingPolicy.DYNAMIC or not dataset.splittable:
        raise ValueError("a job resumed from consumed splits must use sharding policy DYNAMIC "
                         "over a splittable dataset")
    num_splits = dataset.num_splits
    seen: set[int] = set()
    for consumed in config.resume.repetitions:
        if consumed.repetition < 0 or consumed.repetition in seen:
            raise ValueError(f"resume: repetition {consumed.repetition} is negative or repeated")
        seen.add(consumed.repetition)
        end = 0
        for r in consumed.complete:
            if not end <= r.start < r.end <= num_splits:
                raise ValueError(f"resume: split range [{r.start}, {r.end}) of repetition "
                                 f"{consumed.repetition} is not ascending within "
                                 f"{num_splits} splits")
            end = r.end
        for partial in consumed.partial:
            if (not 0 <= partial.index < num_splits or partial.below < 0
                    or first_unconsumed(config, consumed.repetition, partial.index)
                    != partial.index or any(o <= partial.below for o in partial.extra)
                    or partial.below + len(partial.extra) > MAX_PARTIAL_OFFSETS):
                raise ValueError(f"resume: partly read split {partial.index} of repetition "
                                 f"{consumed.repetition} is malformed")


def split_sizes(sizes: Mapping[tuple[int, int], int],
                keys: Iterable[common_pb2.SplitKey]) -> dispatcher_pb2.GetSplitSizesResponse:
    """The known element counts among `keys` (GetSplitSizes)."""
    reply = dispatcher_pb2.GetSplitSizesResponse()
    for key in keys:
        size = sizes.get((key.repetition, key.index))
        if size is not None:
            reply.sizes.add(split=key, num_elements=size)
    return reply
