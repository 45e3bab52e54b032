"""The dispatcher's decision modules with no server: each takes a state (and soft state) and
returns updates; applying them is the caller's job."""

from __future__ import annotations

import pytest

from tests.dispatcher.builders import (
    acquire_client,
    build,
    create_job,
    create_task,
    finish_task,
    one_iteration,
    produce_split,
    register_worker,
    requeue_split,
)
from torch_dataservice.dispatcher import coordinated, liveness, splits, tasks, validation
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.errors import NotReadyError
from torch_dataservice.proto import common_pb2, dispatcher_pb2

pytestmark = pytest.mark.timeout(30)
WORKER_TIMEOUT_S = 5.0


def _apply(state, updates) -> None:
    for update in updates:
        state.apply(update)


def test_next_split_follows_the_cursor_then_ends_the_repetition() -> None:
    state = build(*one_iteration())
    soft = SoftState.restored(state, now=0.0)
    iteration, task = state.iteration(2000), state.task(4000)
    handed = []
    while (produce := splits.next_split(state, soft, iteration, 0, task, 0.0,
                                        WORKER_TIMEOUT_S)).split_index >= 0:
        handed.append(produce.split_index)
        state.apply(dispatcher_pb2.Update(produce_split=produce))
    assert handed == [0, 1, 2]
    state.apply(dispatcher_pb2.Update(produce_split=produce))  # the end moves the cursor
    assert splits.next_split(state, soft, iteration, 0, task, 0.0, WORKER_TIMEOUT_S) is None


def test_a_requeued_split_waits_for_client_reports_or_the_worker_timeout() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000),
                  produce_split(2000, 0, 1, task_id=4000), produce_split(2000, 0, 2, 4000),
                  produce_split(2000, 0, -1, task_id=4000), requeue_split(2000, 0, 1))
    soft = SoftState.restored(state, now=0.0)  # after a restart every requeue waits
    iteration, task = state.iteration(2000), state.task(4001)
    with pytest.raises(NotReadyError, match="wait for clients"):  # repetition 0 is all out
        splits.next_split(state, soft, iteration, 0, task, 1.0, WORKER_TIMEOUT_S)
    soft.note_heartbeat(3000, now=1.0)  # the one client reported
    produce = splits.next_split(state, soft, iteration, 0, task, 1.0, WORKER_TIMEOUT_S)
    assert (produce.repetition, produce.split_index, produce.requeued) == (0, 1, True)
    fresh = SoftState.restored(state, now=0.0)
    assert splits.requeue_ready(state, fresh, iteration, WORKER_TIMEOUT_S + 1,
                                WORKER_TIMEOUT_S)


def test_split_response_skips_the_delivered_offsets() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000),
                  requeue_split(2000, 0, 0, delivered=(0, 2)),
                  produce_split(2000, 0, 0, task_id=4001, requeued=True))
    response = splits.split_response(state.iteration(2000), ((0, 0),))
    assert (response.split_index, response.skip, list(response.skip_offsets)) == (0, 2, [0, 2])
    assert splits.split_response(state.iteration(2000), ()).end_of_splits


def test_delivered_tracks_only_splits_still_in_flight() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000))
    received = [dispatcher_pb2.ReceivedSplit(split=common_pb2.SplitKey(index=i), offsets=[0])
                for i in (0, 2)]
    update = splits.delivered(state.iteration(2000), received)
    assert [r.split.index for r in update.record_delivered.splits] == [0]
    assert splits.delivered(state.iteration(2000), received[1:]) is None


def test_removing_a_worker_requeues_its_splits_and_new_takers_are_needed() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000),
                  finish_task(4001))
    _apply(state, liveness.remove_worker(state, "w0:1"))
    iteration = state.iteration(2000)
    assert [(s.repetition, s.index) for s in iteration.requeued] == [(0, 0)]
    assert splits.needs_takers(state, iteration)  # w1's task is finished
    created = tasks.on_every_worker(state, iteration)
    assert [u.create_task.worker_address for u in created] == ["w1:1"]
    _apply(state, created)
    assert not splits.needs_takers(state, iteration)


