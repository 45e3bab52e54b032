"""The protobuf dispatcher snapshot: round trip, field coverage, compaction, schema versions.

Timeouts: the configured default (pyproject.toml, 120 s) applies; nothing here starts a server.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest

from tests.dispatcher.builders import (
    acquire_client,
    build,
    create_iteration,
    create_job,
    create_task,
    finish_task,
    garbage_collect,
    produce_split,
    register_dataset,
    register_epoch,
    register_worker,
    release_client,
    remove_worker,
    replayed,
    requeue_split,
    write_journal,
)
from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher import file_journal, snapshot, state
from torch_dataservice.dispatcher.file_journal import FileJournal, encode_record, read_records
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.dispatcher.state import DispatcherState
from torch_dataservice.proto import common_pb2, dispatcher_pb2, snapshot_pb2

Update = dispatcher_pb2.Update


def _key(repetition: int, index: int) -> common_pb2.SplitKey:
    return common_pb2.SplitKey(repetition=repetition, index=index)


def get_split(iteration_id: int, repetition: int, index: int, task_id: int, replica: int,
              request_id: int) -> Update:
    return Update(produce_split=dispatcher_pb2.ProduceSplit(
        iteration_id=iteration_id, repetition=repetition, split_index=index, task_id=task_id,
        replica=replica, request_id=request_id))


def delivered(iteration_id: int, task_id: int, repetition: int, index: int,
              offsets: list[int]) -> Update:
    return Update(record_delivered=dispatcher_pb2.RecordDelivered(
        iteration_id=iteration_id, splits=[dispatcher_pb2.ReceivedSplit(
            task_id=task_id, split=_key(repetition, index), offsets=offsets)]))


def split_produced(iteration_id: int, task_id: int, repetition: int, index: int,
                   num_elements: int) -> Update:
    return Update(split_produced=dispatcher_pb2.SplitProduced(
        iteration_id=iteration_id, task_id=task_id, split=_key(repetition, index),
        num_elements=num_elements))


def rich_history() -> list[Update]:
    """Every kind of update, leaving every state field populated (see test_rich_is_rich)."""
    return [
        register_dataset("1000", fingerprint="fp"),
        register_dataset("1001", fingerprint="fp2", num_splits=5),
        Update(register_worker=dispatcher_pb2.RegisterWorker(
            worker_address="w0:1", worker_uid=7, worker_index=0, host_id="h0",
            process_id="h0:11", data_port=9000, data_socket="/tmp/w0.sock")),
        register_worker("w1:1", uid=8, index=1),
        register_worker("w2:1", uid=9),
        create_job(5000, "job"),
        create_job(5001, "other", dataset_id="1001"),
        create_iteration(2000, 5000),
        create_task(4000, 2000, "w0:1"),
        create_task(4001, 2000, "w1:1"),
        create_task(4002, 2000, "w2:1"),
        acquire_client(3000, 2000),
        acquire_client(3001, 2000),
        get_split(2000, 0, 0, task_id=4000, replica=0, request_id=1),
        get_split(2000, 0, 1, task_id=4001, replica=1, request_id=1),
        get_split(2000, 0, 2, task_id=4002, replica=0, request_id=1),
        get_split(2000, 0, -1, task_id=4000, replica=0, request_id=2),  # end of repetition 0
        get_split(2000, 1, 0, task_id=4000, replica=1, request_id=1),
        delivered(2000, 4000, 0, 0, [0, 1, 2]),
        split_produced(2000, 4000, 0, 0, 5),  # 3 of 5 delivered: stays open
        delivered(2000, 4001, 0, 1, [0]),
        split_produced(2000, 4002, 0, 2, 1),
        delivered(2000, 4002, 0, 2, [0]),  # settled: forgotten
        requeue_split(2000, 0, 1, delivered=(1,)),
        remove_worker("w2:1"),  # task 4002 lost
        Update(remove_round_tasks=dispatcher_pb2.RemoveRoundTasks(  # as if coordinated
            iteration_id=2000, removal=common_pb2.RemovedTasks(round=7, task_ids=[4002]))),
        delivered(2000, 4001, 0, 1, [2]),  # late: counts for the requeued split
        finish_task(4001),
        release_client(3001),
        # A garbage-collected iteration, recreated with its cursor and requeued splits.
        create_iteration(2001, 5001),
        create_task(4003, 2001, "w0:1"),
        acquire_client(3002, 2001),
        produce_split(2001, 0, 0, task_id=4003),
        produce_split(2001, 0, 1, task_id=4003),
        requeue_split(2001, 0, 0, delivered=(0, 3)),
        garbage_collect(2001),
        create_iteration(2002, 5001),
        create_task(4004, 2002, "w1:1"),
        acquire_client(3003, 2002),
    ]


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Equal field by field, with equal types and equal dict and list order."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def round_trip(original: DispatcherState) -> DispatcherState:
    data = snapshot.to_proto(original).SerializeToString()
    return snapshot.from_proto(snapshot_pb2.DispatcherSnapshot.FromString(data))


# ---------------------------------------------------------------------- round trip
def test_rich_is_rich() -> None:
    """The round trip below is only as good as the state it round-trips."""
    s = build(*rich_history())
    assert len(s.datasets) == 2 and len(s.dataset_by_fingerprint) == 2
    assert s.workers["w0:1"].task_ids and s.workers["w0:1"].data_port == 9000
    assert s.tasks[4002].lost and s.tasks[4001].finished
    assert s.tasks[4000].splits == {(0, 0), (1, 0)}
    assert s.tasks[4000].last_split == {0: (2, ((0, -1),)), 1: (1, ((1, 0),))}
    it = s.iterations[2000]
    assert (it.cursor_repetition, it.cursor_index) == (1, 1)
    assert it.requeued == [state.RequeuedSplit(0, 1, frozenset({0, 1, 2}))]
    assert it.delivered == {(0, 0): {0, 1, 2}, (1, 0): set()} and it.produced == {(0, 0): 5}
    assert it.client_ids == {3000}
    assert it.removals == [(7, (4002,))]
    assert s.iterations[2001].garbage_collected
    recreated = s.iterations[2002]
    assert (recreated.cursor_repetition, recreated.cursor_index) == (0, 2)
    assert recreated.requeued == [state.RequeuedSplit(0, 0, frozenset({0, 3}))]
    assert s.iteration_by_key == {(5000, 0): 2000, (5001, 0): 2002}
    assert s.clients == {3000: 2000, 3003: 2002}
    assert s.next_ids != state.ID_BASES


def test_round_trip_keeps_every_field() -> None:
    original = build(*rich_history())
    restored = round_trip(original)
    assert_same(original, restored)
    assert restored == original


def test_round_trip_of_an_empty_state() -> None:
    assert_same(DispatcherState(), round_trip(DispatcherState()))


@pytest.mark.timeout(30)
def test_a_copy_for_a_snapshot_keeps_the_state_it_was_taken_of() -> None:
    """A compaction copies the state under the lock and builds the snapshot from the copy
    while requests go on changing the state: at every point of a rich history, the copy's
    snapshot is the state's at the copy, whatever is applied after."""
    history = rich_history()
    for cut in range(len(history) + 1):
        live = build(*history[:cut])
        copied = snapshot.copy_for_snapshot(live)
        for update in history[cut:]:
            live.apply(update)
        assert_same(build(*history[:cut]), round_trip(copied))
        # The copy shares the biggest sets with the state, which copies one before it
        # changes it: the state goes on exactly as one never copied.
        assert_same(build(*history), live)


