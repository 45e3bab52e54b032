"""One journal record per request: a GetSplit that reports finished splits and is handed new
ones, a liveness pass that requeues a dead worker's splits, are each written once; replaying
those records, or the one-record-per-update journals older versions wrote, gives the state
the live dispatcher had. Real FileJournals in a temporary directory, no servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dispatcher.builders import (
    Clock,
    build,
    client_request,
    heartbeat_worker,
    kinds_of,
    make_service,
    replayed,
    replayed_updates,
    start_epoch,
    task_of,
)
from torch_dataservice.dispatcher import file_journal
from torch_dataservice.dispatcher.file_journal import FileJournal, scan_records
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.proto import common_pb2, dispatcher_pb2

pb = dispatcher_pb2
Update = dispatcher_pb2.Update
pytestmark = pytest.mark.timeout(60)


def _records(work_dir: Path) -> list[Update]:
    """The records of this incarnation's log, as written."""
    (log,) = (work_dir / file_journal.JOURNAL_DIR).glob("log_*")
    records, damage = scan_records(log)
    assert damage is None
    return [Update.FromString(record) for record in records]


def _ask(service: DispatcherService, iteration_id: int, task_id: int, request_id: int,
         finished: list[tuple[int, int]], max_splits: int = 4) -> list[tuple[int, int]]:
    """A worker's GetSplit: up to `max_splits` splits, reporting `finished` (10 elements
    each) produced; returns the splits handed."""
    request = pb.GetSplitRequest(iteration_id=iteration_id, task_id=task_id, replica=1,
                                 request_id=request_id, max_splits=max_splits)
    for repetition, index in finished:
        request.finished_splits.add(split=common_pb2.SplitKey(repetition=repetition,
                                                              index=index), elements=10)
    reply = service.GetSplit(request, None)
    if reply.end_of_splits:
        return []
    return [(s.repetition, s.split_index) for s in (reply, *reply.following)]


def _acknowledge(service: DispatcherService, client_id: int,
                 splits: list[tuple[int, int]]) -> None:
    request = client_request(service, client_id)
    for repetition, index in splits:
        request.received.add(split=common_pb2.SplitKey(repetition=repetition, index=index),
                             offset_ranges=(0, 10))
    service.ClientHeartbeat(request, None)


def _traffic(service: DispatcherService, clock: Clock) -> tuple[int, int]:
    """Two workers take splits four at a time, report them produced in their next request,
    a reader acknowledges some, then one worker dies and its splits are handed again."""
    iteration_id, client_id = start_epoch(service, workers=("a:1", "b:1"), num_splits=40)
    tasks = [task_of(service, iteration_id, address) for address in ("a:1", "b:1")]
    held: dict[int, list[tuple[int, int]]] = {task: [] for task in tasks}
    for request_id in range(1, 4):
        for task in tasks:
            finished, held[task] = held[task], _ask(service, iteration_id, task, request_id,
                                                    held[task])
            _acknowledge(service, client_id, finished[:2])  # the rest stays unsettled
    clock.now += 5.0
    heartbeat_worker(service, "a:1", tasks=(tasks[0],))
    _acknowledge(service, client_id, [])
    service.check_liveness()  # b:1 is silent: its splits not settled go back
    _acknowledge(service, client_id, [])  # the reader reported since: they may go
    _ask(service, iteration_id, tasks[0], 10, held[tasks[0]], max_splits=64)
    return iteration_id, client_id


def test_a_get_split_that_reports_and_is_handed_splits_appends_one_record(
        tmp_path: Path) -> None:
    clock = Clock()
    service = make_service(clock, tmp_path)
    iteration_id, client_id = start_epoch(service, workers=("a:1",), num_splits=40)
    task = task_of(service, iteration_id, "a:1")
    handed = _ask(service, iteration_id, task, 1, [])
    before = len(_records(tmp_path))
    again = _ask(service, iteration_id, task, 2, handed)
    records = _records(tmp_path)[before:]
    assert len(records) == 1, [kinds_of(r) for r in records]
    assert kinds_of(records[0]) == ["split_produced"] * 4 + ["produce_split"] * 4
    iteration = service.state.iteration(iteration_id)
    assert iteration.produced == dict.fromkeys(handed, 10)
    assert set(iteration.delivered) == set(handed) | set(again)
    # A request with one update writes that update, not a batch of one.
    _acknowledge(service, client_id, handed)
    (acknowledgement,) = _records(tmp_path)[before + 1:]
    assert acknowledgement.WhichOneof("kind") == "record_delivered"
    service.close()


def test_replaying_batched_records_restores_what_the_dispatcher_had(tmp_path: Path) -> None:
    clock = Clock()
    service = make_service(clock, tmp_path, worker_timeout_ms=1000)
    iteration_id, _ = _traffic(service, clock)
    iteration = service.state.iteration(iteration_id)
    assert iteration.produced and iteration.delivered and not iteration.requeued  # exercised
    batches = [r for r in _records(tmp_path) if r.WhichOneof("kind") == "batch"]
    assert any("requeue_split" in kinds_of(r) for r in batches)  # the liveness pass: one record
    live = service.state
    service.close()
    assert build(*replayed(tmp_path)) == live
    # A restarted dispatcher hands each split once: the cursor and the requeue survived.
    restarted = make_service(Clock(), tmp_path)
    assert restarted.state == live
    restarted.close()


def test_a_journal_of_one_record_per_update_still_replays(tmp_path: Path) -> None:
    """Older versions wrote every update as its own record: the same history, unbatched,
    replays into the same state."""
    clock = Clock()
    service = make_service(clock, tmp_path / "new", worker_timeout_ms=1000)
    _traffic(service, clock)
    live = service.state
    service.close()
    updates = replayed_updates(tmp_path / "new")
    old = FileJournal(tmp_path / "old")
    for update in updates:
        old.append(update)
    old.close()
    assert all(r.WhichOneof("kind") != "batch" for r in replayed(tmp_path / "old"))
    restarted = make_service(Clock(), tmp_path / "old")
    assert restarted.state == live
    restarted.close()
