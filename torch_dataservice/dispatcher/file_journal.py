"""FileJournal: the fault-tolerant dispatcher's write-ahead log of `Update` records.

Layout in `<work_dir>/dispatcher_journal/`:

    snapshot_<g>   one record: the whole state when log generation g started (optional)
    log_<g>        the updates applied after that, in order

The snapshot record is an `Update` of kind `snapshot` whose bytes are a `DispatcherSnapshot`
protobuf (dispatcher/snapshot.py, protos/torch_dataservice/v1/snapshot.proto), not a pickle: any
version that knows its schema version reads it, and reading it runs no code. Applying it
replaces the whole state, so replay yields it first, like any other update.

Replay reads the newest snapshot, then every log from its generation on, in order. Each
dispatcher incarnation appends to a new log (one past the highest existing file), so a torn
tail written by a crashed incarnation is never appended to. Compaction, when the current log
holds more than `compact_every` records and at least `log_share` times the last snapshot's
bytes (so a big state, a thousand workers' and readers', is not rewritten every few seconds:
a snapshot byte costs more CPU than a log byte, since the snapshot's protobuf is built from
the state in Python, so at the default LOG_SHARE compacting costs a fraction of what the log's
own writes do, and a restart replays at most that much log), fsyncs the log and starts
`log_<g+1>`, then writes `snapshot_<g+1>` (temp file, fsync, rename, fsync the directory) and
only then deletes the older files; a crash at any point leaves either the old files or the
new snapshot complete.
Only the start is on the request path: the state is copied under the dispatcher's lock (plain
containers, no protobuf, its biggest sets shared until they change: snapshot.copy_for_snapshot;
10-44 ms for 1,000 workers + 4,096 readers instead of 39-85), and a background thread builds the
snapshot from the copy (its per-split parts as columns of integers) and writes it
(`maybe_compact`), so requests do not wait for a snapshot of a big state to be built and
fsynced.

Record framing: 4-byte little-endian payload length, 4-byte CRC32 of the payload, payload (a
serialized `Update`, in snapshot files too). Only a record being written when the process died
can be torn, and its RPC never replied, so replay drops an incomplete last record of a file
with a warning: that loses nothing anyone was told. A bad record with more bytes after it is
corruption (appends only add whole records at the end): replay refuses it with
`JournalCorruptError` naming the file and offset, or, with `recovery="truncate"`, stops there
and reports what it discarded (`recovered_from`); the service then fails the iterations that
were running and compacts, so the damaged files are gone.

Durability is group commit: `append` writes the record (no fsync) under the dispatcher's lock,
in the order updates are applied (one record per request: several updates travel as one `batch`
update; journals of older versions, one record per update, replay the same); `sync` (called by
every RPC before it replies, with the lock released) fsyncs everything appended so far, and
concurrent callers share one fsync. A reply therefore never depends on an update that is not on
disk, while a slow fsync never holds the dispatcher's lock and is paid once per batch of
concurrent requests, not per split.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_dataservice.dispatcher import gc_pacing
from torch_dataservice.dispatcher.snapshot import copy_for_snapshot, snapshot_update
from torch_dataservice.errors import JournalCorruptError
from torch_dataservice.proto import dispatcher_pb2

logger = logging.getLogger(__name__)

Update = dispatcher_pb2.Update
JOURNAL_DIR = "dispatcher_journal"
HEADER = struct.Struct("<II")  # payload length, crc32(payload)
DEFAULT_COMPACT_EVERY = 10_000
LOG_SHARE = 4.0  # compact once the log holds this many times the last snapshot's bytes
_FILE_RE = re.compile(r"^(log|snapshot)_(\d+)$")


def encode_record(payload: bytes) -> bytes:
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass
class Damage:
    """Where a journal file stops being readable, and whether a crash explains it."""

    path: Path
    offset: int
    reason: str
    dropped_bytes: int  # from `offset` to the end of the file
    torn: bool  # an incomplete last record (a crash mid-append), not corruption


def scan_records(path: Path) -> tuple[list[bytes], Damage | None]:
    """The payloads of the intact records of `path`, and where it stops being readable.

    A torn tail is an incomplete last record: a header or payload cut short by the end of the
    file, or a last record whose checksum fails. Any bad record with bytes after it is
    corruption: appends only ever add whole records at the end.
    """
    data = path.read_bytes()
    records: list[bytes] = []
    position = 0
    while position < len(data):
        left = len(data) - position
        if left < HEADER.size:
            return records, Damage(path, position, "torn record header", left, torn=True)
        length, crc = HEADER.unpack_from(data, position)
        start = position + HEADER.size
        if start + length > len(data):
            return records, Damage(path, position, f"torn record ({len(data) - start} of "
                                   f"{length} bytes)", left, torn=True)
        payload = data[start:start + length]
        if zlib.crc32(payload) != crc:
            last = start + length == len(data)
            return records, Damage(path, position, "record fails its checksum", left,
                                   torn=last)
        records.append(payload)
        position = start + length
    return records, None


def read_records(path: Path) -> Iterator[bytes]:
    """Payloads of the intact records of `path`; stops (with a warning) at the first bad one."""
    records, damage = scan_records(path)
    yield from records
    if damage is not None:
        logger.warning("%s: %s at byte %d (%d bytes dropped)", path, damage.reason,
                       damage.offset, damage.dropped_bytes)


def _write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written: a nearly full disk may take part of it and
    return the count without an error (ENOSPC comes on the next call)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(f"write stored nothing ({written})")
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileJournal:
    """The journal of one dispatcher incarnation in `work_dir` (see the module docstring)."""

    def __init__(self, work_dir: str | os.PathLike[str],
                 compact_every: int = DEFAULT_COMPACT_EVERY, recovery: str = "fail",
                 log_share: float = LOG_SHARE) -> None:
        if compact_every < 1:
            raise ValueError(f"compact_every must be >= 1, got {compact_every!r}")
        if not log_share >= 0:
            raise ValueError(f"log_share must be >= 0, got {log_share!r}")
        if recovery not in ("fail", "truncate"):
            raise ValueError(f"recovery must be 'fail' or 'truncate', got {recovery!r}")
        self._recovery = recovery
        # Set by replay: the record being replayed (for errors), and the damage a
        # `recovery="truncate"` replay cut the journal at.
        self.replay_position = ""
        self.recovered_from: str | None = None
        self._dir = Path(work_dir) / JOURNAL_DIR
        self._dir.mkdir(parents=True, exist_ok=True)
        self._compact_every = compact_every
        self._log_share = log_share
        self._snapshot_bytes = 0  # the last snapshot's size (written by this incarnation)
        self._lock = threading.Lock()  # the file and the write position
        self._sync_lock = threading.Lock()  # one fsync at a time; waiters share its result
        for leftover in self._dir.glob("*.tmp"):  # a compaction that did not finish
            leftover.unlink()
        self._previous = self._files()
        generations = [g for _, g in self._previous]
        self._generation = max(generations, default=-1) + 1
        self._fd = self._open_log(self._generation)  # fail fast if the dir is not writable
        self._records = 0
        self._broken: str | None = None  # why appends are refused (a torn record remains)
        self._written = 0  # bytes appended to the current log
        self._synced = 0  # bytes of it known to be on disk
        self.on_fsync: Callable[[float], None] | None = None  # seconds (metrics)
        self._compactor: threading.Thread | None = None  # writing the last snapshot

    @property
    def directory(self) -> Path:
        return self._dir

    def _files(self) -> list[tuple[str, int]]:
        found = []
        for entry in self._dir.iterdir():
            match = _FILE_RE.match(entry.name)
            if match:
                found.append((match.group(1), int(match.group(2))))
        return found

    def _path(self, kind: str, generation: int) -> Path:
        return self._dir / f"{kind}_{generation}"

    def _open_log(self, generation: int) -> int:
        fd = os.open(self._path("log", generation), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
        _fsync_dir(self._dir)
        return fd

    # ------------------------------------------------------------------ reading
    def replay(self) -> Iterator[Update]:
        """Every update of the previous incarnations: the newest snapshot, then the logs."""
        return self._read(self._previous)

    def reread(self) -> Iterator[Update]:
        """Every update on disk now, this incarnation's too: what a restart would replay.

        For a service whose append failed after it changed its state (service.py): it
        rebuilds the state from this. A torn record a failed append could not cut off is
        dropped, as replay drops it.
        """
        self.wait_compacted()  # the files are then the last snapshot and the logs after it
        with self._lock:
            files = self._files()
        return self._read(files)

    def _read(self, files: list[tuple[str, int]]) -> Iterator[Update]:
        snapshots = [g for kind, g in files if kind == "snapshot"]
        start = max(snapshots, default=0)
        if snapshots:
            records = list(read_records(self._path("snapshot", start)))
            if len(records) != 1:
                raise RuntimeError(f"journal snapshot {self._path('snapshot', start)} is "
                                   "damaged; it was written atomically, so the disk is at fault")
            snapshot = Update.FromString(records[0])
            if snapshot.WhichOneof("kind") != "snapshot":
                raise RuntimeError(f"journal snapshot {self._path('snapshot', start)} holds a "
                                   f"{snapshot.WhichOneof('kind')!r} update, not a snapshot")
            self.replay_position = f"the snapshot {self._path('snapshot', start)}"
            yield snapshot
        logs = sorted(g for kind, g in files if kind == "log" and g >= start)
        for i, generation in enumerate(logs):
            path = self._path("log", generation)
            records, damage = scan_records(path)
            for number, payload in enumerate(records):
                self.replay_position = f"record {number} of {path}"
                yield Update.FromString(payload)
            if damage is None:
                continue
            later = [self._path("log", g) for g in logs[i + 1:]
                     if self._path("log", g).stat().st_size]  # not the empty ones of refused starts
            if damage.torn:
                logger.warning("%s: %s at byte %d, from a crash mid-append: dropped (it was "
                               "never acknowledged)", path, damage.reason, damage.offset)
                continue
            self._on_corruption(damage, later)
            return

    def _on_corruption(self, damage: Damage, later: list[Path]) -> None:
        """Refuse a journal damaged in the middle, or (recovery="truncate") cut it there."""
        lost = sum(len(scan_records(p)[0]) for p in later)
        where = (f"journal file {damage.path} is damaged at byte {damage.offset} "
                 f"({damage.reason}, {damage.dropped_bytes - HEADER.size} bytes follow it"
                 + (f", and {len(later)} later log file(s) hold {lost} record(s)" if later
                    else "") + ")")
        if self._recovery != "truncate":
            raise JournalCorruptError(
                f"{where}: this is not a torn tail from a crash, and replaying around it would "
                "roll the dispatcher back and hand out data again. Restore the work dir from "
                "a backup, or start with --journal-recovery truncate (DispatcherConfig("
                "journal_recovery='truncate')) to drop the damaged record and everything "
                "after it")
        self.recovered_from = where
        logger.warning("%s: journal recovery 'truncate' discards the damaged record, the rest "
                       "of that file and %d committed record(s) of later files; iterations "
                       "that were running fail for their readers", where, lost)

    # ------------------------------------------------------------------ writing
    def append(self, update: Update) -> None:
        """Write `update` at the end of the log; durable after the next `sync()`."""
        record = encode_record(update.SerializeToString())
        with self._lock:
            if self._broken is not None:
                raise OSError(f"the journal cannot be appended to since {self._broken}; "
                              "restart the dispatcher once the disk has room")
            try:
                _write_all(self._fd, record)
            except OSError as error:
                self._undo_partial_append(error)
                raise
            self._written += len(record)
            self._records += 1

    def _undo_partial_append(self, error: OSError) -> None:
        """Cut a partly written record off the log (a full disk), so the log ends with whole
        records; if even that fails, refuse every later append: the update is not durable and
        nothing may be appended after a torn record."""
        logger.error("journal %s: append failed (%s); the record is not kept",
                     self._path("log", self._generation), error)
        try:
            os.ftruncate(self._fd, self._written)
        except OSError as truncate_error:
            self._broken = f"a failed append left a torn record ({truncate_error})"

    def sync(self) -> None:
        """Return once everything appended before this call is on disk (group commit)."""
        with self._lock:
            generation, target = self._generation, self._written
        if self._synced >= target:
            return
        with self._sync_lock:
            with self._lock:
                if generation != self._generation or self._fd < 0:
                    return  # a log that has ended (fsynced then) or closed (fsynced)
                fd, written = self._fd, self._written
            if self._synced >= target:
                return  # the fsync we waited for covered us
            started = time.perf_counter()
            os.fsync(fd)
            if self.on_fsync is not None:
                self.on_fsync(time.perf_counter() - started)
            self._synced = max(self._synced, written)

    def maybe_compact(self, state: Any) -> bool:
        """Replace everything so far by a snapshot of `state` when the log has grown long.

        Called right after an update is applied, under the dispatcher's lock, so `state`
        reflects exactly the records appended so far. Only a copy of `state` and the switch to
        a new log happen here; the snapshot is built and written by a background thread (one
        at a time: a compaction due while the last is being written waits for it).
        """
        with self._lock:
            if (self._records < self._compact_every
                    or self._written < self._log_share * self._snapshot_bytes):
                return False
        self.wait_compacted()
        copy, generation = self._start_generation(state)
        self._compactor = threading.Thread(target=self._write_snapshot, args=(copy, generation),
                                           name="journal-compaction", daemon=True)
        self._compactor.start()
        return True

    def compact(self, state: Any) -> None:
        """Compact now, in this thread: the snapshot is on disk when this returns."""
        self.wait_compacted()
        self._write_snapshot(*self._start_generation(state))

    def wait_compacted(self) -> None:
        """Return once the snapshot being written (if any) is on disk and the old files gone."""
        compactor = self._compactor
        if compactor is not None:
            compactor.join()
            self._compactor = None

    def _start_generation(self, state: Any) -> tuple[Any, int]:
        """Copy `state` and continue in a new log; the old one is fsynced (sync() returns at
        once for a generation that has ended). Returns the copy and the new generation."""
        with gc_pacing.bulk():
            copy = copy_for_snapshot(state)
        with self._sync_lock, self._lock:
            os.fsync(self._fd)
            generation = self._generation + 1
            old_fd = self._fd
            self._fd = self._open_log(generation)
            os.close(old_fd)
            self._generation = generation
            self._records = self._written = self._synced = 0
        return copy, generation

    def _write_snapshot(self, copy: Any, generation: int) -> None:
        """Write `snapshot_<generation>` from a copy of the state, then delete older files."""
        snapshot = snapshot_update(copy).SerializeToString()
        self._snapshot_bytes = len(snapshot)
        final = self._path("snapshot", generation)
        temp = final.with_name(final.name + ".tmp")
        with open(temp, "wb") as f:
            f.write(encode_record(snapshot))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
        _fsync_dir(self._dir)
        for kind, g in self._files():
            if g < generation:
                self._path(kind, g).unlink(missing_ok=True)
        self._previous = []
        logger.info("journal compacted into %s (%d bytes)", final, len(snapshot))

    def close(self) -> None:
        self.wait_compacted()
        with self._sync_lock, self._lock:
            if self._fd < 0:
                return
            fd, self._fd = self._fd, -1
            os.fsync(fd)
            os.close(fd)
