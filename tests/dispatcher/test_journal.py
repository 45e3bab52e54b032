"""FileJournal with no servers: framing, torn and corrupt records, incarnations, compaction."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from tests.dispatcher.builders import (
    build,
    history,
    one_iteration,
    produce_split,
    register_epoch,
    register_worker,
    replayed,
    write_journal,
)
from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher import file_journal, snapshot
from torch_dataservice.dispatcher.file_journal import HEADER, FileJournal
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.dispatcher.state import DispatcherState
from torch_dataservice.errors import JournalCorruptError
from torch_dataservice.proto import dispatcher_pb2

Update = dispatcher_pb2.Update


def write(work_dir: Path, updates: list[Update], **options: int) -> FileJournal:
    journal = FileJournal(work_dir, **options)
    for update in updates:
        journal.append(update)
    journal.sync()
    journal.close()
    return journal


def logs(work_dir: Path) -> list[Path]:
    directory = work_dir / file_journal.JOURNAL_DIR
    return sorted(directory.glob("log_*"), key=lambda p: int(p.name.split("_")[1]))


def test_replay_returns_what_previous_incarnations_appended(tmp_path: Path) -> None:
    updates = history()
    write(tmp_path, updates[:5])
    write(tmp_path, updates[5:])  # a second incarnation: replays nothing new, writes log_1
    assert replayed(tmp_path) == updates
    assert [p.name for p in logs(tmp_path)] == ["log_0", "log_1", "log_2"]
    assert build(*replayed(tmp_path)) == build(*updates)


def test_a_fresh_work_dir_replays_nothing(tmp_path: Path) -> None:
    assert replayed(tmp_path / "new") == []


@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size + 2])
def test_a_torn_tail_is_dropped_with_a_warning(tmp_path: Path, cut: int,
                                               caplog: pytest.LogCaptureFixture) -> None:
    updates = one_iteration()
    write(tmp_path, updates)
    log = logs(tmp_path)[0]
    data = log.read_bytes()
    last = len(updates[-1].SerializeToString()) + HEADER.size
    log.write_bytes(data[:len(data) - last + cut])  # the last record only partly written
    with caplog.at_level(logging.WARNING):
        assert replayed(tmp_path) == updates[:-1]
    assert "torn record" in caplog.text


def test_a_corrupt_record_mid_file_is_refused_or_cut_on_request(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    updates = one_iteration()
    write(tmp_path, updates[:4])
    write(tmp_path, updates[4:])
    first = logs(tmp_path)[0]
    data = bytearray(first.read_bytes())
    second_record = HEADER.size + len(updates[0].SerializeToString())
    data[second_record + HEADER.size + 1] ^= 0xFF  # a bit flip inside record 2's payload
    first.write_bytes(bytes(data))
    # Corruption, not a torn tail: replaying around it would roll the state back.
    with pytest.raises(JournalCorruptError, match=f"log_0 is damaged at byte {second_record}"):
        replayed(tmp_path)
    journal = FileJournal(tmp_path, recovery="truncate")
    with caplog.at_level(logging.WARNING):
        assert list(journal.replay()) == [updates[0]]  # the later log is cut too
    journal.close()
    assert "fails its checksum" in caplog.text, caplog.text
    assert "1 later log file(s) hold 4 record(s)" in caplog.text, caplog.text


def test_sync_is_group_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = FileJournal(tmp_path)
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(file_journal.os, "fsync", lambda fd: (calls.append(fd),
                                                               real_fsync(fd)))
    journal.sync()
    assert calls == []  # nothing appended: nothing to wait for
    for update in one_iteration():
        journal.append(update)
    threads = [threading.Thread(target=journal.sync) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 1 <= len(calls) <= 8
    n = len(calls)
    journal.sync()
    assert len(calls) == n  # already durable
    monkeypatch.undo()
    journal.close()


def test_compaction_writes_a_snapshot_and_a_fresh_log(tmp_path: Path) -> None:
    state, compactions = write_journal(tmp_path, history(), compact_every=5)
    assert compactions == len(history()) // 5
    directory = tmp_path / file_journal.JOURNAL_DIR
    names = sorted(p.name for p in directory.iterdir())
    assert names == [f"log_{compactions}", f"snapshot_{compactions}"]  # old files are gone
    restored = DispatcherState()
    for update in replayed(tmp_path):
        snapshot.apply(restored, update)
    assert restored == state == build(*history())
    # The next incarnation appends after the snapshot and still replays everything.
    extra = produce_split(2001, 0, 0, task_id=4002)
    write(tmp_path, [extra])
    assert build(*replayed(tmp_path)) == build(*history(), extra)


def test_a_big_state_is_compacted_once_the_log_outgrows_its_snapshot(tmp_path: Path) -> None:
    """A big state (hundreds of workers) is not rewritten every `compact_every` records:
    the log first grows to the last snapshot's size (compaction costs at most the log's
    own writes)."""
    workers = [register_worker(f"big{i}:1") for i in range(300)]
    small = [produce_split(2000, 0, i, task_id=4000) for i in range(100)]
    updates = [*one_iteration(), *workers, *small]
    _, every_time = write_journal(tmp_path / "a", updates, compact_every=40)
    _, amortized = write_journal(tmp_path / "b", updates, compact_every=40, log_share=1.0)
    assert every_time == len(updates) // 40
    assert 1 <= amortized < every_time / 2
    state = build(*replayed(tmp_path / "b"))
    assert state == build(*updates)


@pytest.mark.timeout(30)
def test_compaction_builds_and_writes_the_snapshot_off_the_request_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The snapshot of a big state takes long to build: requests must not wait for it, and
    # what they append meanwhile (into the next log) must replay after it, with or without it.
    building, release = threading.Event(), threading.Event()
    build_snapshot = file_journal.snapshot_update

    def slow_snapshot(state: DispatcherState) -> Update:
        building.set()
        release.wait(20)
        return build_snapshot(state)

    monkeypatch.setattr(file_journal, "snapshot_update", slow_snapshot)
    updates = history()
    journal = FileJournal(tmp_path, compact_every=len(updates) - 2)
    state = DispatcherState()
    for update in updates[:-2]:
        journal.append(update)
        state.apply(update)
    returned = threading.Event()
    threading.Thread(target=lambda: (journal.maybe_compact(state), returned.set()),
                     daemon=True).start()
    assert building.wait(10)
    assert returned.wait(5), "maybe_compact waited for the snapshot to be built and written"
    for update in updates[-2:]:  # requests go on, into the next log
        journal.append(update)
        state.apply(update)
    journal.sync()
    # A crash now: the old files are still there and replay the same state.
    assert build(*replayed(tmp_path)) == state == build(*updates)
    release.set()
    journal.close()  # waits for the snapshot
    names = sorted(p.name for p in (tmp_path / file_journal.JOURNAL_DIR).iterdir())
    assert names == ["log_1", "log_2", "snapshot_1"], names
    assert build(*replayed(tmp_path)) == build(*updates)


def test_an_unfinished_compaction_is_ignored(tmp_path: Path) -> None:
    write(tmp_path, one_iteration())
    (tmp_path / file_journal.JOURNAL_DIR / "snapshot_1.tmp").write_bytes(b"half")
    assert replayed(tmp_path) == one_iteration()
    assert not list((tmp_path / file_journal.JOURNAL_DIR).glob("*.tmp"))


# ---------------------------------------------------------------------- through the service


def test_a_restarted_service_continues_the_split_cursor(tmp_path: Path) -> None:
    config = DispatcherConfig(fault_tolerant_mode=True, work_dir=str(tmp_path))
    first = DispatcherService(config, FileJournal(tmp_path), clock=lambda: 0.0)
    iteration_id, task_id = register_epoch(first)

    def get_split(service: DispatcherService, request_id: int) -> int:
        return service.GetSplit(dispatcher_pb2.GetSplitRequest(
            iteration_id=iteration_id, task_id=task_id, request_id=request_id), None).split_index

    assert [get_split(first, i) for i in (1, 2)] == [0, 1]
    state = first.state
    first.close()
    first._journal.close()  # noqa: SLF001 - what a kill -9 leaves is the same synced file

    second = DispatcherService(config, FileJournal(tmp_path), clock=lambda: 0.0)
    assert second.state == state
    assert get_split(second, 2) == 1  # a retried request: the same split, not a new one
    assert get_split(second, 3) == 2
    # The restarted dispatcher knows the worker by its uid: no re-registration, same task.
    reply = second.WorkerHeartbeat(dispatcher_pb2.WorkerHeartbeatRequest(
        worker_address="w:1", worker_uid=7, current_tasks=[task_id]), None)
    assert list(reply.new_tasks) == [] and second.state.workers["w:1"].uid == 7
    second.close()
