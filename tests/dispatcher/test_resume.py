"""DYNAMIC resume decisions with no server: a job created with `JobConfig.resume` hands out
only the unconsumed remainder of the epoch (dispatcher/resume.py, splits.py, state.py)."""

from __future__ import annotations

import pytest

from tests.dispatcher.builders import (
    acquire_client,
    build,
    create_iteration,
    create_task,
    register_dataset,
    register_worker,
)
from torch_dataservice.dispatcher import resume, snapshot, splits, validation
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import InvalidTransition
from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.proto import common_pb2, dispatcher_pb2

pytestmark = pytest.mark.timeout(30)
Update = dispatcher_pb2.Update


def consumed(complete: list[tuple[int, int]], partial: list[tuple[int, int, list[int]]],
             repetition: int = 0) -> common_pb2.ConsumedSplits:
    return common_pb2.ConsumedSplits(repetitions=[common_pb2.ConsumedRepetition(
        repetition=repetition,
        complete=[common_pb2.SplitRange(start=s, end=e) for s, e in complete],
        partial=[common_pb2.PartialSplit(index=i, below=b, extra=x) for i, b, x in partial])])


def resumed_job(description: common_pb2.ConsumedSplits, num_splits: int = 8) -> list[Update]:
    config = common_pb2.JobConfig(dataset_id="1000", job_name="resumed",
                                  sharding_policy=int(ShardingPolicy.DYNAMIC),
                                  target_workers="AUTO", resume=description)
    return [register_dataset("1000", num_splits=num_splits), register_worker("w0:1"),
            Update(create_job=dispatcher_pb2.CreateJob(job_id=5000, config=config)),
            create_iteration(2000, 5000), create_task(4000, 2000, "w0:1"),
            acquire_client(3000, 2000)]


def hand_out(state) -> list[tuple[int, list[int]]]:
    """Every split the cursor hands in repetition 0, with the offsets the worker skips."""
    soft = SoftState.restored(state, now=0.0)
    iteration, task = state.iteration(2000), state.task(4000)
    handed = []
    while (produce := splits.next_split(state, soft, iteration, 0, task, 0.0, 5.0)) \
            is not None and produce.split_index >= 0:
        state.apply(Update(produce_split=produce))
        reply = splits.split_response(iteration, ((0, produce.split_index),))
        handed.append((reply.split_index, list(reply.skip_offsets)))
    return handed


def test_the_cursor_steps_over_complete_splits_and_skips_consumed_offsets() -> None:
    state = build(*resumed_job(consumed([(0, 3), (5, 6)], [(3, 2, [4]), (6, 1, [])])))
    assert hand_out(state) == [(3, [0, 1, 4]), (4, []), (6, [0]), (7, [])]


def test_a_fully_consumed_epoch_hands_nothing() -> None:
    assert hand_out(build(*resumed_job(consumed([(0, 8)], [])))) == []


def test_a_job_without_resume_hands_every_split() -> None:
    state = build(*resumed_job(common_pb2.ConsumedSplits()))
    assert [i for i, _ in hand_out(state)] == list(range(8))


def test_another_repetition_is_not_affected() -> None:
    state = build(*resumed_job(consumed([(0, 8)], [], repetition=1)))
    assert [i for i, _ in hand_out(state)] == list(range(8))


def test_replay_rejects_a_split_the_resume_consumed() -> None:
    state = build(*resumed_job(consumed([(0, 3)], [])))
    with pytest.raises(InvalidTransition, match="out of order"):
        state.apply(Update(produce_split=dispatcher_pb2.ProduceSplit(
            iteration_id=2000, repetition=0, split_index=1, task_id=4000)))


def test_a_partly_read_split_settles_once_the_rest_is_delivered() -> None:
    state = build(*resumed_job(consumed([], [(0, 2, [])])))
    hand_out(state)
    iteration = state.iteration(2000)
    state.apply(Update(record_delivered=dispatcher_pb2.RecordDelivered(
        iteration_id=2000, splits=[dispatcher_pb2.ReceivedSplit(
            task_id=4000, split=common_pb2.SplitKey(index=0), offsets=[2])])))
    state.apply(Update(split_produced=dispatcher_pb2.SplitProduced(
        iteration_id=2000, task_id=4000, split=common_pb2.SplitKey(index=0), num_elements=3)))
    assert (0, 0) not in iteration.delivered  # settled
    assert iteration.sizes[(0, 0)] == 3       # and its size kept for GetSplitSizes
    reply = resume.split_sizes(iteration.sizes, [common_pb2.SplitKey(index=i) for i in (0, 1)])
    assert [(s.split.index, s.num_elements) for s in reply.sizes] == [(0, 3)]


def test_the_resume_and_sizes_survive_a_snapshot() -> None:
    state = build(*resumed_job(consumed([(0, 3)], [(3, 1, [])])))
    hand_out(state)
    state.apply(Update(split_produced=dispatcher_pb2.SplitProduced(
        iteration_id=2000, task_id=4000, split=common_pb2.SplitKey(index=3), num_elements=5)))
    restored = snapshot.from_proto(snapshot.to_proto(state))
    assert restored.iteration(2000).sizes == {(0, 3): 5}
    assert restored.job(5000).config.resume == state.job(5000).config.resume


@pytest.mark.parametrize("description, why", [
    (consumed([(2, 1)], []), "not ascending"),
    (consumed([(0, 9)], []), "not ascending"),
    (consumed([(0, 3), (2, 4)], []), "not ascending"),
    (consumed([(0, 3)], [(1, 1, [])]), "malformed"),
    (consumed([], [(0, 2, [1])]), "malformed"),
    (consumed([], [(0, 1 << 40, [])]), "malformed"),
])
def test_a_malformed_resume_is_refused(description, why) -> None:
    config = common_pb2.JobConfig(dataset_id="1000", sharding_policy=int(ShardingPolicy.DYNAMIC),
                                  resume=description)
    dataset = common_pb2.DatasetDef(splittable=True, num_splits=8)
    with pytest.raises(ValueError, match=why):
        validation.validate_job(config, dataset, ())


def test_a_resume_needs_dynamic_sharding() -> None:
    config = common_pb2.JobConfig(dataset_id="1000", sharding_policy=int(ShardingPolicy.OFF),
                                  resume=consumed([(0, 1)], []))
    with pytest.raises(ValueError, match="DYNAMIC"):
        validation.validate_job(config, common_pb2.DatasetDef(splittable=True, num_splits=8), ())


def test_joining_a_job_with_another_resume_is_refused() -> None:
    base = dict(dataset_id="1000", job_name="j", sharding_policy=int(ShardingPolicy.DYNAMIC))
    with pytest.raises(ValueError, match="resume"):
        validation.check_matching_job(
            common_pb2.JobConfig(**base, resume=consumed([(0, 1)], [])),
            common_pb2.JobConfig(**base, resume=consumed([(0, 2)], [])))
