"""Split affinity under DYNAMIC sharding: a split goes preferably to a worker that holds it
cached (`Pipeline.cache()`), so the next epoch reads it back instead of computing it again.

Workers report, in their heartbeats, the splits whose cache entries are complete on them
(WorkerHeartbeatRequest.held: ranges of split indices per dataset, the whole set, sent only
when it changed: a version number says whether the dispatcher has it). This is soft state: a
dispatcher restart forgets it and the next heartbeats bring it back; a worker removed (dead,
drained, restarted) takes its set with it, and its splits go to whoever asks.

Which split a worker asking for one gets, in the cursor's repetition, once requeued splits
are served (they keep priority, dispatcher/splits.py):
  1. the lowest split it holds that is not handed yet;
  2. else the lowest split nobody holds (others keep theirs for when they ask);
  3. else the cursor's next split: held elsewhere, but a worker never waits while cached
     splits queue on another.
A split other than the cursor's next is journaled as handed ahead (ProduceSplit.ahead,
dispatcher/state.py), which keeps exactly-once, requeue, resume and the epoch's end as they
are: a handed split is handed whatever its order. Coordinated reads, and an iteration with
one task (one worker takes every split anyway), keep the cursor's order.

Cost: with no report for the dataset, one dict lookup per split; otherwise scans resume where
the last one stopped (everything before is handed, and stays so within a repetition), so a
split costs O(1) amortized. The scan positions are hints, dropped when reports shrink.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from torch_dataservice.dispatcher import resume
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import DispatcherState, Iteration
from torch_dataservice.proto import common_pb2, dispatcher_pb2
from torch_dataservice.wire.splits import range_indices

MAX_SCAN_HINTS = 4096  # scan positions kept before they are dropped (hints: recomputed)


def note_report(state: DispatcherState, soft: SoftState, address: str,
                request: dispatcher_pb2.WorkerHeartbeatRequest) -> int:
    """Record a worker's held splits if its heartbeat carries them; the version of them the
    dispatcher has now (the reply's held_version: the worker resends while they differ).
    ValueError for malformed ranges, before anything changes."""
    if request.held_report:
        held = {}
        for report in request.held:
            dataset = state.datasets.get(report.dataset_id)
            limit = dataset.definition.num_splits if dataset is not None else 0
            indices = range_indices(report.ranges, limit)
            if indices:  # a dataset no longer registered holds nothing to hand
                held[report.dataset_id] = indices
        _replace(soft, address, held)
        soft.held_version[address] = request.held_version
    return soft.held_version.get(address, 0)


def forget_worker(soft: SoftState, address: str) -> None:
    """A worker left: what it holds is gone with it."""
    _replace(soft, address, {})
    soft.held_version.pop(address, None)


def held_count(soft: SoftState, address: str) -> int:
    """How many splits (over every dataset) `address` reported it holds."""
    return sum(len(indices) for indices in soft.held.get(address, {}).values())


def _replace(soft: SoftState, address: str, held: dict[str, tuple[int, ...]]) -> None:
    old = soft.held.pop(address, {})
    if held:
        soft.held[address] = held
    shrunk = False
    for dataset_id in old.keys() | held.keys():
        before, after = set(old.get(dataset_id, ())), set(held.get(dataset_id, ()))
        counts = soft.holders.setdefault(dataset_id, {})
        for index in after - before:
            counts[index] = counts.get(index, 0) + 1
        for index in before - after:
            shrunk = True
            counts[index] -= 1
            if not counts[index]:
                del counts[index]
        if not counts:
            del soft.holders[dataset_id]
    if shrunk:  # a split nobody holds any more may lie behind where a scan stopped
        soft.unheld_scan.clear()
    for key in [k for k in soft.held_scan if k[2] == address]:
        del soft.held_scan[key]


def choose(soft: SoftState, config: common_pb2.JobConfig, iteration: Iteration,
           repetition: int, address: str, cursor_next: int, num_splits: int) -> int:
    """The split of `repetition` (the cursor's, whose next split is `cursor_next` <
    `num_splits`) for the worker at `address` (see the module docstring)."""
    holders = soft.holders.get(config.dataset_id)
    if not holders or config.HasField("num_consumers"):
        return cursor_next  # the common case: nobody reports anything

    resumed = config.HasField("resume")

    def free(index: int) -> bool:
        return (index >= cursor_next and index not in iteration.ahead
                and (not resumed or resume.first_unconsumed(config, repetition, index) == index))

    if len(soft.held_scan) + len(soft.unheld_scan) > MAX_SCAN_HINTS:
        soft.held_scan.clear()
        soft.unheld_scan.clear()
    mine = soft.held.get(address, {}).get(config.dataset_id)
    if mine:
        key = (iteration.iteration_id, repetition, address)
        seen, start = soft.held_scan.get(key, (mine, 0))
        position = _scan(mine, max(start if seen is mine else 0,
                                   bisect.bisect_left(mine, cursor_next)), free)
        soft.held_scan[key] = (mine, position)
        if position < len(mine):
            return mine[position]
    key2 = (iteration.iteration_id, repetition)
    index = max(cursor_next, soft.unheld_scan.get(key2, 0))
    while index < num_splits and (index in holders or not free(index)):
        index += 1
    soft.unheld_scan[key2] = index
    return index if index < num_splits else cursor_next


def _scan(indices: tuple[int, ...], start: int, free: Callable[[int], bool]) -> int:
    """The position of the first free index from `start` on (len(indices) if none)."""
    position = start
    while position < len(indices) and not free(indices[position]):
        position += 1
    return position