def test_new_tasks_take_consecutive_ids_and_skip_fixed_coordinated_reads() -> None:
    state = build(*one_iteration(), register_worker("w2:1"))
    created = tasks.for_new_worker(state, "w2:1")
    assert [(u.create_task.task_id, u.create_task.iteration_id) for u in created] == [
        (4002, 2000)]
    coordinated_job = create_job(5001, "c")
    coordinated_job.create_job.config.num_consumers = 2
    state = build(*one_iteration(), coordinated_job,
                  dispatcher_pb2.Update(create_iteration=dispatcher_pb2.CreateIteration(
                      iteration_id=2001, job_id=5001)),
                  create_task(4002, 2001, "w0:1"), register_worker("w2:1"))
    assert [u.create_task.iteration_id for u in tasks.for_new_worker(state, "w2:1")] == [2000]


def _blocked(consumer: int, round_index: int, seen: int = 0):
    return dispatcher_pb2.ClientHeartbeatRequest(
        client_id=3000 + consumer, consumer_index=consumer, blocked_round=round_index,
        removals_seen=seen)


def test_lost_tasks_leave_the_round_robin_once_every_consumer_is_blocked() -> None:
    job = create_job(5000, "c")
    job.create_job.config.num_consumers = 2
    updates = one_iteration()
    updates[3] = job
    state = build(*updates, acquire_client(3001, 2000))
    _apply(state, liveness.remove_worker(state, "w0:1"))  # task 4000 is lost
    iteration, blocked = state.iteration(2000), {}
    assert coordinated.note_blocked(state, blocked, iteration, _blocked(0, 4)) is None
    removal = coordinated.note_blocked(state, blocked, iteration, _blocked(1, 6))
    assert (removal.remove_round_tasks.removal.round,
            list(removal.remove_round_tasks.removal.task_ids)) == (6, [4000])
    assert blocked == {}


def test_liveness_finds_silent_workers_clients_and_idle_iterations() -> None:
    state = build(*one_iteration())
    soft = SoftState.restored(state, now=0.0)
    soft.worker_seen["w1:1"] = 9.0
    assert liveness.silent_workers(state, soft, 10.0, 5.0) == ["w0:1"]
    assert liveness.silent_clients(state, soft, 10.0, 20.0) == []
    state.apply(dispatcher_pb2.Update(release_client=dispatcher_pb2.ReleaseClient(
        client_id=3000)))
    soft.forget_client(3000, state.iteration(2000), now=10.0)
    assert liveness.idle_iterations(state, soft, 12.0, 5.0) == []
    assert [it.iteration_id for it in liveness.idle_iterations(state, soft, 16.0, 5.0)] == [
        2000]


def test_validation_names_what_is_wrong() -> None:
    dataset = common_pb2.DatasetDef(splittable=False)
    config = common_pb2.JobConfig(sharding_policy=1)
    with pytest.raises(ValueError, match="DYNAMIC needs a splittable source"):
        validation.validate_job(config, dataset, ())
    with pytest.raises(ValueError, match="unknown sharding policy 42"):
        validation.validate_job(common_pb2.JobConfig(sharding_policy=42), dataset, ())
    with pytest.raises(ValueError, match="sharding_policy='OFF'"):
        validation.check_matching_job(common_pb2.JobConfig(job_name="j", sharding_policy=1),
                                      common_pb2.JobConfig(job_name="j", sharding_policy=0))
    assert validation.worker_index("b:1", ["a:1", "b:1"]) == 1
    with pytest.raises(ValueError, match="not in the dispatcher's fixed worker list"):
        validation.worker_index("c:1", ["a:1"])


def test_a_lost_workers_splits_wait_until_every_client_fenced_its_tasks() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000))
    _apply(state, liveness.remove_worker(state, "w0:1"))  # task 4000 lost, split 0 requeued
    soft = SoftState.restored(state, now=0.0)
    iteration = state.iteration(2000)
    soft.note_heartbeat(3000, now=0.5)  # reported, but still accepts the zombie's elements
    assert not splits.requeue_ready(state, soft, iteration, 0.5, WORKER_TIMEOUT_S)
    soft.client_fenced[3000] = frozenset({4000})
    assert splits.requeue_ready(state, soft, iteration, 0.5, WORKER_TIMEOUT_S)
    reply = tasks.client_reply(state, iteration, tasks.ClientViews().get(state, iteration), 0,
                               [])
    assert list(reply.lost_task_ids) == [4000]
    new, delete = tasks.worker_task_changes(state, "w1:1", [4000, 4001], num_workers=0)
    assert delete == [4000]  # a zombie that is back drops the lost task


def _coordinated_state(*more):
    job = create_job(5000, "c")
    job.create_job.config.num_consumers = 2
    updates = one_iteration()
    updates[3] = job
    return build(*updates, acquire_client(3001, 2000), *more)


