"""Coordinated reads (num_consumers): the rounds all consumers agree on, as pure decisions.

Every consumer maps round r to the r-th task (mod their number, sorted by id), so all must
see the same task set: new workers get no task in such an iteration once it has tasks, and
finished tasks stay listed (their workers answer end_of_sequence) for late consumers.
"""

from __future__ import annotations

import logging

from torch_dataservice.dispatcher.state import DispatcherState, Iteration
from torch_dataservice.proto import common_pb2, dispatcher_pb2

logger = logging.getLogger(__name__)

Update = dispatcher_pb2.Update
DONE = -1  # a consumer's "removals seen" once it read its last round

Blocked = dict[int, tuple[int, int]]  # consumer index -> (round blocked at, removals seen)


def is_coordinated(state: DispatcherState, iteration: Iteration) -> bool:
    return state.job(iteration.job_id).config.HasField("num_consumers")


def note_blocked(state: DispatcherState, blocked: Blocked, iteration: Iteration,
                 request: dispatcher_pb2.ClientHeartbeatRequest) -> Update | None:
    """Record a consumer's report in `blocked`; the removal of lost tasks once all agree.

    tf.data service's MaybeRemoveTask, generalised: a consumer whose next round falls on a
    lost task stops there and reports that round. Once every consumer is stopped so (each
    having seen every removal decided so far), the lost tasks leave at R = the highest of
    those rounds: no consumer read a round >= R, so all switch to the smaller task set at the
    same round; rounds before R that fall on the lost tasks are skipped by whoever had not
    read them (their elements died with the worker). The decision is journaled, so a
    restarted dispatcher repeats it. Consumers that were waiting report again if they stop
    again (they are dropped from `blocked` when a removal is decided).
    """
    if not request.HasField("blocked_round"):
        blocked.pop(request.consumer_index, None)
        return None
    # A consumer that read its last round counts as stopped there whatever it has seen.
    seen = DONE if request.consumer_done else request.removals_seen
    blocked[request.consumer_index] = (request.blocked_round, seen)
    num_consumers = state.job(iteration.job_id).config.num_consumers
    current = {consumer: round_index for consumer, (round_index, seen) in blocked.items()
               if seen in (DONE, len(iteration.removals))}
    if set(current) != set(range(num_consumers)):
        return None
    removed = {t for _, task_ids in iteration.removals for t in task_ids}
    lost = [t for t in iteration.task_ids if state.task(t).lost and t not in removed]
    if not lost:
        return None
    removal_round = max(current.values(), default=0)
    if iteration.removals:
        removal_round = max(removal_round, iteration.removals[-1][0])
    logger.info("iteration %d: lost tasks %s leave the round robin at round %d",
                iteration.iteration_id, lost, removal_round)
    for consumer in [c for c, (_, seen) in blocked.items() if seen != DONE]:
        del blocked[consumer]
    return Update(remove_round_tasks=dispatcher_pb2.RemoveRoundTasks(
        iteration_id=iteration.iteration_id,
        removal=common_pb2.RemovedTasks(round=removal_round, task_ids=lost)))
