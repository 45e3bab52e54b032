"""DispatcherState with no servers: every Update kind, ids, split cursors, requeue, replay."""

from __future__ import annotations

import copy

import pytest

from tests.dispatcher.builders import (
    acquire_client,
    build,
    create_iteration,
    create_job,
    finish_task,
    garbage_collect,
    history,
    one_iteration,
    produce_split,
    register_dataset,
    register_worker,
    release_client,
    remove_worker,
    requeue_split,
)
from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher.journal import NullJournal
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.dispatcher.state import (
    ID_BASES,
    DispatcherState,
    InvalidTransition,
    RequeuedSplit,
)
from torch_dataservice.proto import dispatcher_pb2

Update = dispatcher_pb2.Update


# ---------------------------------------------------------------------- update builders


# ---------------------------------------------------------------------- every update kind
def test_empty_update_is_an_invalid_transition() -> None:
    with pytest.raises(InvalidTransition, match="empty update"):
        DispatcherState().apply(Update())


def test_register_dataset_records_it_and_its_fingerprint() -> None:
    state = build(register_dataset("1000", fingerprint="fp"),
                  register_dataset("1001", fingerprint="fp"))
    assert set(state.datasets) == {"1000", "1001"}
    assert state.dataset("1001").definition.num_splits == 3
    # The first dataset with a fingerprint keeps it: re-registering returns the old id.
    assert state.dataset_by_fingerprint == {"fp": "1000"}
    assert state.peek_id("dataset") == 1002


def test_named_dataset_ids_do_not_move_the_counter() -> None:
    state = build(register_dataset("my-dataset"))
    assert state.dataset("my-dataset").dataset_id == "my-dataset"
    assert state.peek_id("dataset") == ID_BASES["dataset"]
    # A numeric id chosen by a user moves the counter past it so it is never generated again.
    state.apply(register_dataset("1500"))
    assert state.peek_id("dataset") == 1501


def test_register_and_remove_worker() -> None:
    state = build(register_worker("w0:1", uid=11, index=0))
    worker = state.workers["w0:1"]
    assert (worker.uid, worker.index, worker.host_id, worker.process_id) == (11, 0, "h", "h:1")
    with pytest.raises(InvalidTransition, match="already registered"):
        state.apply(register_worker("w0:1"))
    state.apply(remove_worker("w0:1"))
    assert state.workers == {}
    with pytest.raises(InvalidTransition, match="not registered"):
        state.apply(remove_worker("w0:1"))


def test_removing_a_worker_finishes_its_tasks_only() -> None:
    state = build(*one_iteration())
    assert state.worker_tasks("w0:1") == [state.task(4000)]
    state.apply(remove_worker("w0:1"))
    assert state.task(4000).finished and not state.task(4001).finished
    assert state.worker_tasks("w0:1") == []
    iteration = state.iteration(2000)
    assert not state.is_finished(iteration)
    state.apply(finish_task(4001))
    assert state.is_finished(iteration)


def test_create_job_and_duplicate_names() -> None:
    state = build(register_dataset("1000"), create_job(5000, "a"), create_job(5007, "b"))
    assert state.job_by_name == {"a": 5000, "b": 5007}
    assert state.job(5007).config.dataset_id == "1000"
    assert state.peek_id("job") == 5008
    with pytest.raises(InvalidTransition, match="'a' already exists"):
        state.apply(create_job(5008, "a"))


def test_create_iteration_once_per_job_and_repetition() -> None:
    state = build(register_dataset("1000"), create_job(5000, "a"), create_iteration(2000, 5000),
                  create_iteration(2001, 5000, repetition=1))
    assert state.iteration_by_key == {(5000, 0): 2000, (5000, 1): 2001}
    assert state.peek_id("iteration") == 2002
    with pytest.raises(InvalidTransition, match="already exists"):
        state.apply(create_iteration(2002, 5000, repetition=1))
    # Once collected, the same (job, repetition) may start afresh.
    state.apply(garbage_collect(2001))
    state.apply(create_iteration(2002, 5000, repetition=1))
    assert state.iteration_by_key[(5000, 1)] == 2002


def test_tasks_belong_to_an_iteration_and_a_worker() -> None:
    state = build(*one_iteration())
    iteration = state.iteration(2000)
    assert iteration.task_ids == [4000, 4001]
    assert [t.task_id for t in state.iteration_tasks(iteration)] == [4000, 4001]
    assert state.workers["w1:1"].task_ids == {4001}
    assert state.peek_id("task") == 4002
    assert list(state.active_iterations()) == [iteration]
    state.apply(finish_task(4000))
    state.apply(finish_task(4000))  # repeated completions are harmless
    assert state.task(4000).finished and state.workers["w0:1"].task_ids == set()
    state.apply(finish_task(4001))
    assert state.is_finished(iteration) and list(state.active_iterations()) == []


def test_an_iteration_without_tasks_is_not_finished() -> None:
    state = build(register_dataset("1000"), create_job(5000, "a"), create_iteration(2000, 5000))
    assert not state.is_finished(state.iteration(2000))


def test_clients_acquire_and_release() -> None:
    state = build(*one_iteration(), acquire_client(3001, 2000))
    assert state.clients == {3000: 2000, 3001: 2000}
    assert state.iteration_of_client(3001).iteration_id == 2000
    assert state.peek_id("client") == 3002
    state.apply(release_client(3000))
    state.apply(release_client(3000))  # releasing twice is a no-op
    assert state.iteration(2000).client_ids == {3001}
    with pytest.raises(LookupError, match="3000"):
        state.iteration_of_client(3000)