@pytest.mark.timeout(30)
def test_copies_of_successive_compactions_each_keep_their_state() -> None:
    """Two compactions at any two points: each copy's snapshot is the state at its copy, and
    the state ends as if never copied (what the first copy shared stays shared with it)."""
    history = rich_history()
    for first in range(len(history) + 1):
        for second in range(first, len(history) + 1):
            live = build(*history[:first])
            copies = [snapshot.copy_for_snapshot(live)]
            for update in history[first:second]:
                live.apply(update)
            copies.append(snapshot.copy_for_snapshot(live))
            for update in history[second:]:
                live.apply(update)
            assert_same(build(*history[:first]), round_trip(copies[0]))
            assert_same(build(*history[:second]), round_trip(copies[1]))
            assert_same(build(*history), live)


def test_the_restored_state_shares_nothing_with_the_snapshot() -> None:
    message = snapshot.to_proto(build(*rich_history()))
    restored = snapshot.from_proto(message)
    message.datasets[0].definition.num_splits = 99
    message.jobs[0].config.job_name = "changed"
    assert restored.datasets["1000"].definition.num_splits == 3
    assert restored.jobs[5000].config.job_name == "job"


def test_the_restored_state_goes_on_like_the_original() -> None:
    more = [produce_split(2002, 0, 0, task_id=4004, requeued=True),
            produce_split(2002, 0, 2, task_id=4004), delivered(2002, 4004, 0, 2, [0])]
    restored = round_trip(build(*rich_history()))
    for update in more:
        restored.apply(update)
    assert_same(restored, build(*rich_history(), *more))


