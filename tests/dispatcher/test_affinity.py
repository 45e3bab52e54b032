"""Split affinity under DYNAMIC sharding, the dispatcher alone (dispatcher/affinity.py): a worker
gets the splits it reports held first, one holding none still gets splits, and every split is
handed exactly once whatever the order, across a journaled restart (soft state gone), a worker's
death (its splits requeued as before) and a snapshot."""

from __future__ import annotations

import random

import pytest

from tests.dispatcher.builders import (
    Clock,
    Context,
    acquire_client,
    create_iteration,
    create_job,
    create_task,
    garbage_collect,
    get_split,
    heartbeat_worker,
    make_service,
    register_dataset,
    register_worker,
    start_epoch,
    task_of,
    timed_service,
)
from tests.dispatcher.builders import build as build_state
from tests.dispatcher.test_resume import consumed, resumed_job
from torch_dataservice.dispatcher import affinity, snapshot, splits
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import InvalidTransition
from torch_dataservice.observability.status_text import as_text
from torch_dataservice.proto import dispatcher_pb2
from torch_dataservice.wire.splits import index_ranges

pb = dispatcher_pb2
pytestmark = pytest.mark.timeout(30)


def hold(service, address: str, indices, version: int = 1, uid: int = 1,
         dataset_id: str = "1000") -> pb.WorkerHeartbeatResponse:
    """A heartbeat of `address` reporting it holds `indices` of `dataset_id` cached."""
    request = pb.WorkerHeartbeatRequest(worker_address=address, worker_uid=uid,
                                        held_version=version, held_report=True)
    request.held.add(dataset_id=dataset_id, ranges=index_ranges(indices))
    return service.WorkerHeartbeat(request, None)


def take(service, iteration_id: int, address: str) -> int:
    """The split `address`'s task gets (-1: end of splits)."""
    reply = get_split(service, iteration_id, task_of(service, iteration_id, address))
    return -1 if reply.end_of_splits else reply.split_index


def test_a_worker_gets_the_splits_it_holds_first() -> None:
    service = make_service(Clock())
    iteration_id, _ = start_epoch(service, num_splits=8)
    hold(service, "a:1", [1, 3, 5, 7])
    hold(service, "b:1", [0, 2, 4, 6])
    got = {"a:1": [], "b:1": []}
    for address in ["a:1", "a:1", "b:1", "a:1", "b:1", "b:1", "a:1", "b:1"]:
        got[address].append(take(service, iteration_id, address))
    assert got == {"a:1": [1, 3, 5, 7], "b:1": [0, 2, 4, 6]}
    assert take(service, iteration_id, "a:1") == -1
    iteration = service.state.iteration(iteration_id)
    assert (iteration.cursor_repetition, iteration.ahead) == (1, set())  # the end


def test_a_worker_holding_nothing_takes_unheld_splits_then_others() -> None:
    service = make_service(Clock())
    iteration_id, _ = start_epoch(service, num_splits=6)
    hold(service, "a:1", [0, 1, 2, 3])
    # b holds nothing: first the splits nobody holds, then a's (it never waits).
    assert [take(service, iteration_id, "b:1") for _ in range(3)] == [4, 5, 0]
    assert [take(service, iteration_id, "a:1") for _ in range(3)] == [1, 2, 3]
    assert take(service, iteration_id, "a:1") == take(service, iteration_id, "b:1") == -1


def test_without_reports_the_cursor_hands_in_order() -> None:
    service = make_service(Clock())
    iteration_id, _ = start_epoch(service, num_splits=4)
    hold(service, "a:1", [2], dataset_id="another")  # a dataset nobody reads: no effect
    assert [take(service, iteration_id, w) for w in ["b:1", "a:1", "a:1", "b:1"]] == [0, 1, 2, 3]
    assert not service.state.iteration(iteration_id).ahead


def test_the_report_is_kept_until_replaced_and_acknowledged_by_version() -> None:
    service = make_service(Clock())
    iteration_id, _ = start_epoch(service, num_splits=6)
    assert hold(service, "a:1", [4, 5], version=3).held_version == 3
    # Beats without the set keep it (and say which version the dispatcher has).
    assert heartbeat_worker(service, "a:1").held_version == 3
    assert take(service, iteration_id, "a:1") == 4
    assert hold(service, "a:1", [], version=4).held_version == 4  # evicted: holds nothing
    assert take(service, iteration_id, "a:1") == 0


def test_malformed_ranges_are_refused() -> None:
    service = make_service(Clock())
    start_epoch(service, num_splits=6)
    request = pb.WorkerHeartbeatRequest(worker_address="a:1", worker_uid=1, held_version=1,
                                        held_report=True)
    request.held.add(dataset_id="1000", ranges=[3, 2])
    with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT: .*\[3, 2\)"):
        service.WorkerHeartbeat(request, Context())


def hand_everything(service, iteration_id: int, workers, rng: random.Random) -> list[int]:
    handed = []
    while (index := take(service, iteration_id, rng.choice(workers))) != -1:
        handed.append(index)
    return handed


@pytest.mark.parametrize("seed", range(5))
def test_every_split_is_handed_once_in_any_order(seed: int) -> None:
    rng = random.Random(seed)
    service = make_service(Clock())
    iteration_id, _ = start_epoch(service, workers=("a:1", "b:1", "c:1"), num_splits=40)
    splits = list(range(40))
    rng.shuffle(splits)
    hold(service, "a:1", splits[:15])
    hold(service, "b:1", splits[15:25])  # c holds nothing; 15 splits nobody holds
    handed = hand_everything(service, iteration_id, ["a:1", "b:1", "c:1"], rng)
    assert sorted(handed) == list(range(40))
    iteration = service.state.iteration(iteration_id)
    assert (iteration.cursor_repetition, iteration.ahead) == (1, set())  # the end