def test_garbage_collection_finishes_tasks_and_drops_clients() -> None:
    state = build(*one_iteration())
    state.apply(garbage_collect(2000))
    iteration = state.iteration(2000)
    assert iteration.garbage_collected and state.is_finished(iteration)
    assert all(state.task(t).finished for t in iteration.task_ids)
    assert state.clients == {} and iteration.client_ids == set()
    assert list(state.active_iterations()) == []


@pytest.mark.parametrize("query, argument", [
    ("dataset", "nope"), ("job", 1), ("iteration", 1), ("task", 1), ("iteration_of_client", 1),
])
def test_queries_of_unknown_ids_raise_lookup_error(query: str, argument: object) -> None:
    with pytest.raises(LookupError, match=str(argument)):
        getattr(DispatcherState(), query)(argument)


# ---------------------------------------------------------------------- split cursors
def test_splits_are_handed_out_in_order() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000),
                  produce_split(2000, 0, 1, task_id=4001))
    iteration = state.iteration(2000)
    assert (iteration.cursor_repetition, iteration.cursor_index) == (0, 2)
    assert state.task(4000).splits == {(0, 0)} and state.task(4001).splits == {(0, 1)}
    with pytest.raises(InvalidTransition, match="out of order"):
        state.apply(produce_split(2000, 0, 3))


def test_end_of_splits_moves_the_cursor_to_the_next_repetition() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0), produce_split(2000, 0, -1))
    iteration = state.iteration(2000)
    assert (iteration.cursor_repetition, iteration.cursor_index) == (1, 0)
    # An older repetition is drained: producing a split of it is a bug in the caller.
    with pytest.raises(InvalidTransition, match="repetition 0"):
        state.apply(produce_split(2000, 0, 1))


def test_a_newer_repetition_restarts_the_cursor() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0), produce_split(2000, 0, 1),
                  produce_split(2000, 2, 0))
    iteration = state.iteration(2000)
    assert (iteration.cursor_repetition, iteration.cursor_index) == (2, 1)


def test_requeued_splits_are_handed_out_again_once() -> None:
    state = build(*one_iteration(), produce_split(2000, 0, 0, task_id=4000),
                  produce_split(2000, 0, 1, task_id=4000),
                  requeue_split(2000, 0, 0, delivered=(0, 1)))
    iteration = state.iteration(2000)
    assert iteration.requeued == [RequeuedSplit(0, 0, frozenset({0, 1}))]
    assert state.task(4000).splits == {(0, 1)}
    state.apply(produce_split(2000, 0, 0, task_id=4001, requeued=True))
    assert iteration.requeued == [] and state.task(4001).splits == {(0, 0)}
    assert (iteration.cursor_repetition, iteration.cursor_index) == (0, 2)  # cursor untouched
    with pytest.raises(InvalidTransition, match="was not requeued"):
        state.apply(produce_split(2000, 0, 0, task_id=4001, requeued=True))


def _service() -> DispatcherService:
    service = DispatcherService(DispatcherConfig(), NullJournal(), clock=lambda: 0.0)
    for update in one_iteration():
        service._apply(update)
    return service


def _get_split(service: DispatcherService, repetition: int, task_id: int = 4000):
    return service.GetSplit(dispatcher_pb2.GetSplitRequest(
        iteration_id=2000, repetition=repetition, task_id=task_id), None)


def test_get_split_follows_the_cursor_semantics() -> None:
    service = _service()  # the dataset has 3 splits per repetition
    assert [_get_split(service, 0).split_index for _ in range(3)] == [0, 1, 2]
    assert _get_split(service, 0).end_of_splits
    assert _get_split(service, 0).end_of_splits  # older than the cursor: drained, stays ended
    # A newer repetition starts from its first split, and then the older one has ended.
    assert _get_split(service, 2).split_index == 0
    assert _get_split(service, 1).end_of_splits
    assert _get_split(service, 2).split_index == 1
    service.close()


def test_get_split_hands_several_splits_in_order_and_a_retry_gets_them_again() -> None:
    service = _service()  # 3 splits per repetition
    request = dispatcher_pb2.GetSplitRequest(iteration_id=2000, repetition=0, task_id=4000,
                                             replica=9, request_id=1, max_splits=2)
    first = service.GetSplit(request, None)
    assert [first.split_index] + [f.split_index for f in first.following] == [0, 1]
    assert not first.end_of_splits
    assert service.GetSplit(request, None) == first  # a retried request: the same splits
    assert service.state.tasks[4000].splits == {(0, 0), (0, 1)}
    request.request_id, request.max_splits = 2, 5
    rest = service.GetSplit(request, None)  # only one left: no end mixed in
    assert (rest.split_index, len(rest.following), rest.end_of_splits) == (2, 0, False)
    request.request_id = 3
    assert service.GetSplit(request, None).end_of_splits
    service.close()


def test_get_split_prefers_requeued_splits_and_reports_the_skip() -> None:
    service = _service()
    _get_split(service, 0)
    service._apply(requeue_split(2000, 0, 0, delivered=(0, 1, 2)))
    response = _get_split(service, 0, task_id=4001)
    assert (response.split_index, response.skip) == (0, 3)
    assert _get_split(service, 0, task_id=4001).split_index == 1
    service.close()


# ---------------------------------------------------------------------- replay


def test_replaying_the_same_updates_gives_an_equal_state() -> None:
    updates = history()
    first = build(*updates)
    # The journal stores serialized records: replay what a file would give back.
    replayed = build(*(Update.FromString(u.SerializeToString()) for u in updates))
    assert replayed == first
    assert replayed.next_ids == {"dataset": 1001, "iteration": 2002, "client": 3002,
                                 "task": 4003, "job": 5002}
    snapshot = copy.deepcopy(first)
    first.apply(create_iteration(2002, 5001))
    assert first != snapshot  # equality is not trivially true
