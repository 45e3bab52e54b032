"""DYNAMIC split hand-out and requeue: decisions over the state and the soft state.

They return `Update`s and never change the state; `end_held` records in the soft state since
when an iteration's end is held, `requeue_ready` that a requeue's wait is over.

Visitation under DYNAMIC sharding: every element of an epoch is delivered exactly once, even
when workers die, the dispatcher restarts or an idle iteration is collected and recreated,
provided that
  - the pipeline is deterministic per split (the same split yields the same elements in the
    same order on any worker) and every output element comes from exactly one split through
    a synchronous chain: map, filter, flat_map (and take/skip-free element-wise steps);
    shuffle, batch, prefetch, parallel map and interleave read ahead or mix splits, so the
    (split, offset) tag of an element is not exact there and the guarantee falls back to
    tf.data service's at-most-once for the splits a dead worker held;
  - every client of the iteration reports within worker_timeout_ms of a requeue (see below).
A worker declared dead (silent for worker_timeout_ms, or re-registered with a new uid) may be
a zombie (a long pause, a healed partition) that still serves what it buffered: its tasks are
listed as lost to every client, which fences them (accepts nothing from them any more) and
acknowledges it; the lost worker's splits are handed again only once every client fenced its
tasks, so what a zombie delivers is either reported before the requeue is handed (and
skipped) or dropped. A zombie that registers again is told to delete its lost tasks.
How: workers tag each element with (split repetition, split index, offset in the split) and
report each split's element count when they finish producing it; clients report the offsets
they received in their heartbeats; a split is settled when all its offsets were received.
When a worker leaves, each split it held and that is not settled goes back to its iteration
(RequeueSplit) with the offsets already delivered; it is handed again, once every client of
the iteration has heartbeated since (so their reports are in), to a live task, whose replica
skips those offsets. Any task takes it, whatever repetition it asks for (under `repeat()` every
live task may have moved past the split's repetition): the reply carries the split's own
repetition and the replica tags the elements with it, so the split keeps its key. If no
unfinished task of the iteration is left on a live worker (now, or when the last one
finishes), one is created on every live worker.
The wait for clients' reports and fences is bounded by worker_timeout_ms after the requeue
(and a client silent that long is not waited for): after that the split is handed with the
offsets known.
Trade-off: an element a slow client received from the dead worker and had not reported yet is
produced again; that client drops it (it remembers what it received), but in a job shared by
several clients another one may receive it too. Waiting longer (up to job_gc_timeout_ms, when a
silent client is released) would hold the whole epoch's end for a trainer that may be gone.
GetSplit is idempotent per (task, replica, request id), so a reply lost to a dispatcher crash
does not lose a split.
A job created with `JobConfig.resume` (a trainer's checkpoint, dispatcher/resume.py) starts
with what was consumed before: the cursor steps over the splits read whole, and a partly read
split starts with its consumed offsets as delivered, handed and skipped as a requeued one.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch_dataservice.dispatcher import affinity, resume
from torch_dataservice.dispatcher.soft import RequeueScan, SoftState
from torch_dataservice.dispatcher.state import DispatcherState, Iteration, Task
from torch_dataservice.errors import NotReadyError
from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.proto import common_pb2, dispatcher_pb2

Update = dispatcher_pb2.Update
MAX_SPLITS_PER_REQUEST = 64  # GetSplit.max_splits is capped: one request holds the lock briefly


def requeue_ready(state: DispatcherState, soft: SoftState, iteration: Iteration, now: float,
                  worker_timeout_s: float) -> bool:
    """Every client of `iteration` reported what it received since the last requeue and
    fenced every lost task, or worker_timeout_ms passed since the requeue (see the module
    docstring for the trade-off).

    A client silent for longer than worker_timeout_ms is not waited for (it may be a trainer
    that died, or one that never heartbeated): it cannot report anything new. Asked per split
    handed while the requeue waits, so the clients are scanned once per requeue, not per call:
    the scan resumes at the client it last waited for (a client that reported stays so until
    the next requeue, which starts a new scan), and those who joined meanwhile are added at
    its end.
    """
    iteration_id = iteration.iteration_id
    since = soft.requeued_at.get(iteration_id)
    if since is None or iteration_id in soft.requeue_ready:
        return True
    if now - soft.requeued_time.get(iteration_id, now) > worker_timeout_s:
        soft.requeue_ready.add(iteration_id)
        soft.requeue_scan.pop(iteration_id, None)
        return True
    scan = soft.requeue_scan.get(iteration_id)
    if scan is None or scan.since != since:
        scan = soft.requeue_scan[iteration_id] = RequeueScan(
            since, list(iteration.client_ids), lost_tasks(state, iteration))
    while True:
        while scan.position < len(scan.clients):
            client = scan.clients[scan.position]
            reported = (soft.client_heartbeat.get(client, 0) > since
                        and scan.lost <= soft.client_fenced.get(client, frozenset()))
            if (not reported and client in iteration.client_ids
                    and now - soft.client_seen.get(client, now) <= worker_timeout_s):
                return False
            scan.position += 1
        joined = iteration.client_ids - set(scan.clients)
        if not joined:
            break
        scan.clients += sorted(joined)
    soft.requeue_ready.add(iteration_id)  # until the next requeue (SoftState.note_requeue)
    del soft.requeue_scan[iteration_id]
    return True


def lost_tasks(state: DispatcherState, iteration: Iteration) -> frozenset[int]:
    return frozenset(t.task_id for t in state.iteration_tasks(iteration) if t.lost)


def is_exactly_once(state: DispatcherState, iteration: Iteration) -> bool:
    """DYNAMIC without coordinated reads: the splits' elements are tracked per offset."""
    config = state.job(iteration.job_id).config
    return (config.sharding_policy == ShardingPolicy.DYNAMIC
            and not config.HasField("num_consumers"))