def test_a_restarted_dispatcher_hands_the_rest_once(tmp_path) -> None:
    clock = Clock()
    service = make_service(clock, tmp_path)
    iteration_id, _ = start_epoch(service, num_splits=10)
    hold(service, "a:1", [5, 6, 7, 8])
    first = [take(service, iteration_id, "a:1") for _ in range(3)]
    first.append(take(service, iteration_id, "b:1"))
    assert first == [5, 6, 7, 0]
    service.close()
    restarted = make_service(clock, tmp_path)  # soft state gone: nobody holds anything
    assert restarted.state.iteration(iteration_id).ahead == {5, 6, 7}
    heartbeat_worker(restarted, "a:1")
    heartbeat_worker(restarted, "b:1")
    rest = hand_everything(restarted, iteration_id, ["a:1", "b:1"], random.Random(0))
    assert sorted(first + rest) == list(range(10))
    assert rest == [1, 2, 3, 4, 8, 9]  # the cursor steps over what went ahead
    restarted.close()


def test_a_dead_workers_splits_are_requeued_and_its_held_set_forgotten() -> None:
    clock = Clock()
    service = timed_service(clock)
    iteration_id, _ = start_epoch(service, num_splits=6)
    hold(service, "a:1", [3, 4])
    assert take(service, iteration_id, "a:1") == 3  # handed ahead, then a dies
    clock.now += 2
    heartbeat_worker(service, "b:1")
    service.check_liveness()
    assert "a:1" not in service.state.workers
    assert [s.index for s in service.state.iteration(iteration_id).requeued] == [3]
    assert service._soft.holders == {}  # noqa: SLF001 - what a held is gone with a
    clock.now += 2  # the requeue's wait for clients' reports is over
    assert hand_everything(service, iteration_id, ["b:1"], random.Random(0)) == [3, 0, 1, 2,
                                                                                  4, 5]


def test_ahead_records_are_checked_and_kept_by_snapshots() -> None:
    def ahead(index: int) -> pb.Update:
        return pb.Update(produce_split=pb.ProduceSplit(
            iteration_id=2000, repetition=0, split_index=index, task_id=4000, ahead=True))

    base = [register_dataset("1000", num_splits=5), register_worker("w0:1"),
            create_job(5000, "job"), create_iteration(2000, 5000),
            create_task(4000, 2000, "w0:1"), acquire_client(3000, 2000)]
    state = build_state(*base, ahead(3), ahead(1))
    assert state.iteration(2000).ahead == {1, 3}
    copy = snapshot.from_bytes(snapshot.to_bytes(state))
    assert copy.iteration(2000).ahead == {1, 3}
    older = snapshot.to_proto(build_state(*base))  # written before split affinity
    older.schema_version = 1
    assert snapshot.from_proto(older).iteration(2000).ahead == set()
    for wrong in (0, 1, 5):  # the cursor's own split, handed already, past the splits
        with pytest.raises(InvalidTransition):
            state.apply(ahead(wrong))
    state.apply(pb.Update(produce_split=pb.ProduceSplit(
        iteration_id=2000, repetition=0, split_index=0, task_id=4000)))
    assert (state.iteration(2000).cursor_index, state.iteration(2000).ahead) == (2, {3})
    # Collected and recreated (a trainer resuming later): what went ahead is still handed.
    state.apply(garbage_collect(2000))
    state.apply(create_iteration(2001, 5000))
    assert (state.iteration(2001).cursor_index, state.iteration(2001).ahead) == (2, {3})


def test_status_shows_what_each_worker_holds_and_the_splits_handed_ahead() -> None:
    service = make_service(Clock())
    iteration_id, _ = start_epoch(service, num_splits=6)
    hold(service, "a:1", [2, 3, 4])
    assert take(service, iteration_id, "a:1") == 2  # ahead of the cursor (at 0)
    reply = service.cluster_status()
    assert {w.address: w.held_splits for w in reply.workers} == {"a:1": 3, "b:1": 0}
    assert reply.iterations[0].splits_handed == 1
    assert "HELD SPLITS" in as_text(reply, "d:1")


def test_a_lone_worker_keeps_the_cursors_order() -> None:
    service = make_service(Clock())
    iteration_id, _ = start_epoch(service, workers=("a:1",), num_splits=4)
    hold(service, "a:1", [2, 3])  # it takes every split anyway: no reason to reorder
    assert [take(service, iteration_id, "a:1") for _ in range(5)] == [0, 1, 2, 3, -1]


def test_a_resumed_job_never_hands_a_held_split_read_before() -> None:
    state = build_state(*resumed_job(consumed([(0, 3)], [(5, 2, [])])),
                        register_worker("w1:1"), create_task(4001, 2000, "w1:1"))
    soft = SoftState()
    request = pb.WorkerHeartbeatRequest(held_version=1, held_report=True)
    request.held.add(dataset_id="1000", ranges=index_ranges([1, 5, 6]))
    affinity.note_report(state, soft, "w0:1", request)
    iteration, task = state.iteration(2000), state.task(4000)
    handed = []
    while (produce := splits.next_split(state, soft, iteration, 0, task, 0.0, 5.0)) \
            is not None and produce.split_index >= 0:
        state.apply(pb.Update(produce_split=produce))
        reply = splits.split_response(iteration, ((0, produce.split_index),))
        handed.append((reply.split_index, list(reply.skip_offsets)))
    # 1 was read whole before; 5 was read up to offset 2 (handed ahead, those skipped).
    assert handed == [(5, [0, 1]), (6, []), (3, []), (4, []), (7, [])]
