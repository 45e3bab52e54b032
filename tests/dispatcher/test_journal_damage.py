"""A damaged journal (issue 15.2, 15.3, 15.5): corruption in the middle refuses to start with
a one-line error naming the file and offset, or is cut there on request; a full disk fails
the RPC instead of acknowledging a torn record. Real dispatchers, real files, a real full
tmpfs."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.conftest import free_port, subprocess_env
from tests.dispatcher.builders import (
    Clock,
    Context,
    build,
    kinds_of,
    make_service,
    replayed,
    start_epoch,
    task_of,
)
from torch_dataservice.dispatcher.file_journal import HEADER, JOURNAL_DIR, scan_records
from torch_dataservice.errors import JournalCorruptError
from torch_dataservice.proto import common_pb2, dispatcher_pb2

Update = dispatcher_pb2.Update
pb = dispatcher_pb2
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _config(work_dir: Path, **overrides) -> tds.DispatcherConfig:
    return tds.DispatcherConfig(host="127.0.0.1", fault_tolerant_mode=True,
                                work_dir=str(work_dir), **overrides)


def _register(dispatcher: tds.DispatchServer, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        tds.register_dataset(dispatcher.target, tds.Pipeline.range(i + 1))


def _flip_middle_record(path: Path) -> int:
    """Flip one payload byte of a record in the middle of `path`; returns its offset."""
    records, damage = scan_records(path)
    assert damage is None and len(records) >= 4
    return _flip_record(path, len(records) // 2)


def _flip_record(path: Path, number: int) -> int:
    """Flip one payload byte of record `number` of `path`; returns its offset."""
    records, damage = scan_records(path)
    assert damage is None and number < len(records) - 1, "not a record in the middle"
    offset = sum(HEADER.size + len(r) for r in records[:number])
    data = bytearray(path.read_bytes())
    data[offset + HEADER.size + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return offset


def _journal(work_dir: Path) -> Path:
    return work_dir / JOURNAL_DIR


def _records_after_creation(log: Path) -> int:
    """Whole records in `log` after the first iteration's creation (-1: not created yet)."""
    records = scan_records(log)[0]
    kinds = [kinds_of(Update.FromString(record)) for record in records]
    created = next((i for i, k in enumerate(kinds) if "create_iteration" in k), None)
    return -1 if created is None else len(records) - created - 1


def test_a_record_damaged_mid_log_refuses_to_start_naming_file_and_offset(
        tmp_path: Path) -> None:
    with tds.DispatchServer(_config(tmp_path)) as dispatcher:
        _register(dispatcher, 8)
    offset = _flip_middle_record(_journal(tmp_path) / "log_0")
    with pytest.raises(JournalCorruptError) as info:
        tds.DispatchServer(_config(tmp_path))
    message = str(info.value)
    assert f"log_0 is damaged at byte {offset}" in message
    assert "--journal-recovery truncate" in message


def test_truncate_recovery_reports_what_it_drops_and_rewrites_the_journal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tds.DispatchServer(_config(tmp_path)) as dispatcher:
        _register(dispatcher, 8)
    _flip_middle_record(_journal(tmp_path) / "log_0")
    with caplog.at_level(logging.WARNING), tds.DispatchServer(
            _config(tmp_path, journal_recovery="truncate")) as recovered:
        kept = len(recovered._service.state.datasets)  # noqa: SLF001
        assert 0 < kept < 8
    assert "journal recovery 'truncate' discards" in caplog.text
    # Rewritten: the next start needs no recovery and keeps what the recovery kept.
    with tds.DispatchServer(_config(tmp_path)) as again:
        assert len(again._service.state.datasets) == kept  # noqa: SLF001


def test_damage_in_an_older_log_is_named_with_the_later_logs_it_holds_back(
        tmp_path: Path) -> None:
    with tds.DispatchServer(_config(tmp_path)) as dispatcher:
        _register(dispatcher, 6)
    with tds.DispatchServer(_config(tmp_path)) as dispatcher:  # a second incarnation: log_1
        _register(dispatcher, 3, start=6)
    assert (_journal(tmp_path) / "log_1").stat().st_size > 0
    _flip_middle_record(_journal(tmp_path) / "log_0")
    with pytest.raises(JournalCorruptError, match=r"log_0 is damaged at byte \d+ .*1 later "
                                                  r"log file\(s\) hold 3 record"):
        tds.DispatchServer(_config(tmp_path))