def _round(consumer: int, current: int, ready: int | None = None):
    request = dispatcher_pb2.ClientHeartbeatRequest(
        client_id=3000 + consumer, consumer_index=consumer, current_round=current)
    if ready is not None:
        request.ready_round = ready
    return request


def test_a_joining_worker_gets_a_task_at_a_round_every_consumer_promised() -> None:
    state = _coordinated_state(register_worker("w2:1"))
    iteration, rounds, proposals = state.iteration(2000), {}, {}
    assert coordinated.joining_workers(state, iteration) == ["w2:1"]
    assert coordinated.plan_addition(state, rounds, proposals, iteration, _round(0, 10)) == []
    proposed = proposals[2000].round
    assert proposed == 10 + coordinated.ADD_MARGIN
    # Consumer 1 is past the proposal without having promised: a later round is proposed.
    assert coordinated.plan_addition(state, rounds, proposals, iteration,
                                     _round(1, proposed + 3)) == []
    later = proposals[2000].round
    assert later == proposed + 3 + coordinated.ADD_MARGIN
    assert coordinated.plan_addition(state, rounds, proposals, iteration,
                                     _round(0, 11, ready=later)) == []
    (update,) = coordinated.plan_addition(state, rounds, proposals, iteration,
                                          _round(1, proposed + 3, ready=later))
    assert (update.create_task.worker_address, update.create_task.starting_round) == (
        "w2:1", later)
    assert 2000 not in proposals


def test_a_lost_task_waits_for_its_replacement_when_no_other_task_is_left() -> None:
    state = _coordinated_state()
    _apply(state, liveness.remove_worker(state, "w0:1"))
    _apply(state, liveness.remove_worker(state, "w1:1"))  # every task lost
    iteration, blocked = state.iteration(2000), {}
    coordinated.note_blocked(state, blocked, iteration, _blocked(0, 4))
    assert coordinated.note_blocked(state, blocked, iteration, _blocked(1, 5)) is None
    state.apply(register_worker("w0:1", uid=8))  # restarted: it joins, then they leave
    assert coordinated.joining_workers(state, iteration) == ["w0:1"]


def test_a_shared_iteration_ends_for_its_clients_once_its_splits_settle_or_time_runs_out(
        ) -> None:
    """Two clients share an iteration whose tasks ran to their end, but a split is not
    settled: one of them may have died holding its elements, so neither is told "finished"
    until the split settles, or for at most twice worker_timeout_ms."""
    state = build(*one_iteration(), acquire_client(3001, 2000),
                  produce_split(2000, 0, 0, task_id=4000), produce_split(2000, 0, -1, 4000),
                  finish_task(4000), finish_task(4001))
    soft = SoftState.restored(state, now=0.0)
    iteration = state.iteration(2000)
    assert state.is_finished(iteration) and iteration.delivered  # split 0 is not settled
    assert splits.end_held(state, soft, iteration, 1.0, WORKER_TIMEOUT_S)
    view = tasks.ClientViews().get(state, iteration)
    assert not tasks.client_reply(state, iteration, view, 0, (), None, True).iteration_finished
    assert splits.end_held(state, soft, iteration, 1.0 + 2 * WORKER_TIMEOUT_S - 0.1,
                           WORKER_TIMEOUT_S)
    assert not splits.end_held(state, soft, iteration, 1.0 + 2 * WORKER_TIMEOUT_S,
                               WORKER_TIMEOUT_S)
    state.apply(dispatcher_pb2.Update(split_produced=dispatcher_pb2.SplitProduced(
        iteration_id=2000, task_id=4000, split=common_pb2.SplitKey(repetition=0, index=0),
        num_elements=2)))
    state.apply(dispatcher_pb2.Update(record_delivered=dispatcher_pb2.RecordDelivered(
        iteration_id=2000, splits=[dispatcher_pb2.ReceivedSplit(
            split=common_pb2.SplitKey(repetition=0, index=0), offsets=[0, 1])])))
    assert not iteration.delivered  # settled: the end is not held
    assert not splits.end_held(state, soft, iteration, 2.0, WORKER_TIMEOUT_S)
    alone = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000),
                  produce_split(2000, 0, -1, 4000), finish_task(4000), finish_task(4001))
    # One client holds what is not settled itself: nothing to wait for.
    assert not splits.end_held(alone, SoftState.restored(alone, now=0.0),
                               alone.iteration(2000), 1.0, WORKER_TIMEOUT_S)
