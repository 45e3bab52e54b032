"""Coordinated reads (num_consumers): the rounds all consumers agree on.

The functions never change the state: they return `Update`s. They do record what consumers
report in the soft state they are handed (`blocked`, `rounds`, `proposals`).

Every consumer maps round r to the r-th task (mod their number, sorted by id), so all must
see the same task set at every round: finished tasks stay listed (their workers answer
end_of_sequence) for late consumers, a lost task leaves at a round all agree on
(`note_blocked`), and a worker that joins (new, or restarted after its task was lost) gets a
task that joins at a round all agreed on beforehand (`plan_addition`, as tf.data service's
pending tasks): the dispatcher proposes a round ahead of every consumer, each consumer that
has not reached it promises not to read it before the outcome, and once all promised, the
task is created with that starting round. Once a consumer passed the proposal, a new one is
made, twice as far ahead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch_dataservice.dispatcher.state import DispatcherState, Iteration
from torch_dataservice.proto import common_pb2, dispatcher_pb2

logger = logging.getLogger(__name__)

Update = dispatcher_pb2.Update
DONE = -1  # a consumer's "removals seen" once it read its last round

Blocked = dict[int, tuple[int, int]]  # consumer index -> (round blocked at, removals seen)
ADD_MARGIN = 4  # a first proposed round is this far ahead of the furthest consumer ...
MAX_ADD_MARGIN = 1 << 16  # ... and twice as far after each one a consumer passed, up to this


@dataclass
class Proposal:
    """A round at which joining workers' tasks would join, and who promised to wait at it."""

    round: int
    margin: int = ADD_MARGIN  # how far ahead of the furthest consumer it was proposed
    ready: set[int] = field(default_factory=set)


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
    tasks = list(state.iteration_tasks(iteration))
    lost = [t.task_id for t in tasks if t.lost and t.task_id not in removed]
    if not lost or joining_workers(state, iteration):
        return None  # nothing to remove, or a worker joins first (it may take the place)
    if not any(not t.lost for t in tasks):
        return None  # no task would be left: wait for a worker to take their place
    # Not before a task that joined later starts: the set must never be empty in between.
    removal_round = max([*current.values(), *(t.starting_round for t in tasks if not t.lost)])
    if iteration.removals:
        removal_round = max(removal_round, iteration.removals[-1][0])
    logger.info("iteration %d: lost tasks %s leave the round robin at round %d",
                iteration.iteration_id, lost, removal_round)
    for consumer in [c for c, (_, seen) in blocked.items() if seen != DONE]:
        del blocked[consumer]
    return Update(remove_round_tasks=dispatcher_pb2.RemoveRoundTasks(
        iteration_id=iteration.iteration_id,
        removal=common_pb2.RemovedTasks(round=removal_round, task_ids=lost)))


def joining_workers(state: DispatcherState, iteration: Iteration) -> list[str]:
    """Registered workers with no live task in a running coordinated iteration: new ones, and
    ones that restarted after their task was lost (a rolling restart)."""
    if not iteration.task_ids or iteration.garbage_collected or state.is_finished(iteration):
        return []
    serving = {t.worker_address for t in state.iteration_tasks(iteration) if not t.lost}
    return sorted(a for a in state.workers if a not in serving)


def plan_addition(state: DispatcherState, rounds: dict[int, int],
                  proposals: dict[int, Proposal], iteration: Iteration,
                  request: dispatcher_pb2.ClientHeartbeatRequest) -> list[Update]:
    """Record a consumer's round and promise; the joining workers' tasks once all promised.

    `rounds` (consumer -> the round it reads or will read next) and `proposals` (iteration
    -> Proposal) are soft state: consumers report both in every heartbeat.
    """
    consumer = request.consumer_index
    if request.HasField("current_round"):
        rounds[consumer] = request.current_round
    joining = joining_workers(state, iteration)
    proposal = proposals.get(iteration.iteration_id)
    if not joining:
        proposals.pop(iteration.iteration_id, None)
        return []
    passed = proposal is not None and any(
        r >= proposal.round and c not in proposal.ready for c, r in rounds.items())
    if proposal is None or passed:
        # Consumers report their rounds once a heartbeat: one that reads more rounds than the
        # margin between two reports passes every proposal before it hears of it. A passed
        # proposal is made again twice as far ahead, so that the margin soon covers that.
        margin = ADD_MARGIN if proposal is None else min(2 * proposal.margin, MAX_ADD_MARGIN)
        proposal = Proposal(max(rounds.values(), default=0) + margin, margin)
        proposals[iteration.iteration_id] = proposal
    if request.consumer_done or (request.HasField("ready_round")
                                 and request.ready_round == proposal.round):
        proposal.ready.add(consumer)
    num_consumers = state.job(iteration.job_id).config.num_consumers
    if not proposal.ready >= set(range(num_consumers)):
        return []
    del proposals[iteration.iteration_id]
    logger.info("iteration %d: worker(s) %s join the round robin at round %d",
                iteration.iteration_id, joining, proposal.round)
    first = state.peek_id("task")
    return [Update(create_task=dispatcher_pb2.CreateTask(
                task_id=first + i, iteration_id=iteration.iteration_id, worker_address=address,
                starting_round=proposal.round))
            for i, address in enumerate(joining)]