def test_the_cli_says_what_is_damaged_in_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    with tds.DispatchServer(_config(tmp_path)) as dispatcher:
        _register(dispatcher, 6)
    _flip_middle_record(_journal(tmp_path) / "log_0")
    result = subprocess.run(
        [sys.executable, "-m", "torch_dataservice", "dispatcher", "--host", "127.0.0.1",
         "--port", str(free_port()), "--fault-tolerant", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=50, env=subprocess_env())
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "log_0 is damaged at byte" in errors[0], result.stderr


def test_a_torn_tail_is_still_dropped_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tds.DispatchServer(_config(tmp_path)) as dispatcher:
        _register(dispatcher, 4)
    log = _journal(tmp_path) / "log_0"
    log.write_bytes(log.read_bytes()[:-3])  # the last record, cut by a crash
    with caplog.at_level(logging.WARNING), tds.DispatchServer(_config(tmp_path)) as restarted:
        assert len(restarted._service.state.datasets) == 3  # noqa: SLF001
    assert "from a crash mid-append" in caplog.text


def test_readers_of_an_iteration_cut_by_recovery_get_an_error_not_data_again(
        tmp_path: Path) -> None:
    port = free_port()
    config = _config(tmp_path, port=port)
    dispatcher = tds.DispatchServer(config)
    worker = tds.WorkerServer(tds.WorkerConfig(dispatcher.address, host="127.0.0.1",
                                               num_processes=1))
    try:
        reader = iter(tds.Pipeline.range(100_000).apply(tds.distribute(
            "distributed_epoch", dispatcher.target, job_name="cut")))
        log = _journal(tmp_path) / "log_0"
        # Read until the log holds two records after the iteration's creation (one GetSplit
        # may hand all that 50 elements need before a reader's acknowledgement is journaled).
        deadline = time.monotonic() + 30
        while _records_after_creation(log) < 2:
            assert time.monotonic() < deadline, "the log holds no records after the iteration"
            for _ in range(50):
                next(reader)
        dispatcher.stop()
        # The first record after the iteration's creation: the iteration survives the cut,
        # what it handed out after does not.
        records = scan_records(log)[0]
        created = next(i for i, record in enumerate(records)
                       if "create_iteration" in kinds_of(Update.FromString(record)))
        _flip_record(log, created + 1)
        dispatcher = tds.DispatchServer(_config(tmp_path, port=port,
                                                journal_recovery="truncate"))
        with pytest.raises(Exception, match="journal was cut at damage"):
            for _ in range(100_000):
                next(reader)
    finally:
        worker.stop()
        dispatcher.stop()


@pytest.fixture
def tiny_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                            capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, f"cannot mount a tmpfs (root needed): {result.stderr}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=10, check=False)


def test_a_full_disk_fails_the_request_and_acknowledged_updates_survive(
        tiny_disk: Path) -> None:
    config = _config(tiny_disk)
    acknowledged = 0
    with tds.DispatchServer(config) as dispatcher:
        filler = tiny_disk / "filler"
        free = 256 * 1024 - sum(p.stat().st_size for p in tiny_disk.rglob("*") if p.is_file())
        filler.write_bytes(b"x" * max(0, free - 20_000))
        big = tds.Pipeline.from_items([bytes(3000)] * 2)  # ~6 KB definitions: partial writes
        refused = None
        for i in range(40):
            try:
                tds.register_dataset(dispatcher.target, big.map(lambda x, i=i: x))
                acknowledged += 1
            except Exception as error:  # noqa: BLE001 - the first refusal is what we test
                refused = error
                break
        assert refused is not None, "the disk never filled"
        assert "No space left" in str(refused) or "ENOSPC" in str(refused), refused
        filler.unlink()  # room again: the same dispatcher goes on journaling
        tds.register_dataset(dispatcher.target, tds.Pipeline.range(3))
        acknowledged += 1
    with tds.DispatchServer(config) as restarted:
        assert len(restarted._service.state.datasets) == acknowledged  # noqa: SLF001


def _fill(disk: Path) -> Path:
    """Write a file until the disk is full; returns it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"x" * size)
    finally:
        os.close(fd)
    return filler


def _ask_splits(service, iteration_id: int, task_id: int, replica: int, request_id: int,
                max_splits: int, finished=(), context=None) -> list[tuple[int, int]]:
    request = pb.GetSplitRequest(iteration_id=iteration_id, task_id=task_id, replica=replica,
                                 request_id=request_id, max_splits=max_splits)
    for repetition, index in finished:
        request.finished_splits.add(split=common_pb2.SplitKey(repetition=repetition,
                                                              index=index), elements=10)
    reply = service.GetSplit(request, context)
    return [(s.repetition, s.split_index) for s in (reply, *reply.following)]


def test_a_get_split_refused_by_a_full_disk_leaves_the_state_as_the_journal_holds_it(
        tiny_disk: Path) -> None:
    """A GetSplit's updates are applied as they are decided and journaled as one record at
    the end: when that append fails, the dispatcher goes back to what the journal holds, the
    request fails, and retried once there is room it hands the same splits."""
    service = make_service(Clock(), tiny_disk)
    iteration_id, _ = start_epoch(service, workers=("a:1",), num_splits=10_000)
    task = task_of(service, iteration_id, "a:1")
    held = _ask_splits(service, iteration_id, task, 1, 1, 64)
    filler = _fill(tiny_disk)
    (log,) = _journal(tiny_disk).glob("log_*")
    request_id = 0
    while (-log.stat().st_size) % 4096 > 1000:  # the log's last page has room: use it up
        request_id += 1  # with one-split requests of another replica (~40-byte records)
        _ask_splits(service, iteration_id, task, 2, request_id, 1)
    before = copy.deepcopy(service.state)
    # 64 splits reported produced and 64 handed: over 1,000 bytes, more than the page holds.
    with pytest.raises(RuntimeError, match="No space left on device"):
        _ask_splits(service, iteration_id, task, 1, 2, 64, held, context=Context())
    assert service.state == before  # nothing applied that the journal does not hold
    assert build(*replayed(tiny_disk)) == before
    filler.unlink()
    handed = _ask_splits(service, iteration_id, task, 1, 2, 64, held)
    assert len(handed) == 64 and not set(handed) & set(held)
    iteration = service.state.iteration(iteration_id)
    assert iteration.produced == dict.fromkeys(held, 10)
    live = service.state
    service.close()
    restarted = make_service(Clock(), tiny_disk)
    assert restarted.state == live
    restarted.close()