def test_state_snapshot_update_holds_a_dispatcher_snapshot_not_a_pickle() -> None:
    original = build(*rich_history())
    update = snapshot.snapshot_update(original)
    message = snapshot_pb2.DispatcherSnapshot.FromString(update.snapshot.state)
    assert message.schema_version == snapshot.SCHEMA_VERSION
    assert message == snapshot.to_proto(original)
    target = build(*rich_history()[:5])
    snapshot.apply(target, update)
    assert_same(original, target)


# ---------------------------------------------------------------------- coverage guard
def _state_dataclasses() -> list[type]:
    return [cls for _, cls in inspect.getmembers(state, inspect.isclass)
            if dataclasses.is_dataclass(cls) and cls.__module__ == state.__name__]


def test_every_state_field_is_in_the_snapshot() -> None:
    classes = _state_dataclasses()
    assert len(classes) >= 7
    for cls in classes:
        assert cls in snapshot.COVERED, (
            f"state.{cls.__name__} is a new state dataclass: add it to snapshot.proto, "
            "to_proto/from_proto and snapshot.COVERED")
        fields = [f.name for f in dataclasses.fields(cls)]
        missing = sorted(set(fields) - set(snapshot.COVERED[cls]))
        assert not missing, (
            f"state.{cls.__name__} field(s) {missing} are not in the dispatcher snapshot: "
            "add them to protos/torch_dataservice/v1/snapshot.proto, to_proto/from_proto in "
            "dispatcher/snapshot.py and snapshot.COVERED, or compaction loses them")
        stale = sorted(set(snapshot.COVERED[cls]) - set(fields))
        assert not stale, f"snapshot.COVERED[{cls.__name__}] names unknown fields {stale}"


# ---------------------------------------------------------------------- through the journal
def test_a_state_survives_compaction_and_restart(tmp_path: Path) -> None:
    live, compactions = write_journal(tmp_path, rich_history(), compact_every=4)
    assert compactions == len(rich_history()) // 4
    directory = tmp_path / file_journal.JOURNAL_DIR
    (record,) = read_records(directory / f"snapshot_{compactions}")
    stored = snapshot_pb2.DispatcherSnapshot.FromString(Update.FromString(record).snapshot.state)
    assert stored.schema_version == snapshot.SCHEMA_VERSION
    restored = DispatcherState()
    for update in replayed(tmp_path):
        snapshot.apply(restored, update)
    assert_same(live, restored)
    assert_same(build(*rich_history()), restored)


def test_a_restarted_service_continues_after_compaction(tmp_path: Path) -> None:
    config = DispatcherConfig(fault_tolerant_mode=True, work_dir=str(tmp_path))
    first = DispatcherService(config, FileJournal(tmp_path, compact_every=2), clock=lambda: 0.0)
    iteration_id, task_id = register_epoch(first)

    def split(service: DispatcherService, request_id: int) -> int:
        return service.GetSplit(dispatcher_pb2.GetSplitRequest(
            iteration_id=iteration_id, task_id=task_id, request_id=request_id), None).split_index

    assert [split(first, i) for i in (1, 2, 3)] == [0, 1, 2]
    assert list((tmp_path / file_journal.JOURNAL_DIR).glob("snapshot_*"))
    live = first.state
    first.close()
    first._journal.close()  # noqa: SLF001 - what a kill -9 leaves is the same synced file

    second = DispatcherService(config, FileJournal(tmp_path), clock=lambda: 0.0)
    try:
        assert_same(live, second.state)
        assert split(second, 3) == 2  # a retried request: the same split
        assert split(second, 4) == 3
    finally:
        second.close()
        second._journal.close()  # noqa: SLF001


