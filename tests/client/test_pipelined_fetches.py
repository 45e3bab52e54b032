"""A task's pipelined fetches hand their batches on in the order they started
(membership.TaskState.fetch_ended), whatever order they end in."""

from __future__ import annotations

import pytest

from torch_dataservice.client.delivery import Batch
from torch_dataservice.client.membership import TaskState
from torch_dataservice.proto import common_pb2

pytestmark = pytest.mark.timeout(10)


def _started(state: TaskState) -> int:
    ticket = state.started
    state.started += 1
    state.in_use += 1
    return ticket


def test_a_fetch_that_ends_first_waits_for_the_one_started_before_it() -> None:
    state = TaskState(common_pb2.TaskInfo(task_id=1))
    first, second = _started(state), _started(state)
    a, b = Batch(task_id=1), Batch(task_id=1)
    assert state.fetch_ended(second, b) == []  # the first is still in flight
    assert state.in_use == 1
    assert state.fetch_ended(first, a) == [a, b]
    assert state.in_use == 0
    third = _started(state)
    assert state.fetch_ended(third, None) == [None]  # a fetch that brought nothing, in turn
    assert state.ended_early == {}


def test_fetches_ending_in_order_go_on_at_once() -> None:
    state = TaskState(common_pb2.TaskInfo(task_id=1))
    batches = [Batch(task_id=1) for _ in range(3)]
    for batch in batches:
        assert state.fetch_ended(_started(state), batch) == [batch]