def end_held(state: DispatcherState, soft: SoftState, iteration: Iteration, now: float,
             worker_timeout_s: float) -> bool:
    """Whether clients of `iteration` are not told yet that it finished although its tasks
    ran to their end: elements of it were received and not acknowledged (splits not settled)
    and several clients read it. One of them may have died holding those elements; told
    "finished", the others would leave before it is declared silent and what it held is
    requeued (lost). So the end waits until every split is settled (clients acknowledge as
    their consumers take: within a heartbeat or two of draining their buffers), or the holder
    is declared silent and its splits requeued (the iteration is then not finished), at most
    twice worker_timeout_ms: a live client that holds elements and does not consume them
    keeps them, and the others end then. Records (or forgets) in soft.end_unsettled_since
    since when the end is held."""
    if (len(iteration.client_ids) < 2 or not iteration.delivered
            or not is_exactly_once(state, iteration)):
        soft.end_unsettled_since.pop(iteration.iteration_id, None)
        return False
    since = soft.end_unsettled_since.setdefault(iteration.iteration_id, now)
    return now - since < 2 * worker_timeout_s


def next_split(state: DispatcherState, soft: SoftState, iteration: Iteration, repetition: int,
               task: Task, now: float,
               worker_timeout_s: float) -> dispatcher_pb2.ProduceSplit | None:
    """The next split for `task` in `repetition`: a requeued one first (oldest first, of any
    repetition: see the module docstring), then the cursor's, or one the task's worker holds
    cached (dispatcher/affinity.py: handed ahead of the cursor). At the end of the splits:
    None, or a record with split_index -1 when the cursor moves to `repetition`.

    Raises NotReadyError (UNAVAILABLE: the worker retries) when only requeued splits are left
    and clients have not yet reported what they received of them.
    """
    waiting = False
    if iteration.requeued:
        if requeue_ready(state, soft, iteration, now, worker_timeout_s):
            split = min(iteration.requeued, key=lambda s: (s.repetition, s.index))
            return dispatcher_pb2.ProduceSplit(
                iteration_id=iteration.iteration_id, repetition=split.repetition,
                split_index=split.index, task_id=task.task_id, requeued=True)
        waiting = True
    if repetition < iteration.cursor_repetition:
        if waiting:
            raise _not_ready(iteration)
        return None
    index = iteration.cursor_index if repetition == iteration.cursor_repetition else 0
    # A resumed job skips the splits its trainer read whole before (dispatcher/resume.py).
    config = state.job(iteration.job_id).config
    index = resume.first_unconsumed(config, repetition, index)
    total = num_splits(state, iteration)
    if index >= total:
        if waiting:
            raise _not_ready(iteration)
        index = -1
    elif repetition == iteration.cursor_repetition and len(iteration.task_ids) > 1:
        # A split the worker holds cached first (a lone task takes all, in order).
        chosen = affinity.choose(soft, config, iteration, repetition, task.worker_address,
                                 index, total)
        if chosen != index:
            return dispatcher_pb2.ProduceSplit(
                iteration_id=iteration.iteration_id, repetition=repetition,
                task_id=task.task_id, split_index=chosen, ahead=True)
    return dispatcher_pb2.ProduceSplit(iteration_id=iteration.iteration_id,
                                       repetition=repetition, task_id=task.task_id,
                                       split_index=index)


def _not_ready(iteration: Iteration) -> NotReadyError:
    """Built only when raised: next_split runs once per split handed."""
    return NotReadyError(
        f"iteration {iteration.iteration_id}: splits of a lost worker wait for clients to "
        "report what they received; retry")