# ---------------------------------------------------------------------- versions
def _write_snapshot_file(work_dir: Path, payload: bytes) -> None:
    directory = work_dir / file_journal.JOURNAL_DIR
    directory.mkdir(parents=True)
    update = Update(snapshot=dispatcher_pb2.StateSnapshot(state=payload))
    (directory / "snapshot_1").write_bytes(encode_record(update.SerializeToString()))


def _as_version_3(message: snapshot_pb2.DispatcherSnapshot) -> None:
    """Rewrite `message` as schema 3 wrote it: delivered, produced and task splits as one
    message per split, no columns."""
    S = snapshot_pb2.DispatcherSnapshot
    message.schema_version = 3
    for it in message.iterations:
        position = 0
        for repetition, index, count in zip(it.delivered_repetitions, it.delivered_indices,
                                            it.delivered_offset_counts, strict=True):
            it.delivered.add(split=common_pb2.SplitKey(repetition=repetition, index=index),
                             offsets=it.delivered_offsets[position:position + count])
            position += count
        for repetition, index, n in zip(it.produced_repetitions, it.produced_indices,
                                        it.produced_elements, strict=True):
            it.produced.append(S.ProducedSplit(
                split=common_pb2.SplitKey(repetition=repetition, index=index), num_elements=n))
        for name in ("delivered_repetitions", "delivered_indices", "delivered_offset_counts",
                     "delivered_offsets", "produced_repetitions", "produced_indices",
                     "produced_elements"):
            it.ClearField(name)
    for task in message.tasks:
        for repetition, index in zip(task.split_repetitions, task.split_indices, strict=True):
            task.splits.add(repetition=repetition, index=index)
        task.ClearField("split_repetitions")
        task.ClearField("split_indices")


def test_a_version_3_snapshot_reads_the_same_state() -> None:
    """Schema 4 writes the per-split parts as columns; the messages schema 3 wrote (found on
    disk after an upgrade) read as the same state."""
    original = build(*rich_history())
    message = snapshot.to_proto(original)
    assert list(message.iterations[0].delivered_offsets) == [0, 1, 2]  # columns written
    _as_version_3(message)
    assert message.iterations[0].delivered and message.tasks[0].splits
    restored = snapshot.from_bytes(message.SerializeToString())
    assert_same(original, restored)


def test_a_snapshot_of_a_newer_schema_version_is_refused_clearly(tmp_path: Path) -> None:
    newer = snapshot.to_proto(build(*rich_history()))
    newer.schema_version = snapshot.SCHEMA_VERSION + 1
    _write_snapshot_file(tmp_path, newer.SerializeToString())
    config = DispatcherConfig(fault_tolerant_mode=True, work_dir=str(tmp_path))
    journal = FileJournal(tmp_path)
    try:
        with pytest.raises(snapshot.UnsupportedSnapshot,
                           match=f"schema version {snapshot.SCHEMA_VERSION + 1}, newer than"):
            DispatcherService(config, journal, clock=lambda: 0.0)
    finally:
        journal.close()


@pytest.mark.parametrize("payload", [
    pickle.dumps(DispatcherState(), protocol=pickle.HIGHEST_PROTOCOL),  # the old format
    b"",
    b"\xff\xff\xff",
])
def test_a_snapshot_that_is_not_a_dispatcher_snapshot_is_refused(payload: bytes) -> None:
    update = Update(snapshot=dispatcher_pb2.StateSnapshot(state=payload))
    with pytest.raises(snapshot.UnsupportedSnapshot, match="dispatcher snapshot"):
        snapshot.apply(DispatcherState(), update)


def test_a_snapshot_file_holding_another_update_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / file_journal.JOURNAL_DIR
    directory.mkdir(parents=True)
    (directory / "snapshot_1").write_bytes(
        encode_record(register_dataset("1000").SerializeToString()))
    with pytest.raises(RuntimeError, match="not a snapshot"):
        replayed(tmp_path)