def num_splits(state: DispatcherState, iteration: Iteration) -> int:
    job = state.job(iteration.job_id)
    return state.dataset(job.config.dataset_id).definition.num_splits


def split_response(iteration: Iteration,
                   keys: tuple[tuple[int, int], ...]) -> dispatcher_pb2.GetSplitResponse:
    """The answer for the splits handed out, the same for a retried GetSplit."""
    granted = []
    for repetition, index in keys:
        if index < 0:
            break
        offsets = sorted(iteration.delivered.get((repetition, index), ()))
        granted.append(dispatcher_pb2.GetSplitResponse(
            split_index=index, skip=len(offsets), skip_offsets=offsets, repetition=repetition))
    if not granted:
        return dispatcher_pb2.GetSplitResponse(end_of_splits=True)
    first, *following = granted
    first.following.extend(following)
    return first


def produced(iteration: Iteration, task: Task,
             finished_splits: Iterable[dispatcher_pb2.FinishedSplit]) -> list[Update]:
    """Record the element counts a worker reports for splits it finished producing."""
    return [Update(split_produced=dispatcher_pb2.SplitProduced(
                iteration_id=iteration.iteration_id, task_id=task.task_id,
                split=finished.split, num_elements=finished.elements))
            for finished in finished_splits
            if _key(finished.split) in iteration.delivered
            and _key(finished.split) not in iteration.produced]


def delivered(iteration: Iteration,
              received: Iterable[dispatcher_pb2.ReceivedSplit]) -> Update | None:
    """Record the offsets a client reports received, for splits that are still tracked."""
    for report in received:
        check_ranges(report)
    untracked = [r for r in received if _key(r.split) not in iteration.delivered]
    tracked = [r for r in received if _key(r.split) in iteration.delivered]
    if untracked and iteration.requeued:  # rare: late reports of a dead worker's splits
        requeued = {(s.repetition, s.index) for s in iteration.requeued}
        tracked += [r for r in untracked if _key(r.split) in requeued]
    if not tracked:
        return None
    return Update(record_delivered=dispatcher_pb2.RecordDelivered(
        iteration_id=iteration.iteration_id, splits=tracked))


MAX_RANGE = 1 << 24  # elements one acknowledged range may span (a split has fewer)


def check_ranges(report: dispatcher_pb2.ReceivedSplit) -> None:
    """ValueError unless `offset_ranges` is [start, end) pairs, each non-empty and at most
    MAX_RANGE long (the dispatcher keeps every offset of a split not yet settled)."""
    ranges = report.offset_ranges
    if len(ranges) % 2:
        raise ValueError(f"offset_ranges of split {report.split.repetition}/"
                         f"{report.split.index} has an odd length {len(ranges)}: it holds "
                         "[start, end) pairs")
    for start, end in zip(ranges[::2], ranges[1::2], strict=True):
        if not 0 < end - start <= MAX_RANGE:
            raise ValueError(f"offset range [{start}, {end}) of split "
                             f"{report.split.repetition}/{report.split.index} must hold 1 to "
                             f"{MAX_RANGE} offsets")


def requeue(tasks: Iterable[Task]) -> list[Update]:
    """Send the unsettled splits of `tasks` back to their iterations."""
    return [Update(requeue_split=dispatcher_pb2.RequeueSplit(
                iteration_id=task.iteration_id,
                split=common_pb2.SplitKey(repetition=repetition, index=index)))
            for task in tasks for repetition, index in sorted(task.splits)]


def requeue_unacknowledged(state: DispatcherState, iteration: Iteration) -> list[Update]:
    """Once every task of an iteration that lost a client finished: its splits not settled
    hold elements sent to that client and never acknowledged; they go back (with the
    offsets the others acknowledged) so the remaining clients get them."""
    if iteration.garbage_collected or not iteration.delivered or not all(
            t.finished for t in state.iteration_tasks(iteration)):
        return []
    return [Update(requeue_split=dispatcher_pb2.RequeueSplit(
                iteration_id=iteration.iteration_id,
                split=common_pb2.SplitKey(repetition=repetition, index=index)))
            for repetition, index in sorted(iteration.delivered)]


def needs_takers(state: DispatcherState, iteration: Iteration) -> bool:
    """`iteration` has requeued splits and no unfinished task on a live worker to take them
    (a finished task asks for no split): it needs a new task on every live worker."""
    return bool(iteration.requeued) and not iteration.garbage_collected and not any(
        not t.finished and t.worker_address in state.workers
        for t in state.iteration_tasks(iteration))


def _key(split: common_pb2.SplitKey) -> tuple[int, int]:
    return split.repetition, split.index
